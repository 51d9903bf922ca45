"""A rank whose MPI calls no longer return ends itself, in one line, within --worker-timeout.

Why (docs/notes/dead-peer.md, "A sender killed half-way through an enqueue"): MPICH's shared-memory
transport (ch4 posix, iqueue) hands each message to its receiver through a lock-free queue
(MPIDU_genqi_nem_mpsc_enqueue): the sender swaps the queue's tail to its cell, then links the
previous cell to it. A sender SIGKILLed between the two leaves the receiver's progress engine
spinning forever on the missing link (MPIDU_genqi_nem_mpsc_dequeue: "busy wait for the enqueuing to
finish"), inside whatever MPI call it was in and holding MPICH's lock, so its heartbeat thread cannot
send either. No MPI call can get that process out again. It hung the CI's async-big chaos trial
(rank 0 stuck in Testsome); benchmarks/stuck_probe.py provokes it (2 kills in 200, STUCK.md).

So every rank with heartbeats runs this watchdog: a thread that makes no MPI call (mpi4py releases
the GIL in MPI calls, so it runs while another thread is stuck in one). The tests of every wait
(transport.Poller, liveness.Watch) and each heartbeat round say when they enter and leave MPI (a
round cannot finish while another thread spins in MPICH's progress holding its lock, so whatever
call is stuck, a round is too); one that has not come back for --worker-timeout (by then every
peer has declared this rank lost) is stuck. The rank then runs its last words (rank 0 with the whole state: a checkpoint of it), says so in one line,
and ends with ExitCode.PEER_LOST. Time is counted in the watchdog's own ticks, not the wall clock,
so a job suspended and resumed (Ctrl-Z, `scontrol suspend`) is not taken for a stuck one.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable

TICK_S = 0.25  # how often the watchdog looks: the bound is met to within a tick
STUCK_LINE = "MPI has not returned for"  # the line's words that benchmarks/chaos.py looks for


class Watchdog:
    """Who is inside MPI right now (`enter(who)` / `leave(who)`, a dict store each: cheap enough for
    every test of a poll), and the thread that ends the rank when one of them stays past the
    bound. Unarmed (no heartbeats: --worker-timeout 0, one process) it only records."""

    def __init__(self):
        self.inside: dict[int, int] = {}  # thread ident -> the watchdog tick at which it entered MPI
        self.pauses = 0  # paused(): ticks meanwhile do not count
        self.tick = 0
        self.bound_ticks = 0
        self.rank = -1
        self.bound_s = 0.0
        self.last_words: Callable[[], str | None] | None = None  # rank 0: saves, returns what it saved
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    @contextlib.contextmanager
    def paused(self):
        """A blocking MPI call with its own bound (join's MPI_Comm_connect, up to 5 s) may keep the
        heartbeat thread out of MPI meanwhile: not counted as stuck."""
        self.pauses += 1
        try:
            yield
        finally:
            self.pauses -= 1

    def __enter__(self) -> "Watchdog":
        """`with WATCHDOG:` around an MPI call that must come back: this thread is inside MPI."""
        self.enter(threading.get_ident())
        return self

    def __exit__(self, *_exc) -> None:
        self.leave(threading.get_ident())

    def enter(self, who: int) -> None:
        """Thread `who` (threading.get_ident()) calls into MPI."""
        self.inside[who] = self.tick

    def leave(self, who: int) -> None:
        self.inside.pop(who, None)

    def arm(self, rank: int, bound_s: float) -> None:
        """Start watching: a call inside MPI for `bound_s` seconds (--worker-timeout) ends the rank."""
        if bound_s <= 0 or self._thread is not None:
            return
        self.rank, self.bound_s = rank, bound_s
        self.bound_ticks = max(2, round(bound_s / TICK_S))
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="mpitrain-stuck-watchdog", daemon=True)
        self._thread.start()

    def disarm(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._thread = None
        self.inside.clear()

    def stuck(self) -> int | None:
        """Who has been inside MPI for the bound, if anyone (one look, one tick)."""
        if self.pauses:  # the clock stands still: the paused call's time is nobody's
            return None
        self.tick += 1
        for who, since in list(self.inside.items()):
            if self.tick - since >= self.bound_ticks:
                return who
        return None

    def _run(self) -> None:
        while not self._stop.wait(TICK_S):
            who = self.stuck()
            if who is not None:
                _end(self.line(who))
                return

    def line(self, who: int) -> str:
        saved = None
        # The main thread is in a test of its loop: the state it holds is whole (never mid-update).
        if threading.main_thread().ident in self.inside and self.last_words is not None:
            try:
                saved = self.last_words()
            except Exception as e:  # the line must still go out
                saved = f"no checkpoint ({type(e).__name__}: {e})"
        then = f"; {saved}" if saved else ""
        return (f"mpitrain: rank {self.rank}: {STUCK_LINE} {self.bound_s:g} s (--worker-timeout; MPICH waits "
                f"forever for a process that died half-way through handing this one a message){then}; ending this "
                f"rank (the job resumes from the newest checkpoint)")


def _end(line: str) -> None:
    import sys

    from mpitrain.core.console import say
    from mpitrain.core.exitcodes import ExitCode
    from mpitrain.launch import lock

    say(line, sys.stderr)
    lock.exit_without_finalize(ExitCode.PEER_LOST)


WATCHDOG = Watchdog()
