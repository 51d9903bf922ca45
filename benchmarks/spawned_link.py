"""How fast rank 0 exchanges with a spawned worker (--respawn) against one of the job's own, under MPICH.

    python benchmarks/spawned_link.py            # 5 repetitions, ~1 min on 2 cores
    python benchmarks/spawned_link.py --reps 9

`mpirun -np 2` of this file: rank 0 serves as the async parameter server does (a 636 KB gradient in,
an update, 636 KB of parameters back: the MLP 784-200-10 of benchmarks/goodput.py), waiting as
mpitrain's Poller does (transport.TESTS_PER_WAKE tests, then a PS_POLL_S sleep); the worker sends,
waits for its reply the same way (WORKER_POLL_S) and computes 0.5 ms. For DURATION_S with rank 1 (a
rank of the job: MPICH's shared memory), then with a process rank 0 spawned (MPI_Comm_spawn: MPICH
reaches it over UCX, its network module). Printed: exchanges/s with each, and their ratio, per
setting (interleaved repetitions, medians):

  mpitrain      UCX_RNDV_THRESH=inf, mpitrain's setting for a job that can take joiners
                (mpiimpl.JOIN_TRANSPORT_ENV): every message copied through UCX's shared-memory FIFOs,
                so that a peer killed mid-message is never received instead of aborting rank 0
  ucx-default   UCX's zero-copy rendezvous (process_vm_readv): what that setting gives up
  more-tests    mpitrain's setting with 64 tests a wake-up instead of 8

Two ranks on 2 cores: nothing else competes for them, unlike a job of 5 ranks (benchmarks/goodput.py).
Not part of CI.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PARAMS = 159_010  # MLP 784-200-10
DURATION_S = 3.0
WORK_S = 5e-4  # the worker's step
SETTINGS = {"mpitrain": {"UCX_RNDV_THRESH": "inf"}, "ucx-default": {},
            "more-tests": {"UCX_RNDV_THRESH": "inf", "LINK_TESTS": "64"}}


def _wait(req, tests: int, sleep_s: float) -> None:
    while True:
        for _ in range(tests):
            if req.Test():
                return
        time.sleep(sleep_s)


def _worker(comm, tests: int, sleep_s: float) -> None:
    grad, params = np.ones(PARAMS, np.float32), np.empty(PARAMS, np.float32)
    comm.Barrier()
    while True:
        reply, push = comm.Irecv(params, source=0, tag=2), comm.Isend(grad, dest=0, tag=1)
        _wait(reply, tests, sleep_s)
        push.Wait()
        if params[0] < 0:
            return
        t = time.perf_counter()
        while time.perf_counter() - t < WORK_S:
            pass


def _server(comm, tests: int, sleep_s: float) -> float:
    grad, params = np.empty(PARAMS, np.float32), np.ones(PARAMS, np.float32)
    comm.Barrier()
    t0, n = time.perf_counter(), 0
    while True:
        _wait(comm.Irecv(grad, source=1, tag=1), tests, sleep_s)
        params += 1e-6 * grad
        n += 1
        done = time.perf_counter() - t0 > DURATION_S
        if done:
            params[0] = -1.0
        comm.Send(params, dest=1, tag=2)
        if done:
            return n / (time.perf_counter() - t0)


def ranks() -> None:
    """Under mpirun -np 2: print 'own R' and 'spawned R' (exchanges/s) from rank 0."""
    from mpi4py import MPI

    from support import PS_POLL_S, TESTS_PER_WAKE, WORKER_POLL_S

    tests = int(os.environ.get("LINK_TESTS", TESTS_PER_WAKE))
    parent = MPI.Comm.Get_parent()
    if parent != MPI.COMM_NULL:
        world = parent.Merge(high=True)
        _worker(world, tests, WORKER_POLL_S)
        world.Free()
        parent.Disconnect()
        return
    comm = MPI.COMM_WORLD
    if comm.Get_rank() == 0:
        print("own", _server(comm, tests, PS_POLL_S), flush=True)
    else:
        _worker(comm, tests, WORKER_POLL_S)
    comm.Barrier()
    if comm.Get_rank() == 0:
        child = MPI.COMM_SELF.Spawn(sys.executable, [__file__, "--ranks"], 1)
        world = child.Merge(high=False)
        print("spawned", _server(world, tests, PS_POLL_S), flush=True)
        world.Free()
        child.Disconnect()
    comm.Barrier()


def one(setting: str) -> tuple[float, float]:
    from run import env, mpirun  # same folder

    out = subprocess.run([mpirun(), "-np", "2", sys.executable, __file__, "--ranks"], capture_output=True, text=True,
                         env={**env(), **SETTINGS[setting]}, timeout=120).stdout
    got = dict(line.split() for line in out.splitlines() if line.startswith(("own ", "spawned ")))
    return float(got["own"]), float(got["spawned"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--ranks", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.ranks:
        ranks()
        return 0
    from run import machine  # same folder

    runs = {s: [] for s in SETTINGS}
    for _ in range(a.reps):  # interleaved: this VM's speed drifts
        for s in SETTINGS:
            runs[s].append(one(s))
    print(f"`python benchmarks/spawned_link.py --reps {a.reps}`, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
          f"on {machine()}\n")
    print("| setting | exchanges/s with a rank of the job (median) | with a spawned process (median) | "
          "spawned / own (median of the runs' ratios) |")
    print("|---|---|---|---|")
    for s, got in runs.items():
        print(f"| {s} | {statistics.median(o for o, _ in got):.0f} | {statistics.median(x for _, x in got):.0f} | "
              f"{statistics.median(x / o for o, x in got):.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
