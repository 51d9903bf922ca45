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

With --on-lost-server continue, rank 0's successor (failover.py) takes the spares over (`adopt`): at
the start every worker makes its own connection to each spare too (`split`: carry.roster on the
worker, the spare's backups), while every rank lives. Once the survivors' world is formed they tell
each other which of them are ranks of this launch (`members`: a spare let in already is one), and the
successor offers itself (TAG_ADOPT) on its connection to every spare not among them. A spare listens
on each of its connections to a worker (`Offers`), answers the first offer, and from then on waits on
that connection for the successor's beats and GO as it did on rank 0's; the successor's pool lets the
first one in at once, in the lost rank 0's worker's place (join.Carry.owed). A spare that finds rank 0
gone waits `adoption_s` for an offer before it leaves.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
import time

import numpy as np
from mpi4py import MPI

from mpitrain.core.config import TrainConfig, UsageError
from mpitrain.core.console import say
from mpitrain.core.exitcodes import ExitCode, interrupted
from mpitrain.exchange.protocol import (FLAG_ENDED, FLAG_PEER_LOST, TAG_ADOPT, TAG_HEARTBEAT,
                                        TAG_JOIN, Message)
from mpitrain.membership.join import GROW_TAG, Joiner, answer_go, dead_here, into_job, tell_to_leave

SPARE_TAG = GROW_TAG + 1  # MPI_Intercomm_create's tag between rank w (0, or a worker) and the spare of world rank r:
# SPARE_TAG + size * w + r (split)
BEAT_S = 1.0  # rank 0 -> each waiting spare: the job is alive (and its step budget)
POLL_S = 0.01  # a waiting spare looks at its connection this often, and rank 0 at its spares


def quiet_s(cfg: TrainConfig) -> float:
    """How long a spare waits without a beat before it takes rank 0 for lost: rank 0 beats only from
    its training loop's waits, and a phase's end (saving, evaluating, re-forming: join.FORM_LIMIT_S)
    goes by without one."""
    return max(60.0, 4 * cfg.worker_timeout)


def adoption_s(cfg: TrainConfig) -> float:
    """--on-lost-server continue: how long a spare that found rank 0 gone waits for the successor's
    offer. The workers notice the loss within --worker-timeout, agree within AGREE_FACTOR of them plus
    a grace of one more (failover.agree), then form their world: what is left is slack for 2 cores."""
    from mpitrain.membership.failover import AGREE_FACTOR

    return (AGREE_FACTOR + 2) * cfg.worker_timeout + 10.0


ANSWER_S = 5.0  # the successor waits this long for the spares' answers to its offer (they look every POLL_S)
KEPT: list = []  # offers, answers and the dead rank 0's receives: alive until the process ends


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
                beat.stamp(TAG_HEARTBEAT, budget=self.budget)
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


def split(cfg: TrainConfig, comm, carry) -> tuple:
    """Collective over COMM_WORLD, before anything else: (the job's world, this rank's spare side).
    The job's world is every rank but the last cfg.spares; rank 0 gets a Pool of them, a spare its
    connection to rank 0, where every rank runs and its connections to the workers (`adopt`), the
    others None. With --on-lost-server continue every worker makes its own connection to each spare
    now (carry.roster), while every rank is alive: Open MPI's MPI_Intercomm_create over a COMM_WORLD
    with a dead rank in it failed (MPI_ERR_INTERN, measured), so a successor could not make one then."""
    size, rank = comm.Get_size(), comm.Get_rank()
    if cfg.spares >= size - 1:
        raise UsageError(f"--spares {cfg.spares} leaves no worker: mpirun started {size} rank(s), of which the last "
                         f"{cfg.spares} would wait; start more (mpirun -np {cfg.spares + 3} for two workers) or fewer spares")
    first = size - cfg.spares
    where = comm.allgather((socket.gethostname(), os.getpid()))  # start-up only
    job = comm.Split(int(rank >= first), rank)
    # Every pair (worker w, spare r) connects in the same order on both sides (rank 0 first, then by rank):
    # no cycle of waits. One tag per pair: MPICH 5.0.2 segfaulted in a rank's second MPI_Intercomm_create
    # that reused its tag (measured).
    standby = range(1, first) if cfg.on_lost_server == "continue" else range(0)

    def connect(w: int, r: int) -> object:
        return MPI.COMM_SELF.Create_intercomm(0, comm, r if rank == w else w, SPARE_TAG + size * w + r)

    if rank == 0:
        pool = Pool([Spare(connect(0, r), r, *where[r]) for r in range(first, size)], cfg)
        POOL.append(pool)
        return job, pool
    if rank >= first:
        job.Free()
        return None, (connect(0, rank), where, {w: connect(w, rank) for w in standby})
    if rank in standby:
        carry.roster = [Spare(connect(rank, r), r, *where[r]) for r in range(first, size)]
    return job, None


def dismiss_all(peer_lost: bool) -> None:
    """Rank 0, the job ending (however it ends, before MPI_Finalize): every spare left leaves."""
    if POOL and not MPI.Is_finalized():
        POOL.pop().dismiss_all(peer_lost)


class Offers:
    """A waiting spare's ear for a successor's offer (--on-lost-server continue): a receive on its
    connection to each worker that could become rank 0 (split)."""

    def __init__(self, backups: dict):
        self.backups = backups
        self.boxes = {w: Message(0) for w in backups}
        self.reqs = {w: inter.Irecv(self.boxes[w].spec(), source=0, tag=TAG_ADOPT) for w, inter in backups.items()}
        KEPT.append(self.boxes)

    def made(self) -> int | None:
        """The world rank whose offer came (this spare has answered it), or None."""
        for w, req in list(self.reqs.items()):
            try:
                done = req.Test()
            except MPI.Exception:  # that worker died (ULFM): it makes no offer
                done = False
                self.reqs.pop(w)
            if done:
                self.reqs.pop(w)
                answer = Message(0)
                answer.stamp(TAG_ADOPT)
                KEPT.append((answer, self.backups[w].Isend(answer.spec(), dest=0, tag=TAG_ADOPT)))
                return w
        return None

    def close(self) -> None:
        """Let in, or leaving: no more offers (a receive cancelled completes at once)."""
        for req in self.reqs.values():
            try:
                req.Cancel()
                req.Wait()
            except MPI.Exception:
                pass
        self.reqs = {}


def stand_by(cfg: TrainConfig, link, carry, mine, library: bool = False) -> tuple[int, object] | int:
    """A spare: load what a worker needs (`mine`), then wait on rank 0's connection. Returns (the job's
    step budget, the new world) when rank 0 lets it in, else the exit code it leaves with (0: the job
    ended without needing it; interrupted: a stop signal came first and the job ended). After a lost
    rank the command line leaves without MPI_Finalize at once; the Python API (`library`) returns, with
    carry.peer_lost set (api.LostPeer). With --on-lost-server continue, rank 0's successor may adopt it
    (`Offers`): it then waits on the successor's connection the same way."""
    from mpitrain.core.stop import STOP

    inter, where, backups = link
    host, pid = where[0]
    mine()
    offers = Offers(backups) if backups else None
    go, beat, go_req, beat_req = listen(inter)
    budget, heard, missed = 0, time.monotonic(), None  # missed: when rank 0 was first found gone
    while True:
        try:
            while beat_req is not None and beat_req.Test():
                budget, heard = beat.budget or budget, time.monotonic()
                beat_req = inter.Irecv(beat.spec(), source=0, tag=TAG_HEARTBEAT)
            if go_req is not None and go_req.Test():
                break
        except MPI.Exception:  # ULFM: rank 0's death fails the receives on its connection
            KEPT.append((go, beat, go_req, beat_req))
            go_req = beat_req = None
        successor = offers.made() if offers is not None else None
        if successor is not None:
            KEPT.append((go, beat, go_req, beat_req))  # the dead rank 0's: a late match lands in live memory
            inter, (host, pid) = backups[successor], where[successor]
            go, beat, go_req, beat_req = listen(inter)
            heard, missed = time.monotonic(), None
            say(f"mpitrain: spare rank {MPI.COMM_WORLD.Get_rank()}: the job's rank 0 was lost; waiting for rank "
                f"{successor}, which took over")
            continue
        gone = go_req is None or dead_here(host, pid)
        now = time.monotonic()
        if gone and offers is not None:
            missed = missed or now
            if now - missed < adoption_s(cfg):  # a successor is being chosen: its offer comes within this
                time.sleep(POLL_S)
                continue
        if gone or now - heard > quiet_s(cfg):
            why = ("its connection failed" if go_req is None else "its process has ended" if gone
                   else f"no word from it for {quiet_s(cfg):g} s")
            if offers is not None:
                why += f", and no successor took this spare over within {adoption_s(cfg):g} s"
                offers.close()
            say(f"mpitrain: spare rank {MPI.COMM_WORLD.Get_rank()}: the job's rank 0 was lost ({why}); leaving", sys.stderr)
            return leave(True, ExitCode.PEER_LOST, carry, library)
        time.sleep(POLL_S)
    if offers is not None:
        offers.close()
    if go.flags & FLAG_ENDED:
        code = interrupted(STOP.signum) if STOP.signum else ExitCode.OK
        return leave(bool(go.flags & FLAG_PEER_LOST), code, carry, library)
    while not budget:  # a beat with it came before GO, on another tag: it may be received after it
        beat_req.Wait()
        budget = beat.budget
        beat_req = inter.Irecv(beat.spec(), source=0, tag=TAG_HEARTBEAT)
    beat_req.Cancel()  # no beat is sent to a spare let in; one in flight is received (or the receive cancelled) here
    beat_req.Wait()
    carry.start_forming("the spare")
    answer_go(inter)
    world = into_job(inter)
    carry.peer_lost = True  # a spare comes in for a lost rank: MPI_Finalize would wait for it
    STOP.room_made()  # the room rank 0 made for this spare (heard in its beats)
    return budget, world


def listen(inter) -> tuple:
    """A waiting spare's receives on its rank 0's connection: GO (or the end), and a beat."""
    go, beat = Message(0), Message(0)
    return (go, beat, inter.Irecv(go.spec(), source=0, tag=TAG_JOIN),
            inter.Irecv(beat.spec(), source=0, tag=TAG_HEARTBEAT))


def members(world, carry) -> set[int]:
    """Collective over a world just formed: the COMM_WORLD ranks of its processes that mpirun started
    (a worker the job spawned, or one that joined by hand, has a COMM_WORLD of its own: left out)."""
    mine = np.array([-1 if carry.joiner else MPI.COMM_WORLD.Get_rank()], np.int64)
    every = np.empty(world.Get_size(), np.int64)
    world.Allgather([mine, MPI.INT64_T], [every, MPI.INT64_T])
    return {int(r) for r in every if r >= 0}


def adopt(cfg: TrainConfig, carry, among: set[int]) -> None:
    """The successor of a lost rank 0 (failover.py), its world formed: every spare of its roster not
    among the world's ranks (`members`: those let in already) and not known dead is offered to come
    over, on this rank's own connection to it (split); those that answer within ANSWER_S become this
    rank's pool (carry.spares), to be let in as rank 0's were."""
    from mpitrain.membership.failover import gather_within

    if carry.roster is None:
        say("mpitrain: the spares cannot follow this successor: it has no connection of its own to them (it joined "
            "the job: a spare, or a worker started by --respawn or --join); they leave once they find rank 0 gone",
            sys.stderr)
        return
    waiting = [sp for sp in carry.roster if sp.world_rank not in among and not dead_here(sp.host, sp.pid)]
    if not waiting:
        return
    offer = Message(0)
    offer.stamp(TAG_ADOPT, budget=carry.budget or 0)
    answers = {sp.world_rank: Message(0) for sp in waiting}
    sends = [sp.inter.Isend(offer.spec(), dest=0, tag=TAG_ADOPT) for sp in waiting]
    recvs = {sp.world_rank: sp.inter.Irecv(answers[sp.world_rank].spec(), source=0, tag=TAG_ADOPT) for sp in waiting}
    heard = gather_within(recvs, time.monotonic() + ANSWER_S, until_all=True)
    KEPT.append((offer, answers, sends, recvs))  # a late answer lands in live memory
    pool = Pool([sp for sp in waiting if sp.world_rank in heard], cfg)
    POOL[:] = [pool]
    carry.spares = pool
    silent = [sp.world_rank for sp in waiting if sp.world_rank not in heard]
    more = f"; no answer from spare rank(s) {', '.join(map(str, silent))} within {ANSWER_S:g} s" if silent else ""
    say(f"mpitrain: took over the spares: {pool.describe()}{more}")


def leave(peer_lost: bool, code: int, carry, library: bool) -> int:
    carry.peer_lost |= peer_lost
    if peer_lost and not library:
        from mpitrain.launch.lock import exit_without_finalize

        exit_without_finalize(code)
    return code
