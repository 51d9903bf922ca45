"""How ranks wait for MPI requests: Poller, over waiting.poll (the one way any rank waits).

It never burns a core: MPICH's Wait* busy-polls, and with 3 ranks on 2 cores a spinning rank
takes the core a worker needs, so idle ranks poll with Test* and sleep between polls (measured
in benchmarks/). It never waits on a dead peer: between polls it looks at the liveness Watch
(--worker-timeout), and a request that MPI completes with an error is reported with the peer it
belongs to instead of raised.

How MPICH 5.0.2 reports a peer that dies in the middle of a message (measured, see
docs/notes/dead-peer.md): a receive whose sender was SIGKILLed while the receiver copied the
payload out of the sender's memory completes *with an error* ("process_vm_readv failed (errno 3)")
and `Testsome` raises MPI_ERR_IN_STATUS. Every request that completed in that call, the failed
one and any good ones beside it, is already freed (mpi4py sets it to REQUEST_NULL), so the
indices are only known by which requests went null, and only the statuses say which of them
failed. Any other half-delivered message (an eager one, or a send to a dead receiver) simply
never completes: that is the heartbeat watch's case.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
from mpi4py import MPI

from mpitrain.exchange.waiting import poll
from mpitrain.membership.liveness import CLOSE_POLL_S, PeerLost, mpi_error_reason
from mpitrain.membership.stuck import WATCHDOG

# Sleep between polls. A wake-up from sleep costs ~80-100 us on these VMs, so shorter sleeps
# only cost CPU; Linux's default 50 us timer slack stretches every sleep anyway (20 us took 75,
# 200 took 267; a 1 ns slack measured 0.82x to 1.08x, benchmarks/README.md). Each of the PS's
# polls costs ~12 us of CPU (a wake-up plus MPICH progress). With --overlap the reply is off the
# workers' critical path: 200 us measured best on 2 cores (benchmarks/); without it the reply is
# on the critical path, so the PS polls sooner.
PS_POLL_S = 200e-6
PS_POLL_NO_OVERLAP_S = 50e-6
WORKER_POLL_S = 20e-6
SPIN = 0.0  # no sleep at all: a sync Allreduce on a node with a core per computing rank (collective_poll_s)
CHIEF_POLL_S = 2e-3  # rank 0 in sync mode is off the critical path (--quorum too: the coordinator gathers)
END_POLL_S = CLOSE_POLL_S  # end of run (reports, goodbyes): off the hot path, as liveness's close
# Tests in a row before each sleep. MPICH polls its network module (UCX: a joined or respawned
# process, another host) only in a progress pass where its shared memory moved nothing, and each
# test is one pass: with one test per wake-up, a message from a respawned worker waited behind the
# shared-memory traffic for sleep after sleep, and a sync job ran at 0.54x of its speed once a worker
# had been respawned (np 5 on 2 cores). With 8, 0.88x (benchmarks/AFTER_RESPAWN.md), and a job with no
# respawn gains too, each pass moving one more piece of a large message (async np=3 1.30x: AB.md (2026-11-27)).
TESTS_PER_WAKE = 8


def collective_poll_s(wait: str, oversubscribed: bool) -> float:
    """--wait, for a sync worker's Allreduce: MPICH's blocking collectives spin. With more
    computing ranks on a node than cores, a spinning rank holds the core its peer needs to reach
    the collective (measured: a 3-worker Allreduce on 2 cores 16x slower than Iallreduce +
    test-and-sleep), so `auto` yields then; otherwise spinning wins."""
    if wait == "auto":
        return WORKER_POLL_S if oversubscribed else SPIN
    return WORKER_POLL_S if wait == "yield" else SPIN


@dataclass
class Completed:
    """What one `Poller.some` found: indices of requests that completed normally, and of those
    MPI completed with an error (index -> why; the peer died mid-message, its data is garbage)."""

    arrived: list[int] = field(default_factory=list)
    failed: dict[int, str] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.arrived or self.failed)


class Poller:
    """Test-and-sleep waits, with the time spent waiting accounted. With a `watch`
    (liveness.Watch), a wait looks at it between polls: it raises PeerLost instead of waiting
    forever on a silent peer."""

    def __init__(self, sleep_s: float, watch=None, testsome=MPI.Request.Testsome):
        self.sleep_s = sleep_s
        self.testsome = testsome  # replaceable in unit tests: MPI's error paths are hard to provoke
        self.waited_s = 0.0
        self.watch = watch
        self.unattributed: list[str] = []  # MPI errors no request owned up to (see _sort_out)
        self._statuses: list = []

    def some(self, reqs: list, also=None) -> Completed:
        """Wait until at least one request completes (normally or with an error); an empty
        Completed when none is active any more. `also`: what else may arrive, looked at before
        each test (async's mailboxes: the indices, in reqs' numbering, of pushes announced); with
        it, the wait goes on when no request is active."""
        t0 = time.perf_counter()
        active = [i for i, r in enumerate(reqs) if r]  # the error path needs to know which went null
        found: list[Completed] = []

        def completed() -> bool:
            other = also() if also is not None else None
            if other:
                found.append(Completed(other))
                return True
            done = self._test(reqs, active)
            if done is not None and (done or also is None):
                found.append(done)
                return True
            return False

        try:
            # The watch is looked at on every call, not only when idle: a server kept busy by the
            # live workers must still notice the silent one (the watch rate-limits itself).
            poll(completed, self.sleep_s, self.watch)
            return found[0]
        finally:
            self.waited_s += time.perf_counter() - t0

    def test(self, reqs: list) -> Completed | None:
        """One look, no wait: what completed (an empty Completed when none is active), or None."""
        return self._test(reqs, [i for i, r in enumerate(reqs) if r])

    def all(self, reqs: list, peers: list[int]) -> None:
        """Wait for every request; `peers[i]` is the rank request i talks to. A request that
        fails raises PeerLost naming its peer (declared in the watch), as a silent peer does."""
        while True:
            done = self.some(reqs)
            if done.failed:
                self.lost(done, peers)
            if not done:
                return

    def lost(self, done: Completed, peers: list[int]) -> None:
        """Raise PeerLost naming the peers of `done`'s failed requests (declared in the watch)."""
        lost = {peers[i]: why for i, why in done.failed.items()}
        if self.watch is not None:
            for rank, why in lost.items():
                self.watch.declare(rank, why)
        raise PeerLost(lost)

    def _test(self, reqs: list, active: list[int]) -> Completed | None:
        if len(self._statuses) < len(reqs):
            self._statuses = [MPI.Status() for _ in reqs]
        try:
            with WATCHDOG:  # a test that never returns (MPICH waiting on a dead sender) ends the rank
                for _ in range(TESTS_PER_WAKE):
                    idx = self.testsome(reqs, self._statuses)
                    if idx is None or idx:
                        break
        except MPI.Exception as e:
            return self._sort_out(e, reqs, active)
        if idx is None:
            return Completed()
        return Completed(idx) if idx else None

    def _sort_out(self, error: MPI.Exception, reqs: list, active: list[int]) -> Completed | None:
        """An MPI error in Testsome: which requests completed, and which of them failed."""
        completed = [i for i in active if not reqs[i]]
        done = Completed()
        if error.Get_error_class() == MPI.ERR_IN_STATUS:
            # MPICH fills one status per completed request, in index order.
            for i, status in zip(completed, self._statuses):
                code = status.Get_error()
                if code == MPI.SUCCESS:
                    done.arrived.append(i)
                else:
                    done.failed[i] = mpi_error_reason(error_text(code))
            return done
        # Not seen with MPICH: an error with no per-request statuses. A request that completed
        # in that call cannot be trusted; one still open that fails on its own names its peer.
        for i in completed:
            done.failed[i] = mpi_error_reason(str(error))
        for i in active:
            if reqs[i]:
                try:
                    if reqs[i].Test():
                        done.arrived.append(i)
                except MPI.Exception as e:
                    done.failed[i] = mpi_error_reason(str(e))
        if not done:
            # Nobody owns the error: keep waiting. A dead peer goes silent, and the heartbeat
            # watch names it after --worker-timeout; rank 0 must not end over it.
            self.unattributed.append(mpi_error_reason(str(error)))
            return None
        return done


