"""--spares N: the last N ranks that mpirun started wait as hot spares, and a lost worker's place goes
to one of them at the next step boundary, before --respawn starts a new process.

Why: a worker started with MPI_Comm_spawn (--respawn) is a process of another launch, which MPICH
reaches over UCX and Open MPI over TCP, never their own shared memory (docs/elastic.md: the job slows
down as replacements take over, and a spawned worker SIGKILLed mid-message can block MPICH's UCX
receive queue for good); it also starts from nothing (Python, MPI_Init, the data: ~1 s here). A spare
is one of the job's own processes, with its data loaded and its MPI connections those of every rank
mpirun started: it joins in the time the job takes to re-form, and trains as fast as the worker it
replaces. The cost: N processes that wait (a poll every POLL_S and a message every BEAT_S each).

How: `split` (collective over COMM_WORLD, first thing) takes the spares out of the job's world; rank 0
and each spare make an intercommunicator of their own (a joiner's connection, join.py), over which
a spare is let in as a joiner that connected is: rank 0's lobby picks it for a lost worker
(`Pool.take`), makes room, sends GO (join.why_not_there), and the ranks left and the spare form the
next phase's world (join.grow, CONNECTED; the spare's side: join.into_job). While it waits, rank 0's
beats (TAG_HEARTBEAT on that connection, every BEAT_S while the job trains) carry the job's step
budget; a spare that hears none for `quiet_s` (or finds rank 0's process gone, on its host) leaves
in one line. At the job's end rank 0 tells every spare left to leave (`dismiss_all`: join.tell_to_leave,
flagged PEER_LOST when a rank was lost, so that it leaves without MPI_Finalize as the job's ranks do).
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
import time

from mpi4py import MPI

from mpitrain.config import TrainConfig, UsageError
from mpitrain.console import say
from mpitrain.exitcodes import ExitCode, interrupted
from mpitrain.join import GROW_TAG, Joiner, answer_go, dead_here, into_job, tell_to_leave
from mpitrain.protocol import FLAG_PEER_LOST, FLAG_STOP, H_FLAGS, H_STEP, TAG_HEARTBEAT, TAG_JOIN, Message

SPARE_TAG = GROW_TAG + 1  # MPI_Intercomm_create's tag between rank 0 and the spare of world rank r: SPARE_TAG + r
# (one tag for all: MPICH 5.0.2 segfaulted in rank 0's second MPI_Intercomm_create, measured)
BEAT_S = 1.0  # rank 0 -> each waiting spare: the job is alive (and its step budget)
POLL_S = 0.01  # a waiting spare looks at its connection this often, and rank 0 at its spares


def quiet_s(cfg: TrainConfig) -> float:
    """How long a spare waits without a beat before it takes rank 0 for lost: rank 0 beats only from
    its training loop's waits, and a phase's end (saving, evaluating, re-forming: join.FORM_LIMIT_S)
    goes by without one."""
    return max(60.0, 4 * cfg.worker_timeout)


@dataclasses.dataclass
class Spare:
    """Rank 0's view of one spare: its connection, where it runs, its beat in flight."""

    inter: object
    world_rank: int
    host: str
    pid: int
    beat: object = None  # the MPI request of the last beat sent
    beat_since: float = 0.0  # when that beat was sent
    beat_message: object = None  # its buffer, kept until the send completes

    def joiner(self) -> Joiner:
        return Joiner(self.inter, self.host, self.pid)


class Pool:
    """Rank 0: the spares still waiting (join.Carry.spares). The lobby beats them while the job
    trains (`tend`) and takes one for each lost worker (`take`); the job's end dismisses the rest."""

    def __init__(self, spares: list[Spare], cfg: TrainConfig):
        self.waiting, self.cfg = spares, cfg
        self.budget = 0  # the job's step budget, once the first phase knows it
        self.lost_one = False  # a spare died: it is in every rank's COMM_WORLD, so none may call MPI_Finalize
        self._next = 0.0  # rank 0's waits look at the lobby thousands of times a second: the spares every POLL_S

    def __len__(self) -> int:
        return len(self.waiting)

    def describe(self) -> str:
        ranks = ", ".join(f"{s.world_rank} on {s.host}" for s in self.waiting)
        return f"{len(self.waiting)} spare(s) waiting: rank {ranks}"

    def tend(self, now: float | None = None) -> None:
        """Beat every waiting spare (one beat in flight each); forget one that is gone."""
        now = time.monotonic() if now is None else now
        if now < self._next:
            return
        self._next = now + POLL_S
        for spare in list(self.waiting):
            if dead_here(spare.host, spare.pid):
                self._gone(spare, "its process has ended")
                continue
            try:
                done = spare.beat is None or spare.beat.Test()
            except MPI.Exception:
                self._gone(spare, "its connection failed")
                continue
            if done and now - spare.beat_since >= BEAT_S:
                beat = Message(0)
                beat.stamp(TAG_HEARTBEAT, step=self.budget)
                try:
                    spare.beat, spare.beat_since = spare.inter.Isend(beat.spec(), dest=0, tag=TAG_HEARTBEAT), now
                    spare.beat_message = beat
                except MPI.Exception:
                    self._gone(spare, "its connection failed")
            elif not done and now - spare.beat_since > quiet_s(self.cfg):
                self._gone(spare, f"it took no beat for {quiet_s(self.cfg):g} s")

    def take(self) -> Spare | None:
        """A spare for a lost worker (it leaves the pool), or None."""
        self._next = 0.0
        self.tend()
        return self.waiting.pop(0) if self.waiting else None

    def _gone(self, spare: Spare, why: str) -> None:
        self.waiting.remove(spare)
        self.lost_one = True
        say(f"mpitrain: the spare rank {spare.world_rank} on {spare.host} (pid {spare.pid}) is gone ({why}); "
            f"{len(self.waiting)} spare(s) left", sys.stderr)

    def dismiss_all(self, peer_lost: bool) -> None:
        """The job ends: every spare left leaves (without MPI_Finalize after a loss, as the job's ranks)."""
        while self.waiting:
            spare = self.waiting.pop(0)
            if not dead_here(spare.host, spare.pid):
                tell_to_leave(spare.inter, flags=FLAG_PEER_LOST if peer_lost else 0)


