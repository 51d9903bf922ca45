"""The real failure behind stuck.py, provoked often: a sender SIGKILLed half-way through handing rank 0 a message.

    python benchmarks/stuck_probe.py                 # 300 trials, ~20 min on 2 cores; writes benchmarks/STUCK.md
    python benchmarks/stuck_probe.py --trials 20     # a quick look

Each trial starts `mpirun -disable-auto-cleanup -np 3` of this file: ranks 1 and 2 `Isend` 64-byte
messages to rank 0 as fast as they can (every message is one enqueue into rank 0's MPICH
shared-memory queue, so a kill often lands inside one), rank 0 receives them through mpitrain's
own Poller with mpitrain's watchdog armed (stuck.WATCHDOG, bound BOUND_S) and prints a line every
0.2 s. One sender is SIGKILLed from outside at a random moment. Outcomes:

  goes on   rank 0 keeps receiving from the other sender (the usual case)
  ended     rank 0's MPI never returned, and the watchdog ended it with its one line (stuck.py)
  hang      rank 0 went silent and did not end within BOUND_S + GRACE_S: the watchdog failed

Under MPICH only (the queue is MPICH's; Open MPI's shared memory is another design).
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from results import record  # noqa: E402  (same folder)

BOUND_S = 2.0
GRACE_S = 3.0
TAG = 1
RANK_ARG = "--rank-of-mpitrain-probe"  # the ranks' command (faults.rank_pids finds "mpitrain" in it)


def rank_main() -> None:
    from support import supervise

    supervise()  # a killed sender must not take rank 0 with it (hydra)
    import numpy as np
    from mpi4py import MPI

    from support import MPICH, WATCHDOG, Poller, unlink_init_shm

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    comm.Barrier()  # every rank past MPI_Init: the node's segment may go (a killed job leaves it otherwise)
    unlink_init_shm(MPICH.shm_prefix)
    if rank == 0:
        WATCHDOG.arm(0, BOUND_S)
        bufs = [np.empty(64, np.uint8) for _ in range(size - 1)]
        reqs = [comm.Irecv(bufs[i], source=i + 1, tag=TAG) for i in range(size - 1)]
        poller, got, last = Poller(0.0), 0, time.monotonic()
        print("ready", flush=True)
        while True:
            done = poller.some(reqs)
            for i in done.arrived:
                reqs[i] = comm.Irecv(bufs[i], source=i + 1, tag=TAG)
                got += 1
            for i in done.failed:
                reqs[i] = MPI.REQUEST_NULL
            if time.monotonic() - last > 0.2:
                print(f"alive {got}", flush=True)
                last = time.monotonic()
    buf = np.ones(64, np.uint8)
    while True:
        req = comm.Isend(buf, dest=0, tag=TAG)
        while not req.Test():
            pass


def trial(rng: random.Random) -> str:
    from run import env, mpirun

    from support import kill_session, rank_pids

    proc = subprocess.Popen([mpirun(), "-disable-auto-cleanup", "-np", "3", sys.executable, __file__, RANK_ARG],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env(),
                            start_new_session=True)
    lines: list[tuple[float, str]] = []
    reader = threading.Thread(target=lambda: [lines.append((time.monotonic(), ln)) for ln in proc.stdout], daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 30
        while not any("ready" in ln for _, ln in lines):
            if time.monotonic() > deadline or proc.poll() is not None:
                return "did not start"
            time.sleep(0.02)
        time.sleep(rng.uniform(0.2, 1.0))
        pids = rank_pids(proc.pid)
        os.kill(pids[rng.choice([1, 2])][0], signal.SIGKILL)
        killed = time.monotonic()
        rank0 = pids[0][0]
        while time.monotonic() < killed + BOUND_S + GRACE_S:
            if any("MPI has not returned" in ln for _, ln in lines):
                return "ended"
            time.sleep(0.05)
        alive = [t for t, ln in lines if ln.startswith("alive") and t > killed + BOUND_S]
        gone = not os.path.exists(f"/proc/{rank0}")
        return "goes on" if alive and not gone else "hang"
    finally:
        kill_session(proc.pid)
        proc.wait()


def main() -> int:
    if RANK_ARG in sys.argv:
        rank_main()
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=300)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "STUCK.md"))
    a = p.parse_args()
    from run import machine

    seed = a.seed if a.seed is not None else int(time.time())
    rng, counts, t0 = random.Random(seed), {}, time.perf_counter()
    for i in range(1, a.trials + 1):
        outcome = trial(rng)
        counts[outcome] = counts.get(outcome, 0) + 1
        print(f"[{i}/{a.trials}] {outcome}", flush=True)
    text = "\n".join([
        "# A sender killed mid-enqueue: does the watchdog end a rank whose MPI never returns?", "",
        f"`python benchmarks/stuck_probe.py --trials {a.trials}`, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"on {machine()}; seed {seed}; {(time.perf_counter() - t0) / 60:.1f} min. See the script's docstring for the "
        f"set-up and what each outcome means (watchdog bound {BOUND_S:g} s).", "",
        "| outcome | trials |", "|---|---|",
        *[f"| {k} | {v} |" for k, v in sorted(counts.items())], "",
        f"**{counts.get('hang', 0)} hangs in {a.trials} kills.**", ""])
    record(a.out, text)
    print(text)
    return 0 if not counts.get("hang") else 1


if __name__ == "__main__":
    sys.exit(main())
