"""Who is still there (--worker-timeout): heartbeats, and the watch that reads them.

Every rank but the local one runs a Heartbeat thread: a header-only message to its peers every
beat_interval(timeout), independent of training progress, so a slow rank (a straggler, a long
step, a checkpoint save) is never taken for a dead one. Workers beat to every parameter server;
a server beats to every worker, and the chief server (rank 0) to the other servers and they to it
(layout.Layout.peers). A Watch remembers when each peer was last heard from (heartbeat or any
training message); a peer silent for longer than the timeout is lost, and so is one whose
message failed in MPI (a dead process's half-sent gradient), or one on this host whose process has
ended (samehost.py: seen in /proc, declared ENDED_GRACE_S later, not the timeout later). Pollers call `Watch.check` while
they wait; it raises PeerLost, and the caller decides: a server in async mode carries on without
a lost worker, everything else stops with one line (see trainer.py).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque

import numpy as np
from mpi4py import MPI

from mpitrain.core.layout import Layout
from mpitrain.exchange.protocol import (BEAT_FIELDS, BEAT_HOST, BEAT_PID, FLAG_HOLD, FLAG_LEAVING, FLAG_PEER_LOST,
                                        TAG_HEARTBEAT, Message)
from mpitrain.exchange.waiting import poll
from mpitrain.launch import samehost
from mpitrain.membership.stuck import WATCHDOG

BEATS_PER_TIMEOUT = 4  # a peer must miss this many heartbeats in a row to be declared lost
MAX_BEAT_S = 2.0
CHECK_EVERY_S = 0.1  # how often a waiting rank looks at its watch
# A peer whose process has ended (samehost.py) is declared lost this long after it is first seen so:
# what it sent before it ended is taken first (a worker killed right after its end-of-run report was
# once declared lost with the report still queued, and left out of the summary).
ENDED_GRACE_S = 0.3
CLOSE_POLL_S = 1e-3  # end of run: off the hot path
HELD_ROUNDS = 64  # heartbeat rounds remembered for Heartbeat.held_s (16 timeouts' worth)
# How long a peer's silence after a beat flagged FLAG_HOLD (Heartbeat.hold) does not count: MPI_Comm_spawn
# returns once the new process has started MPI (0.25 s on 2 cores when idle, seconds when loaded); one
# that takes longer is stuck, and its rank is then lost as a silent one is (the forming limit is as long).
HOLD_S = 30.0
HOLD_SENT_WITHIN_S = 1.0  # Heartbeat.hold waits this long at most for a held beat to each peer
HOLD_RETRY_S = 1e-3  # ... looking again this often for a peer whose last beat had not gone out


# Why a peer that ends the job on a lost rank (its last beat flagged FLAG_PEER_LOST) is lost to the others.
ENDS_THE_JOB = "it ends the job on a lost rank"


def beat_interval(timeout_s: float) -> float:
    return min(timeout_s / BEATS_PER_TIMEOUT, MAX_BEAT_S)


def silent_after(timeout_s: float) -> float:
    """Seconds without a beat after which a peer is reported silent (two beats missed; a stall
    report says so long before --worker-timeout declares it lost). 0 with no heartbeats."""
    return 2 * beat_interval(timeout_s) if timeout_s > 0 else 0.0


def beat_message() -> Message:
    """A heartbeat's buffer, its payload zeros until a beat lands in it: a box read before (a test's beat of a
    header only) held whatever the allocation left, a NaN pid once (samehost._look raised, clean-clone CI)."""
    box = Message(BEAT_FIELDS, dtype=np.float64)
    box.payload[:] = 0
    return box


def mpi_error_reason(message: str) -> str:
    """Why a peer is lost, from MPI's error string for its message (the error stack's last line,
    e.g. "copy_iovs(224): process_vm_readv failed (errno 3)"). Every MPI error of a message comes
    here; a revoked communicator is not a lost peer but a job that another rank aborts
    (mpiimpl.abort, under ULFM): this rank ends at once."""
    end_if_aborted(message)
    lines = message.strip().splitlines() or ["unknown"]
    return f"MPI error: {lines[-1].strip()}"


REVOKED = "MPI_ERR_REVOKED"
# This process's rank in the phase's world (set by `start`), which end_aborted names: COMM_WORLD's is
# 0 in every worker that --respawn started or --join let in (each is a world of its own).
PHASE_RANK: list[int | None] = [None]


def end_if_aborted(message: str) -> None:
    """An MPI error on a revoked communicator: another rank aborted the job (mpiimpl.abort, under
    ULFM), and this one ends at once (end_aborted); any other error is the caller's."""
    if REVOKED in message:
        end_aborted()


