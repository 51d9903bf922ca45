"""Fault injection for the fault tests (tests/test_faults.py), read from the environment (in launch/, the
lowest layer that knows processes: the exchange and the runtime fire these hooks too):

MPITRAIN_INJECT_NAN=RANK:STEP   worker RANK reports a NaN loss at its own step STEP
MPITRAIN_INJECT_KILL=RANK:STEP  worker RANK SIGKILLs itself at its own step STEP (as the OOM
                                killer or `kill -9` would)
MPITRAIN_INJECT_KILL=RANK:report  ... right after it sent rank 0 its end-of-run report
MPITRAIN_INJECT_KILL=0:letin      rank 0, 1 s after it let a --join worker in and asked for room (its
                                heartbeats carry that stop request to the workers meanwhile), before
                                it makes room (the joiner waits for its GO: tests/test_join.py)
MPITRAIN_INJECT_KILL=RANK:takeover ... a successor, once it has told the others it takes over from a lost
                                rank 0 (failover.py), before the new world forms
MPITRAIN_INJECT_KILL=RANK:STEP:locked   --ps-transport shm: ... holding the store's lock, before applying
MPITRAIN_INJECT_KILL=RANK:STEP:applying ... with its gradient applied to the store, the version not yet
                                advanced (half-way through its step, as rank 0 and the others see it)
MPITRAIN_INJECT_KILL=RANK:STEP:stepped  ... its step counted, its block of the deal not yet marked applied
MPITRAIN_INJECT_KILL=RANK:0:opening ... before it has the store's name from rank 0 (open_store)
MPITRAIN_INJECT_KILL=RANK:STEP:mailing async, a worker with a mailbox (exchange/mailbox.py): half-way
                                through writing its push, before the counter announces it
MPITRAIN_INJECT_EXIT=RANK:STEP  worker RANK exits at its own step STEP without a word (exit 137,
                                a SIGKILLed rank's code: a Python API script has no supervisor)
MPITRAIN_INJECT_RAISE=RANK:STEP worker RANK raises an unexpected exception at its own step STEP
                                (a bug: its traceback, then MPI_Abort ends every rank)
MPITRAIN_INJECT_RAISE=RANK:connect ... rank RANK, in the collectives that start a phase (the others wait in them)
MPITRAIN_INJECT_HANG=RANK:STEP:SEC worker RANK's training thread stops for SEC seconds at its
                                own step STEP, its heartbeats going on (alive, not progressing:
                                a rank stuck in a slow read or a lock; tests/test_observe.py)
MPITRAIN_INJECT_STUCK=RANK:STEP rank RANK (a server) makes its first MPI test at or after global step
                                STEP never return, as MPICH's does when a sender died half-way
                                through handing it a message (stuck.py; tests/test_chaos.py)
MPITRAIN_INJECT_JOIN=vanish     a --join worker SIGKILLs itself once the job has let it in, before
                                the job's GO (it died while the job made room: tests/test_join.py)
MPITRAIN_INJECT_JOIN=formed     ... once the new world has formed, before its phase starts (it
                                died in the job's collectives: join.Carry.start_forming)
MPITRAIN_INJECT_JOIN=deaf       ... writes its request but never waits in accept (slow, or its port
                                broken): rank 0's connect times out (once: lobby)
MPITRAIN_INJECT_SPARE=taken     rank 0 SIGKILLs the first spare it takes for a lost worker (--spares), as if it
                                died as the job made room for it (tests/test_spares.py)
MPITRAIN_INJECT_SLOW_SETUP=SEC  a worker the job started (--respawn) takes SEC seconds longer to load its
                                data, as a large dataset on a slow file system does (tests/test_respawn.py)
MPITRAIN_INJECT_SLOW_START=SEC  a --join worker (one the job started with --respawn too) waits SEC seconds before
                                MPI_Init, so rank 0's MPI_Comm_spawn takes that much longer, as on a loaded machine
MPITRAIN_INJECT_OFFHOST=RANK,...  --ps-transport shm: these workers take the message path as a worker on
                                another host than rank 0's does (modes/shm_remote.py, tested on one host)
MPITRAIN_INJECT_STRANGER=RANK,...  these ranks count as another launch's on this host (a --respawn's or a
                                --join's): async's exchange with rank 0 takes a mailbox (stranger_ranks,
                                read in node.py)
MPITRAIN_FORM_LIMIT_S=SEC       how long every rank waits for such a world before it ends itself
                                (join.FORM_LIMIT_S, 30 s; the test that kills there waits less)

MPITRAIN_TRACE_BATCHES=DIR      every sync worker appends to DIR/rank-R.txt, for each batch it takes, a line
                                "PHASE STEP EPOCH ROW...": the samples, for a test to check what each epoch
                                trained from the workers' side (core/ledger.py; tests/test_ledger.py); in
                                async rank 0 appends to DIR/applied-PID.txt "FIRST COUNT STEP" for each block
                                of batches it applies (AppliedTrace; tests/test_failover.py)

MPITRAIN_TEST_BACKEND=server     the parameter servers compute on CopyingBackend: NumPy arrays
                                that never share memory with message buffers, as a GPU's do not
                                (the --ps-device gpu data path, tested on a CPU; tests/test_seams.py)

and, for kills from outside at random moments (benchmarks/chaos.py, tests/test_chaos.py), where
each rank's real training process is (`rank_pids`).
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np

from mpitrain.core.backend import Backend
from mpitrain.core.codec import decode, encode
from mpitrain.launch.samehost import stat_fields


class CopyingBackend(Backend):
    """NumPy, but every array is its own memory: mirror, asarray and to_host copy, upload and
    download convert, as between a GPU and pinned host buffers. Code that skipped a staging step
    (used a message buffer as the parameters, or the reverse) trains differently here."""

    description = "CPU (NumPy, copying as a GPU backend: MPITRAIN_TEST_BACKEND)"

    def mirror(self, host: np.ndarray):
        return np.zeros(host.shape, np.float32)

    def upload(self, dev, host: np.ndarray) -> None:
        decode(np, host, dev)

    def download(self, dev, host: np.ndarray) -> None:
        encode(np, dev, host)

    def asarray(self, a):
        return np.array(a, copy=True)

    def to_host(self, a) -> np.ndarray:
        return np.array(a, copy=True)


def copying_backend_for(role: str, env=os.environ) -> CopyingBackend | None:
    """MPITRAIN_TEST_BACKEND=ROLE: a CopyingBackend for that role's ranks, else None."""
    return CopyingBackend() if env.get("MPITRAIN_TEST_BACKEND") == role else None


