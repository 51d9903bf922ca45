"""The one way an mpitrain rank waits for something: `poll`.

Every wait in mpitrain -- for a message (transport.Poller), a quorum decision, a worker's report,
a peer's last heartbeat, rank 0's verdict -- is "test, look at the liveness watch, sleep, test
again", with or without a deadline. Never MPICH's blocking Wait*: it busy-polls, and with more
ranks than cores a spinning rank takes the core a worker needs (measured in benchmarks/); and a
blocked call cannot notice that its peer died (--worker-timeout). No MPI import here: liveness.py
uses it too, and it is imported before MPI is initialised.
"""

from __future__ import annotations

import time
from typing import Callable


def poll(ready: Callable[[], object], sleep_s: float, watch=None, deadline: float | None = None,
         clock=time.monotonic) -> bool:
    """Call `ready()` until it returns something true; before each call look at `watch`
    (liveness.Watch: its check() raises PeerLost for a peer silent past --worker-timeout), and
    sleep `sleep_s` between calls (0: spin). True once ready; False if `clock()` passes
    `deadline` first."""
    while True:
        if watch is not None:
            watch.check()
        if ready():
            return True
        if deadline is not None and clock() > deadline:
            return False
        if sleep_s:
            time.sleep(sleep_s)