def end_aborted() -> None:
    """Another rank aborted the job and said why: leave without a word of blame for a peer."""
    import os
    import sys

    from mpitrain.core.exitcodes import ExitCode
    from mpitrain.launch import lock

    rank = MPI.COMM_WORLD.Get_rank() if PHASE_RANK[0] is None else PHASE_RANK[0]
    os.write(2, f"mpitrain: rank {rank}: another rank aborted the job; ending\n".encode())
    lock.release_all()
    sys.stdout.flush()
    os._exit(ExitCode.FAILED)


class PeerLost(Exception):
    """Raised by Watch.check: `lost` maps each newly lost rank to why. A worker's loop attaches where
    it was (elastic.interrupted_at: `state`, `counts`), which a take-over starts from (failover.py)."""

    def __init__(self, lost: dict[int, str]):
        super().__init__(", ".join(f"rank {r} ({why})" for r, why in lost.items()))
        self.lost = lost
        self.state = None
        self.counts = (0, 0)


class Heartbeat:
    """A daemon thread sending a TAG_HEARTBEAT message to each of `peers`, with this rank's
    activity (observe.Activity.snapshot: phase, progress, step time) as its payload. A beat is
    skipped while the previous one to that peer is still queued, so nothing piles up behind a
    busy or dead peer. `close` sends each live peer a last beat flagged FLAG_LEAVING, which lets
    its Watch retire the receive it keeps posted (see Watch.close)."""

    def __init__(self, comm, peers: list[int], timeout_s: float, activity=None):
        self.comm, self.peers, self.timeout_s = comm, list(peers), timeout_s
        self.activity = activity
        self.interval = beat_interval(timeout_s)
        self.msgs = [beat_message() for _ in self.peers]
        self.reqs = [MPI.REQUEST_NULL] * len(self.peers)
        self.gone: set[int] = set()  # peers whose beat failed in MPI: dead, never beaten again
        self.beats = 0
        self.rounds: deque[float] = deque(maxlen=HELD_ROUNDS)  # when the last rounds started (held_s)
        self._wake = threading.Event()  # the next round now: a stop (close) or a word to spread (poke)
        self._holding = threading.Event()  # set: every beat is flagged FLAG_HOLD, from hold() to release()
        self._held = threading.Event()  # set by the thread once every live peer was sent a held beat
        self._hold_sent: set[int] = set()  # the peers sent one since hold()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="mpitrain-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self, i: int, flags: int = 0) -> None:
        if self.activity is not None:
            try:
                self.msgs[i].payload[:] = self.activity.snapshot()
            except Exception:  # what a beat says is a diagnostic: the beat itself must go out
                pass
        self.msgs[i].payload[BEAT_PID:BEAT_HOST + 1] = samehost.mine()
        self.msgs[i].stamp(TAG_HEARTBEAT, self.beats, flags=flags)
        self.reqs[i] = self.comm.Isend(self.msgs[i].spec(), dest=self.peers[i], tag=TAG_HEARTBEAT)

    def _run(self) -> None:
        while True:
            self._wake.clear()  # before the round: a poke during it gets the next one at once
            if self._stopping:  # close() came before the clear: its wake-up is gone, its flag is not
                return
            self.beats += 1
            self.rounds.append(time.monotonic())
            holding = self._holding.is_set()
            # until every peer was told of a hold, the rounds between intervals go to those not told yet
            missing = ({i for i in range(len(self.peers)) if i not in self._hold_sent}
                       if holding and not self._held.is_set() else None)
            with WATCHDOG:  # a round that never ends (MPI stuck, see stuck.py) ends the rank
                sent = self._round(FLAG_HOLD if holding else 0, missing)
            wait = self.interval
            if missing is not None:
                self._hold_sent |= sent
                if all(i in self._hold_sent or i in self.gone for i in range(len(self.peers))):
                    self._held.set()
                else:  # a peer whose last beat was still going out (skipped by the round): again shortly
                    wait = HOLD_RETRY_S
            self._wake.wait(wait)
            if self._stopping:
                return

    def poke(self) -> None:
        """A beat round now, not at the next interval: rank 0's stop to make room for a worker
        (lobby.Lobby) reaches the sync workers, who hear rank 0 only in its beats, up to an interval
        sooner (2 s with the default --worker-timeout: half of that a respawn, on average)."""
        self._wake.set()

    def hold(self) -> None:
        """Before this process blocks in an MPI call that holds its heartbeat thread too: MPI_Comm_spawn
        does, under MPICH's lock, until the new process has started MPI (rank 0 starting a worker in
        place of a lost one while the others train: respawn.launch). A beat round flagged FLAG_HOLD
        goes out first, and each peer's Watch then lets this rank's silence pass for up to HOLD_S
        (or until its next beat): a spawn slowed past a short --worker-timeout by a loaded machine
        used to make the workers declare a live rank 0 lost, and with --on-lost-server continue take
        over from it (two rank 0s). Returns once every live peer was sent a held beat (HOLD_SENT_WITHIN_S at
        most); every beat is flagged so until `release`: a peer takes any beat without the flag as the end of
        the hold, and one that slipped out during the spawn (MPICH yields its lock now and then) used to end
        it early, and a worker then declared the spawning rank 0 lost (seen in 1 of 13 logged goodput runs, sync)."""
        self._hold_sent = set()
        self._held.clear()
        self._holding.set()
        self._wake.set()
        self._held.wait(HOLD_SENT_WITHIN_S)

    def release(self) -> None:
        """The blocking call is over (hold): the next beats go out unflagged, and the peers count silence again."""
        self._holding.clear()

    def _round(self, flags: int = 0, only: set[int] | None = None) -> set[int]:
        """One beat to each live peer (of `only`, if given) whose last beat has gone out; the peers beaten."""
        sent = set()
        for i in range(len(self.peers)):
            if i in self.gone or (only is not None and i not in only):
                continue
            try:
                if self.reqs[i].Test():
                    self._beat(i, flags)
                    sent.add(i)
            except MPI.Exception:  # that peer died: its Watch entry here says so in time
                self.gone.add(i)
                self.reqs[i] = MPI.REQUEST_NULL
        return sent

    def held_s(self, since: float, now: float) -> float:
        """The longest this thread went without starting a round, beyond its interval, between
        `since` and `now`: MPI (or the GIL) holding this very process. A peer's silence that long
        is this rank's doing as much as the peer's: the watch says so when it declares one lost."""
        rounds = tuple(self.rounds)  # one C-level copy: the heartbeat thread appends meanwhile
        starts = [t for t in rounds if t >= since] + [now]
        gaps = [b - a for a, b in zip([since, *starts[:-1]], starts)]
        return max(0.0, max(gaps) - self.interval)

    def forget(self, rank: int) -> None:
        """A peer declared lost: never beaten (nor its last beat tested) again. MPICH's progress on
        a send to a dead process can hold this process, GIL and all, for seconds at a time
        (measured: rank 0 frozen 4 s, 30 to 60 s after a worker was killed), and every survivor
        then took rank 0 for lost. Each send to a dead process also keeps one of the sender's
        shared-memory cells for good (mpiimpl.LOSS_TRANSPORT_ENV)."""
        if rank in self.peers:
            self.gone.add(self.peers.index(rank))

    def close(self, lost: set[int], flags: int = 0) -> bool:
        """Stop; send the last beat to every peer not in `lost` (with `flags` too: FLAG_PEER_LOST,
        this rank ends the job on a lost rank). False if that did not go out within the timeout
        (a peer died meanwhile: then MPI_Finalize is unsafe)."""
        self._stopping = True
        self._wake.set()
        self._thread.join()
        WATCHDOG.disarm()  # the end of the run has its own limits (ending.finalize)
        expected = [i for i, peer in enumerate(self.peers) if peer not in lost]
        live = [i for i in expected if i not in self.gone]
        if len(live) < len(expected) or not wait_all([self.reqs[i] for i in live], self.timeout_s):
            return False  # a peer died that nobody declared
        for i in live:
            self._beat(i, FLAG_LEAVING | flags)
        return wait_all([self.reqs[i] for i in live], self.timeout_s)