def injected_step(var: str, rank: int, env=os.environ) -> int | None:
    """STEP when `var` is RANK:STEP for this rank, else None."""
    who, _, step = env.get(var, "").partition(":")
    return int(step) if who.isdigit() and int(who) == rank and step.isdigit() else None


class Kill:
    """MPITRAIN_INJECT_KILL, _EXIT, _RAISE and _HANG for this rank: `at(pushed)` kills the process
    (raises, or holds its training thread) at the step, `after_report()` kills it once its report
    is sent."""

    def __init__(self, rank: int, env=os.environ):
        self.step = injected_step("MPITRAIN_INJECT_KILL", rank, env)
        self.raise_step = injected_step("MPITRAIN_INJECT_RAISE", rank, env)
        self.exit_step = injected_step("MPITRAIN_INJECT_EXIT", rank, env)
        self.report = env.get("MPITRAIN_INJECT_KILL") == f"{rank}:report"
        self.takeover = env.get("MPITRAIN_INJECT_KILL") == f"{rank}:takeover"
        self.letin = env.get("MPITRAIN_INJECT_KILL") == f"{rank}:letin"
        self.connect_raise = env.get("MPITRAIN_INJECT_RAISE") == f"{rank}:connect"
        spec, _, seconds = env.get("MPITRAIN_INJECT_HANG", "").rpartition(":")
        self.hang_step = injected_step("MPITRAIN_INJECT_HANG", rank, {"MPITRAIN_INJECT_HANG": spec})
        self.hang_s = float(seconds) if self.hang_step is not None else 0.0

    def at(self, pushed: int) -> None:
        if pushed == self.step:
            os.kill(os.getpid(), signal.SIGKILL)
        if pushed == self.exit_step:
            os._exit(128 + signal.SIGKILL)
        if pushed == self.raise_step:
            raise RuntimeError(f"MPITRAIN_INJECT_RAISE at its own step {pushed}")
        if pushed == self.hang_step:
            time.sleep(self.hang_s)

    def connecting(self) -> None:
        if self.connect_raise:
            raise RuntimeError("MPITRAIN_INJECT_RAISE as the phase starts")

    def after_report(self) -> None:
        if self.report:
            os.kill(os.getpid(), signal.SIGKILL)

    def taking_over(self) -> None:
        if self.takeover:
            os.kill(os.getpid(), signal.SIGKILL)

    def let_in(self) -> None:
        if self.letin:
            time.sleep(1.0)
            os.kill(os.getpid(), signal.SIGKILL)


