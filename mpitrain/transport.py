"""How ranks wait for MPI requests without burning a core.

MPICH's Wait* busy-polls. With 3 ranks on 2 cores a spinning rank takes the core a worker
needs, so idle ranks poll with Test* and sleep between polls (measured in benchmarks/).
"""

from __future__ import annotations

import time

from mpi4py import MPI

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
    """Test-and-sleep waits, with the time spent waiting accounted."""

    def __init__(self, sleep_s: float):
        self.sleep_s = sleep_s
        self.waited_s = 0.0

    def all(self, reqs: list) -> None:
        if MPI.Request.Testall(reqs):
            return
        t0 = time.perf_counter()
        while not MPI.Request.Testall(reqs):
            time.sleep(self.sleep_s)
        self.waited_s += time.perf_counter() - t0

    def some(self, reqs: list) -> list[int]:
        """Indices of completed requests (at least one), or [] when none is active any more."""
        idx = MPI.Request.Testsome(reqs)
        if idx:
            return idx
        t0 = time.perf_counter()
        while idx is not None and not idx:
            time.sleep(self.sleep_s)
            idx = MPI.Request.Testsome(reqs)
        self.waited_s += time.perf_counter() - t0
        return idx or []
