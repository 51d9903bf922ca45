"""Fault injection for the fault tests (tests/test_faults.py), read from the environment:

MPITRAIN_INJECT_NAN=RANK:STEP   worker RANK reports a NaN loss at its local step STEP
MPITRAIN_INJECT_KILL=RANK:STEP  worker RANK SIGKILLs itself at its local step STEP (as the OOM
                                killer or `kill -9` would)
MPITRAIN_INJECT_KILL=RANK:report  ... right after it sent rank 0 its end-of-run report
MPITRAIN_INJECT_HANG=RANK:STEP:SEC worker RANK's training thread stops for SEC seconds at its
                                local step STEP, its heartbeats going on (alive, not progressing:
                                a rank stuck in a slow read or a lock; tests/test_observe.py)

and, for kills from outside at random moments (benchmarks/chaos.py, tests/test_chaos.py), where
each rank's real training process is (`rank_pids`).
"""

from __future__ import annotations

import os
import signal
import time


def injected_step(var: str, rank: int, env=os.environ) -> int | None:
    """STEP when `var` is RANK:STEP for this rank, else None."""
    who, _, step = env.get(var, "").partition(":")
    return int(step) if who.isdigit() and int(who) == rank and step.isdigit() else None


class Kill:
    """MPITRAIN_INJECT_KILL and _HANG for this rank: `at(local_step)` kills the process (or holds
    its training thread) at the step, `after_report()` kills it once its report is sent."""

    def __init__(self, rank: int, env=os.environ):
        self.step = injected_step("MPITRAIN_INJECT_KILL", rank, env)
        self.report = env.get("MPITRAIN_INJECT_KILL") == f"{rank}:report"
        spec, _, seconds = env.get("MPITRAIN_INJECT_HANG", "").rpartition(":")
        self.hang_step = injected_step("MPITRAIN_INJECT_HANG", rank, {"MPITRAIN_INJECT_HANG": spec})
        self.hang_s = float(seconds) if self.hang_step is not None else 0.0

    def at(self, local_step: int) -> None:
        if local_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)
        if local_step == self.hang_step:
            time.sleep(self.hang_s)

    def after_report(self) -> None:
        if self.report:
            os.kill(os.getpid(), signal.SIGKILL)


def rank_pids(root: int, supervised: bool = True) -> dict[int, tuple[int, int | None]]:
    """For the chaos tests: MPI rank -> (pid of the training process, pid of its supervisor or
    None), among the descendants of process `root` (mpirun), read from /proc. Under hydra the
    supervisor, a fork of the same `python -m mpitrain`, carries PMI_RANK too: the training
    process is the one whose parent is a rank. With `supervised`, a rank whose training process
    is not forked yet is left out (so a caller never kills a supervisor by mistake)."""
    parents, ranks = {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            parents[pid] = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            cmd = open(f"/proc/{pid}/cmdline", "rb").read()
        except (OSError, ValueError, IndexError):
            continue
        rank = next((int(v[9:]) for v in env if v.startswith(b"PMI_RANK=") and v[9:].isdigit()), None)
        if rank is not None and b"mpitrain" in cmd:
            ranks[pid] = rank

    def descends(pid: int) -> bool:
        while pid > 1:
            if pid == root:
                return True
            pid = parents.get(pid, 0)
        return False

    out = {}
    for pid, rank in ranks.items():
        if not descends(pid):
            continue
        parent = parents.get(pid)
        if parent in ranks:  # pid is the rank, its parent the supervisor
            out[rank] = (pid, parent)
        elif rank not in out and not supervised:  # no supervisor (MPITRAIN_SUPERVISE=0, srun)
            out[rank] = (pid, None)
    return out