# Where in a --ps-transport shm push (exchange/shm.py): holding shard 0's lock, half-way through its
# apply, its step counted and its block not yet marked, half-way through shard 1's (--num-ps 2: shard 0
# applied, the rest not); or, at step 0, before the worker has mapped the store at all (open_store).
# Async's mailbox (exchange/mailbox.py): half-way through writing a push, its counter not yet announcing it.
# The message path with --num-ps (exchange/mpi.py): its push sent to the other servers, not to rank 0.
PUSH_KILL_POINTS = ("locked", "applying", "stepped", "sharded", "opening", "mailing", "parted")


def push_kill(rank: int, env=os.environ) -> tuple[int, str] | None:
    """MPITRAIN_INJECT_KILL=RANK:STEP:POINT for this rank: (own step, point), else None."""
    spec, _, point = env.get("MPITRAIN_INJECT_KILL", "").rpartition(":")
    step = injected_step("MPITRAIN_INJECT_KILL", rank, {"MPITRAIN_INJECT_KILL": spec})
    return (step, point) if step is not None and point in PUSH_KILL_POINTS else None


def kill_here() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def stuck_from(rank: int, env=os.environ) -> int | None:
    """MPITRAIN_INJECT_STUCK: the global step from which this rank's MPI tests never return."""
    return injected_step("MPITRAIN_INJECT_STUCK", rank, env)


def never_returns(*_args) -> None:
    """A test of MPI requests that never comes back (the GIL released, as in mpi4py's calls)."""
    while True:
        time.sleep(3600)


def rank_pids(root: int, supervised: bool = True) -> dict[int, tuple[int, int | None]]:
    """For the chaos tests: MPI rank -> (pid of the training process, pid of its supervisor or
    None), among the descendants of process `root` (mpirun), read from /proc. Under hydra the
    supervisor, a fork of the same `python -m mpitrain`, carries the rank's variables too: the
    training process is the one whose parent is a rank. With `supervised`, a rank whose launcher
    gives it a supervisor (mpiimpl.needs_supervisor) but whose training process is not forked yet
    is left out (so a caller never kills a supervisor by mistake). A process the job spawned itself
    (--respawn: rank 0 of a world of its own, its command carrying --join) never takes the place of
    the job's own rank 0 (spawned_pids names those)."""
    from mpitrain.launch.mpiimpl import launcher_rank, needs_supervisor

    parents, procs = _processes()
    ranks, expect_supervisor = {}, {}
    for pid, (_, env) in procs.items():
        rank = launcher_rank(env)
        if rank is not None:
            ranks[pid] = rank
            expect_supervisor[pid] = supervised and needs_supervisor(env)

    out = {}
    joined = {pid for pid, (args, env) in procs.items() if _spawned_or_joined(args, env)}
    for pid, rank in sorted(ranks.items(), key=lambda item: item[0] in joined):  # the job's own ranks first
        if not _descends(pid, root, parents) or (pid in joined and rank in out):
            continue
        parent = parents.get(pid)
        if parent in ranks:  # pid is the rank, its parent the supervisor
            out[rank] = (pid, parent)
        elif rank not in out and not expect_supervisor[pid]:  # no supervisor (Open MPI, srun, MPITRAIN_SUPERVISE=0)
            out[rank] = (pid, None)
    return out