def wait_all(reqs: list, timeout_s: float) -> bool:
    """True when every request completed within the timeout; False on timeout or an MPI error
    (a peer died meanwhile)."""
    try:
        return poll(lambda: MPI.Request.Testall(reqs), CLOSE_POLL_S, deadline=time.monotonic() + timeout_s)
    except MPI.Exception:
        return False


class WaitHooks:
    """What every wait looks at besides liveness, named where the loop that waits starts: `with
    watch.during(hook, ...)` around it, gone when the loop ends. A hook is an object with
    check(): rank 0's word to regroup (elastic.Notices: raises Regroup where a sync worker waits,
    in the middle of a collective that would never finish), a worker asking to join (lobby.Lobby,
    rank 0), the stall report (observe.Stall). Each wait of the loop (waiting.poll, through
    check) runs them in the order given; nothing else attaches anything."""

    def __init__(self):
        self.hooks: list = []

    @contextlib.contextmanager
    def during(self, *hooks):
        added = [h for h in hooks if h is not None]
        self.hooks.extend(added)
        try:
            yield
        finally:
            for h in added:
                self.hooks.remove(h)

    def _run_hooks(self) -> None:
        for hook in list(self.hooks):
            hook.check()


class Watch(WaitHooks):
    """When each of `peers` was last heard from, and what its last heartbeat said it was doing.
    `heard(rank)` for any training message; heartbeats are drained here. `check()` raises
    PeerLost for peers silent past the timeout, then runs the hooks of the loops it waits in
    (WaitHooks). A heartbeat receive is never cancelled (cancelling made MPICH 5.0.2's
    MPI_Finalize hang, measured): it is retired by the peer's last beat, in `close`."""

    def __init__(self, comm, peers: list[int], timeout_s: float, clock=time.monotonic):
        super().__init__()
        self.comm, self.timeout_s, self.clock = comm, timeout_s, clock
        now = clock()
        self.last = {r: now for r in peers}
        self.boxes = {r: beat_message() for r in peers}
        self.beats: dict[int, tuple[list[float], float]] = {}  # rank -> (its last beat's payload, when)
        self.processes: dict[int, tuple] = {}  # rank -> who sent its beats (samehost.identity)
        self.ended_at: dict[int, float] = {}  # rank -> when its process was first seen ended
        self.heartbeat = None  # this rank's Heartbeat: it stops beating to a peer declared lost
        self.recv = {r: self._post(r) for r in peers}  # open until the peer's last beat
        self.checked = set(peers)  # peers whose silence counts
        self.lost: dict[int, dict] = {}  # rank -> {"rank", "silent_s", "reason"}
        self.ending: set[int] = set()  # peers whose last beat said they end the job on a lost rank
        self.held_until: dict[int, float] = {}  # rank -> until when its silence does not count (FLAG_HOLD)
        self._next_check = now

    def _post(self, rank: int):
        return self.comm.Irecv(self.boxes[rank].spec(), source=rank, tag=TAG_HEARTBEAT)

    @property
    def watched(self) -> list[int]:
        return sorted(self.checked)

    def heard(self, rank: int) -> None:
        if rank in self.last:
            self.last[rank] = self.clock()

    def forget(self, rank: int) -> None:
        """Stop counting a peer's silence (it is done and may go quiet)."""
        self.checked.discard(rank)

    def declare(self, rank: int, reason: str) -> None:
        """A peer known dead (silent, or an MPI error on its message)."""
        if rank in self.last and rank not in self.lost:
            self.lost[rank] = {"rank": rank, "silent_s": round(self.clock() - self.last[rank], 3), "reason": reason}
            self.checked.discard(rank)
            if self.heartbeat is not None:
                self.heartbeat.forget(rank)

    def _drain(self, rank: int, now: float) -> None:
        """Take every beat that has arrived; a last beat (FLAG_LEAVING) retires the receive."""
        req = self.recv.get(rank)
        while req is not None and req.Test():
            box = self.boxes[rank]
            box.check(TAG_HEARTBEAT, rank)
            self.last[rank] = now
            self.beats[rank] = (box.payload.tolist(), now)
            self.processes[rank] = tuple(box.payload[BEAT_PID:BEAT_HOST + 1])
            if box.flags & FLAG_HOLD:  # it blocks in MPI now, its beats too (Heartbeat.hold)
                self.held_until[rank] = now + HOLD_S
            else:
                self.held_until.pop(rank, None)
            if box.flags & FLAG_LEAVING:
                del self.recv[rank]
                self.checked.discard(rank)
                if box.flags & FLAG_PEER_LOST:
                    self.ending.add(rank)
                return
            req = self.recv[rank] = self._post(rank)

    def check(self, force: bool = False) -> None:
        now = self.clock()
        if not force and now < self._next_check:
            return
        self._next_check = now + CHECK_EVERY_S
        newly = {}
        for rank in self.watched:
            try:
                with WATCHDOG:  # every wait comes here: a test that never returns ends the rank (stuck.py)
                    self._drain(rank, now)
            except MPI.Exception as e:
                newly[rank] = mpi_error_reason(str(e))
                continue
            if rank in self.ending:
                newly[rank] = ENDS_THE_JOB
                continue
            silent = now - self.last[rank]
            if rank in self.checked and silent > self.timeout_s and now >= self.held_until.get(rank, 0.0):
                newly[rank] = f"no heartbeat for {silent:.1f} s" + self._held_here(self.last[rank], now)
            elif rank in self.checked and rank in self.processes and (why := samehost.ended(self.processes[rank])):
                if now - self.ended_at.setdefault(rank, now) >= ENDED_GRACE_S:
                    newly[rank] = why  # on this host: no need to wait for the silence
        for rank, why in newly.items():
            self.declare(rank, why)
        if newly:
            raise PeerLost(newly)
        self._run_hooks()

    def _held_here(self, since: float, now: float) -> str:
        """", and none went out from here for S s": this rank's own heartbeats held through much of a
        peer's silence, so the silence may be this process's (frozen in MPI) as much as the peer's.
        Absent from both lines of the --respawn soak's stall, which is how that stall was told to be
        the transport's, not a frozen process (benchmarks/REJOIN.md#2026-11-27-1429-utc-respawn-2026-11-27b)."""
        held = self.heartbeat.held_s(since, now) if self.heartbeat is not None else 0.0
        return f", and none went out from here for {held:.1f} s" if held >= self.timeout_s / 2 else ""

    def seen(self, now: float | None = None) -> dict[int, tuple[list[float] | None, float, float]]:
        """Each peer not lost: (its last beat's payload or None, seconds since anything was heard
        from it, seconds since that beat)."""
        now = self.clock() if now is None else now
        out = {}
        for rank in sorted(self.last):
            if rank not in self.lost:
                beat, at = self.beats.get(rank, (None, now))
                out[rank] = (beat, now - self.last[rank], now - at)
        return out

    def close(self) -> bool:
        """Wait (up to the timeout) for the last beat of every peer not lost; False if one did
        not come (it died meanwhile: then MPI_Finalize is unsafe)."""
        def retired() -> bool:
            for rank in [r for r in self.recv if r not in self.lost]:
                self._drain(rank, self.clock())
            return all(r in self.lost for r in self.recv)

        try:
            return poll(retired, CLOSE_POLL_S, deadline=self.clock() + self.timeout_s, clock=self.clock)
        except MPI.Exception:
            return False