POOL: list[Pool] = []  # rank 0's, once split: the job's ends that leave without unwinding dismiss it too


def split(cfg: TrainConfig, comm):
    """Collective over COMM_WORLD, before anything else: (the job's world, this rank's spare side).
    The job's world is every rank but the last cfg.spares; rank 0 gets a Pool of them, a spare its
    connection to rank 0 and where rank 0 runs, the others None."""
    size, rank = comm.Get_size(), comm.Get_rank()
    if cfg.spares >= size - 1:
        raise UsageError(f"--spares {cfg.spares} leaves no worker: mpirun started {size} rank(s), of which the last "
                         f"{cfg.spares} would wait; start more (mpirun -np {cfg.spares + 3} for two workers) or fewer spares")
    first = size - cfg.spares
    where = comm.allgather((socket.gethostname(), os.getpid()))  # start-up only
    job = comm.Split(int(rank >= first), rank)
    if rank == 0:
        pool = Pool([Spare(MPI.COMM_SELF.Create_intercomm(0, comm, r, SPARE_TAG + r), r, *where[r])
                     for r in range(first, size)], cfg)
        POOL.append(pool)
        return job, pool
    if rank >= first:
        job.Free()
        return None, (MPI.COMM_SELF.Create_intercomm(0, comm, 0, SPARE_TAG + rank), where[0])
    return job, None


def dismiss_all(peer_lost: bool) -> None:
    """Rank 0, the job ending (however it ends, before MPI_Finalize): every spare left leaves."""
    if POOL and not MPI.Is_finalized():
        POOL.pop().dismiss_all(peer_lost)


def stand_by(cfg: TrainConfig, link, carry, mine, library: bool = False) -> tuple[int, object] | int:
    """A spare: load what a worker needs (`mine`), then wait on rank 0's connection. Returns (the job's
    step budget, the new world) when rank 0 lets it in, else the exit code it leaves with (0: the job
    ended without needing it; interrupted: a stop signal came first and the job ended). After a lost
    rank the command line leaves without MPI_Finalize at once; the Python API (`library`) returns, with
    carry.peer_lost set (api.LostPeer)."""
    from mpitrain.stopping import STOP

    inter, (host, pid) = link
    mine()
    go, beat = Message(0), Message(0)
    go_req = inter.Irecv(go.spec(), source=0, tag=TAG_JOIN)
    beat_req = inter.Irecv(beat.spec(), source=0, tag=TAG_HEARTBEAT)
    budget, heard = 0, time.monotonic()
    while True:
        while beat_req.Test():
            budget, heard = int(beat.header[H_STEP]) or budget, time.monotonic()
            beat_req = inter.Irecv(beat.spec(), source=0, tag=TAG_HEARTBEAT)
        if go_req.Test():
            break
        if dead_here(host, pid) or time.monotonic() - heard > quiet_s(cfg):
            why = "its process has ended" if dead_here(host, pid) else f"no word from it for {quiet_s(cfg):g} s"
            say(f"mpitrain: spare rank {MPI.COMM_WORLD.Get_rank()}: the job's rank 0 was lost ({why}); leaving", sys.stderr)
            return leave(True, ExitCode.PEER_LOST, carry, library)
        time.sleep(POLL_S)
    if go.header[H_FLAGS] & FLAG_STOP:
        code = interrupted(STOP.signum) if STOP.signum else ExitCode.OK
        return leave(bool(go.header[H_FLAGS] & FLAG_PEER_LOST), code, carry, library)
    while not budget:  # a beat with it came before GO, on another tag: it may be received after it
        beat_req.Wait()
        budget = int(beat.header[H_STEP])
        beat_req = inter.Irecv(beat.spec(), source=0, tag=TAG_HEARTBEAT)
    beat_req.Cancel()  # no beat is sent to a spare let in; one in flight is received (or the receive cancelled) here
    beat_req.Wait()
    carry.start_forming("the spare")
    answer_go(inter)
    world = into_job(inter)
    carry.peer_lost = True  # a spare comes in for a lost rank: MPI_Finalize would wait for it
    if not STOP.signum:
        STOP.reset()
    return budget, world


def leave(peer_lost: bool, code: int, carry, library: bool) -> int:
    carry.peer_lost |= peer_lost
    if peer_lost and not library:
        from mpitrain.lock import exit_without_finalize

        exit_without_finalize(code)
    return code
