"""How ranks wait for MPI requests without burning a core.

MPICH's Wait* busy-polls. With 3 ranks on 2 cores a spinning rank takes the core a worker
needs, so idle ranks poll with Test* and sleep between polls (measured in benchmarks/).
"""

from __future__ import annotations

import time

from mpi4py import MPI

from mpitrain.liveness import PeerLost, mpi_error_reason

# Sleep between polls. A wake-up from sleep costs ~80-100 us on these VMs, so shorter sleeps
# only cost CPU. Each of the PS's polls costs ~12 us of CPU (a wake-up plus MPICH progress).
# With --overlap the reply is off the workers' critical path: 200 us measured best on 2 cores
# (benchmarks/); without it the reply is on the critical path, so the PS polls sooner.
PS_POLL_S = 200e-6
PS_POLL_NO_OVERLAP_S = 50e-6
WORKER_POLL_S = 20e-6
CHIEF_POLL_S = 2e-3  # rank 0 in sync mode is off the critical path
QUORUM_POLL_S = 50e-6  # ... unless it decides --quorum steps: then every step waits for it


class Poller:
    """Test-and-sleep waits, with the time spent waiting accounted. With a `watch`
    (liveness.Watch), a wait looks at it between polls: it raises PeerLost instead of waiting
    forever on a dead peer."""

    def __init__(self, sleep_s: float, watch=None):
        self.sleep_s = sleep_s
        self.waited_s = 0.0
        self.watch = watch

    def all(self, reqs: list) -> None:
        t0 = time.perf_counter()
        try:
            while not MPI.Request.Testall(reqs):
                time.sleep(self.sleep_s)
                if self.watch is not None:
                    self.watch.check()
        except MPI.Exception as e:
            self._peer_failed(e)
        finally:
            self.waited_s += time.perf_counter() - t0

    def _peer_failed(self, error: Exception) -> None:
        """An MPI error while waiting on the one peer this rank watches (a worker's rank 0): that
        peer died mid-message. With several peers the caller finds out which (liveness.failing_ranks)."""
        watched = self.watch.watched if self.watch is not None else []
        if len(watched) != 1:
            raise error
        why = mpi_error_reason(error)
        self.watch.declare(watched[0], why)
        raise PeerLost({watched[0]: why}) from error

    def some(self, reqs: list) -> list[int]:
        """Indices of completed requests (at least one), or [] when none is active any more."""
        t0 = time.perf_counter()
        try:
            idx = MPI.Request.Testsome(reqs)
            while idx is not None and not idx:
                time.sleep(self.sleep_s)
                if self.watch is not None:
                    self.watch.check()
                idx = MPI.Request.Testsome(reqs)
        except MPI.Exception as e:
            self._peer_failed(e)
        finally:
            self.waited_s += time.perf_counter() - t0
        return idx or []