NO_REQUEST = MPI.REQUEST_NULL  # a request slot with nothing in flight (tested, waited on: at once)

# A table: rows of `width` int64 or float32 values, a message of its own without a header (its length
# says how many rows), sent on a tag of its own just before the message it goes with (the sync
# coordinator's --quorum left-out counts and the workers' own arrays, before a state to save).
_TABLE_TYPES = {np.dtype(np.int64): MPI.INT64_T, np.dtype(np.float32): MPI.FLOAT}


def send_table(comm, rows: np.ndarray, dest: int, tag: int):
    """Start sending `rows` (C-contiguous, kept alive by the caller until the request completes)."""
    return comm.Isend([rows, _TABLE_TYPES[rows.dtype]], dest=dest, tag=tag)


def receive_table(comm, source: int, tag: int, dtype, width: int, watch) -> np.ndarray:
    """The table `source` sent on `tag`, however many rows it has; waits for it watching `watch`."""
    status, mpi_type = MPI.Status(), _TABLE_TYPES[np.dtype(dtype)]
    poll(lambda: comm.Iprobe(source=source, tag=tag, status=status), CHIEF_POLL_S, watch)
    rows = np.empty((status.Get_count(mpi_type) // width, width), dtype)
    comm.Recv([rows, mpi_type], source=source, tag=tag)
    return rows


def error_text(code: int) -> str:
    """MPI's text for a request's error code. Open MPI's non-blocking collectives (libnbc) complete a
    request with a code of their own that MPI_Error_string rejects (MPI_ERR_ARG: measured, 5.0.11,
    an Iallreduce whose peer was SIGKILLed): that must not turn a lost peer into a traceback."""
    try:
        return MPI.Get_error_string(code)
    except MPI.Exception:
        return f"error code {code} (MPI has no text for it)"


def tested(req, peer: int, watch=None) -> bool:
    """`req.Test()` for a loop that polls one request itself; an MPI error raises PeerLost."""
    try:
        return req.Test()
    except MPI.Exception as e:
        why = mpi_error_reason(str(e))
        if watch is not None:
            watch.declare(peer, why)
        raise PeerLost({peer: why}) from e