def _processes() -> tuple[dict[int, int], dict[int, tuple[list[bytes], dict[str, str]]]]:
    """From /proc: every process's parent, and the arguments and environment of each that runs mpitrain."""
    parents, procs = {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            parents[pid] = int(stat_fields(pid)[1])
            cmd = open(f"/proc/{pid}/cmdline", "rb").read()
            if b"mpitrain" in cmd:
                raw = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
                # Words, not argv: a supervised rank's title is one string (supervise.py, setproctitle)
                procs[pid] = (cmd.replace(b"\0", b" ").split(), dict(v.decode(errors="replace").partition("=")[::2]
                                                      for v in raw if b"=" in v))
        except (OSError, ValueError, IndexError):
            continue
    return parents, procs


def _spawned_or_joined(args: list[bytes], env: dict[str, str]) -> bool:
    """A process of --join or --respawn: its command says --join, or hydra says it spawned it (a
    supervised rank's title may have lost the command's end: supervise._name)."""
    return b"--join" in args or env.get("PMI_SPAWNED") == "1"


def _descends(pid: int, root: int, parents: dict[int, int]) -> bool:
    while pid > 1:
        if pid == root:
            return True
        pid = parents.get(pid, 0)
    return False


def spawned_pids(root: int) -> list[int]:
    """--respawn: the training processes that a job under `root` (mpirun) started itself, whose
    command carries --join. rank_pids cannot name them: each is rank 0 of a world of its own. Under
    hydra the training process is the one whose parent, its supervisor, was spawned too; a
    supervisor whose rank is not forked yet is left out (as in rank_pids)."""
    from mpitrain.launch.mpiimpl import needs_supervisor

    parents, procs = _processes()
    spawned = {pid for pid, (args, env) in procs.items() if _spawned_or_joined(args, env)}
    return sorted(pid for pid in spawned if _descends(pid, root, parents)
                  and (parents.get(pid) in spawned or not needs_supervisor(procs[pid][1])))


def session_pids(sid: int) -> list[int]:
    """The live processes of session `sid` (a job started with start_new_session: mpirun and all it
    started). A zombie has ended: a container's PID 1 may never reap it."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = stat_fields(int(entry))
            state, session = fields[0], int(fields[3])
        except (OSError, ValueError, IndexError):
            continue
        if session == sid and state != "Z":
            found.append(int(entry))
    return found


# A rank may still be on its way out when mpirun has returned: that is not an orphan. Open MPI's
# prted sends a rank SIGTERM, then SIGKILL a second later ("SENDING SIGTERM" / "SENDING SIGKILL");
# a rank that took the SIGTERM as a stop request (stopping.py) is gone 0.98-1.00 s after prterun
# returned (measured, 5.0.11, an aborted sync job's rank 0), which a 1.0 s bound failed 1 time in 6.
LINGER_S = 2.0


def kill_session(sid: int, linger_s: float = 0.0) -> bool:
    """SIGKILL every process of session `sid` still there `linger_s` after the call. Not its process
    group: Open MPI puts each rank in a group of its own, so a killpg of mpirun's left the ranks
    running (writing checkpoints). True if any was there."""
    deadline = time.monotonic() + linger_s
    while session_pids(sid) and time.monotonic() < deadline:
        time.sleep(0.02)
    found = False
    for pid in session_pids(sid):
        try:
            os.kill(pid, signal.SIGKILL)
            found = True
        except ProcessLookupError:
            pass
    return found


class BatchTrace:
    """MPITRAIN_TRACE_BATCHES: one line per batch a sync worker takes. A phase (a loop started at a
    regroup, a join or the start) is named by when it began, so that a reader can tell the steps a
    regroup redid (the later phase's) from the ones it gave up."""

    def __init__(self, directory: str, rank: int, step0: int):
        self.file = open(os.path.join(directory, f"rank-{rank}.txt"), "a", buffering=1)  # whole lines, as they come
        self.phase = f"{step0}:{time.monotonic():.6f}"

    def took(self, step: int, epoch: int, rows) -> None:
        self.file.write(f"{self.phase} {step} {epoch} {' '.join(str(int(r)) for r in rows)}\n")


def batch_trace(rank: int, step0: int, env=os.environ) -> BatchTrace | None:
    directory = env.get("MPITRAIN_TRACE_BATCHES")
    return BatchTrace(directory, rank, step0) if directory else None


class AppliedTrace:
    """MPITRAIN_TRACE_BATCHES, async: one line per block of batch numbers rank 0 applies, `FIRST COUNT STEP` (the
    global step the update made), in a file of this process's own: a successor after a take-over writes its own,
    and a reader keeps the lost rank 0's lines up to the step the take-over went on from. Another server of
    --num-ps writes `server<RANK>-applied-<PID>.txt`: the blocks its slice holds."""

    def __init__(self, directory: str, name: str = "applied"):
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND
        self.fd = os.open(os.path.join(directory, f"{name}-{os.getpid()}.txt"), flags, 0o644)

    def applied(self, block, step: int) -> None:
        os.write(self.fd, f"{int(block[0])} {int(block[1])} {step}\n".encode())  # one write: a whole line if killed


def applied_trace(name: str = "applied", env=os.environ) -> AppliedTrace | None:
    directory = env.get("MPITRAIN_TRACE_BATCHES")
    return AppliedTrace(directory, name) if directory else None


def offhost_ranks(env=os.environ) -> set[int]:
    """MPITRAIN_INJECT_OFFHOST: the worker ranks to treat as on another host than the store's."""
    return {int(r) for r in env.get("MPITRAIN_INJECT_OFFHOST", "").split(",") if r.strip()}


def joiner_deaf() -> bool:
    """MPITRAIN_INJECT_JOIN=deaf: the joiner never waits in accept (the job cannot connect to it)."""
    return os.environ.get("MPITRAIN_INJECT_JOIN") == "deaf"


def slow_setup() -> None:
    """MPITRAIN_INJECT_SLOW_SETUP=SEC: this worker's set-up takes SEC seconds longer."""
    time.sleep(float(os.environ.get("MPITRAIN_INJECT_SLOW_SETUP", "0")))


def slow_start() -> None:
    """MPITRAIN_INJECT_SLOW_START=SEC: this --join worker waits SEC seconds before MPI_Init."""
    time.sleep(float(os.environ.get("MPITRAIN_INJECT_SLOW_START", "0")))


def spare_taken(pid: int) -> None:
    """MPITRAIN_INJECT_SPARE=taken: rank 0 kills the first spare it takes (and waits until it is gone)."""
    if os.environ.get("MPITRAIN_INJECT_SPARE") == "taken" and not _SPARES_KILLED:
        _SPARES_KILLED.append(pid)
        os.kill(pid, signal.SIGKILL)
        while _state(pid) not in ("Z", None):
            time.sleep(1e-3)


_SPARES_KILLED: list[int] = []


def _state(pid: int) -> str | None:
    """The process's state letter (samehost.stat_fields), None once it is gone."""
    try:
        return stat_fields(pid)[0]
    except OSError:
        return None


def joiner_vanishes(when: str) -> None:
    """MPITRAIN_INJECT_JOIN=`when`: the joiner dies here ("vanish": let in, before the job's GO;
    "formed": once the new world has formed)."""
    if os.environ.get("MPITRAIN_INJECT_JOIN") == when:
        os.kill(os.getpid(), signal.SIGKILL)


def stranger_ranks(env=os.environ) -> set[int]:
    """MPITRAIN_INJECT_STRANGER: ranks to treat as another launch's on this host, so that async's mailbox
    (exchange/mailbox.py) is used without a --respawn or a --join."""
    return {int(r) for r in env.get("MPITRAIN_INJECT_STRANGER", "").split(",") if r.strip()}