def start(comm, rank: int, layout: Layout, timeout_s: float, activity=None):
    """(heartbeat thread or None, watch): each rank beats to and watches its layout peers."""
    PHASE_RANK[0] = rank
    if layout.single or timeout_s <= 0:
        return None, NoWatch()
    peers = layout.peers(rank)
    heartbeat, watch = Heartbeat(comm, peers, timeout_s, activity), Watch(comm, peers, timeout_s)
    watch.heartbeat = heartbeat
    WATCHDOG.arm(rank, timeout_s)  # as long as the heartbeats run: a peer takes this rank for lost then
    return heartbeat, watch


class NoWatch(WaitHooks):
    """--worker-timeout 0: nobody is ever declared lost, and no heartbeat says what peers do;
    the hooks still run (the stall report, without that knowledge)."""

    watched: list[int] = []
    lost: dict = {}

    def __init__(self):
        super().__init__()
        self._next_check = 0.0

    def seen(self, now: float | None = None) -> dict:
        return {}

    def heard(self, rank: int) -> None:
        pass

    def forget(self, rank: int) -> None:
        pass

    def declare(self, rank: int, reason: str) -> None:
        pass

    def check(self, force: bool = False) -> None:
        now = time.monotonic()
        if self.hooks and (force or now >= self._next_check):
            self._next_check = now + CHECK_EVERY_S
            self._run_hooks()

    def close(self) -> bool:
        return True
