"""Ending a run on request: Ctrl-C (SIGINT), `kill`/`scancel` (SIGTERM), Slurm's warning before the
time limit (`--signal=USR1@90`: SIGUSR1).

A signal handler only records the request (it never raises, so a second signal while a checkpoint
is being written cannot interrupt the write). The request then spreads with every message of the
job: every header carries the stop signal its sender knows of (protocol.H_SIGNAL), heartbeats
included, so a signal that reached one rank alone reaches the others within a heartbeat. Each
mode stops at a step boundary on its own terms (async: the servers stop every worker as they
would at --steps; sync: a vote slot in the gradient Allreduce, so every worker stops after the
same step; --quorum: the coordinator flags its update; one process: after the step), rank 0 writes the
final checkpoint as at the end of a run, and every rank exits 128 + the signal's number.
"""

from __future__ import annotations

import os
import signal
import threading
import time

from mpitrain.core.exitcodes import interrupted
from mpitrain.core.stop import STOP, signal_name

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


# A signal this long after the first request ends the process at once: a run stuck on its way out
# (a hung file system, a peer that never answers) must still yield to the user. Not sooner: mpirun
# delivers each signal twice (measured), and a user presses Ctrl-C again while the save runs.
FORCE_AFTER_S = 10.0


def force_exit(signum: int) -> None:
    from mpitrain.launch import lock

    lock.release_all()
    os.write(2, f"mpitrain: {signal_name(signum)} again {FORCE_AFTER_S:g} s after the stop request: ending now, "
                f"without a final checkpoint (the newest complete one loads)\n".encode())
    os._exit(interrupted(signum))


def handled(env=os.environ) -> tuple[signal.Signals, ...]:
    """The signals that stop a run here: SIGUSR1 too, but under MPICH's hydra, which sends every rank
    SIGUSR1 when a peer dies (measured with -disable-auto-cleanup): there it is ignored
    (mpiimpl.ignore_death_notices), and a dead peer must not stop the run. Slurm's `--signal=USR1` reaches srun's tasks,
    which hydra does not start."""
    from mpitrain.launch.mpiimpl import hydra_env

    return tuple(s for s in SIGNALS if not (s == signal.SIGUSR1 and hydra_env(env)))


def install() -> callable:
    """Record the stop signals instead of dying of them; returns what puts back the handlers that
    Python knew of (the Python API's caller gets its Ctrl-C back; the command line never calls it,
    since Python does not see handlers MPI installed in C, and putting back its stale view of them
    would replace MPICH's). Only the main thread may set handlers: elsewhere (the Python API
    called from a thread) nothing changes and the signals keep their defaults."""
    STOP.reset()
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    sigs = handled()
    previous = {sig: signal.getsignal(sig) for sig in sigs}

    def handler(signum, _frame) -> None:
        if STOP.since is not None and time.monotonic() - STOP.since > FORCE_AFTER_S:
            force_exit(signum)
        STOP.request(signum)

    for sig in sigs:
        signal.signal(sig, handler)

    def restore() -> None:
        for sig, old in previous.items():
            signal.signal(sig, old if old is not None else signal.SIG_DFL)

    return restore
