"""Sync (and --quorum) goes on without a lost worker (--on-lost-worker continue): the workers left
regroup. Rank 0 runs the Arbiter (inside sync.follow_coordinator), every worker a Notices receive and
`regroup` (inside sync.work).

Rank 0 is the one that decides: it hears every worker's heartbeat, so it notices a lost one
(silent past --worker-timeout, or an MPI error on its message) while the others may only see
their Allreduce hang (MPICH) or fail (Open MPI's ULFM). It sends each worker left a NOTICE
(TAG_REGROUP: a generation number and every rank lost so far). A worker sees it at its next
look at the watch, wherever it waits (Regroup is raised there), answers READY and waits for
rank 0's GO, which comes once every worker left is ready. Until GO nothing blocks: a worker lost
meanwhile (several killed at once, or one killed before the first was declared: in
benchmarks/elastic_soak.py that ended most jobs before READY/GO) makes rank 0 send a newer
NOTICE, and the regroup starts again without it too. After GO each worker:

1. forms a new worker communicator over the workers left, made by them alone
   (mpiimpl.survivors: MPI_Comm_create_group under MPICH, MPI_Comm_create_from_group under Open
   MPI, which refuses the first over COMM_WORLD after a failure; measured): nothing is asked of
   the dead process, and the old communicator, with its collective pending on it, is left behind;
2. agrees on the state: the workers are at most one update apart (a collective may have
   completed on some and not on others when the worker died in it), and the one furthest
   *behind* (the lowest rank among them) broadcasts parameters and optimizer state to the others:
   the replicas are bitwise identical again. Behind, not ahead: a sum that only some of the
   survivors completed is the one the dead worker was part of, the only one that can hold a
   contribution it had half sent (a regroup once went on from exploded parameters); the state
   before it was every survivor's. It costs at most one update;
3. trains on from that step, the data re-sharded over the workers left (each worker's stream
   from that step on, with the new shard), the learning rate scaled to the new count (--lr-scaling
   linear), the first of them the coordinator (it says FLAG_REGROUPED to rank 0 first; rank 0 ignores
   what the coordinator sent before that).

When a worker's loop ends it does not leave the training phase on its own: it waits for rank 0's
DONE (TAG_REGROUP flagged STOP), which rank 0 sends once it has the coordinator's final state; a NOTICE
instead (a worker died during the last step) regroups once more, at the budget, and ends again.
A loss after GO, while the workers are in the regroup's collectives (milliseconds), ends the job
as --on-lost-worker stop does: they could be waiting there for the dead one. Requests left on
the old communicator never complete, so every rank ends without MPI_Finalize (the goodbye says a
peer was lost).
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from typing import Callable

import numpy as np
from mpi4py import MPI

from mpitrain.core.console import say
from mpitrain.core.layout import PS_RANK
from mpitrain.duties.checkpoint import TrainState, bcast_ledger, state_arrays
from mpitrain.exchange.protocol import FLAG_ENDED, FLAG_GO, TAG_REGROUP, Message
from mpitrain.exchange.transport import WORKER_POLL_S, Poller, tested
from mpitrain.exchange.waiting import poll
from mpitrain.launch import mpiimpl
from mpitrain.membership.liveness import PeerLost, wait_all
from mpitrain.runtime import Context

STRINGTAG = "mpitrain.regroup.{gen}"  # the new communicator's tag (Open MPI: a string): one per generation
REGROUP_TAG = 1000  # MPICH's: REGROUP_TAG + generation
LEFT_BEHIND: list = []  # every Regroup acted on, with its traceback, alive until the process ends (regroup)


class Regroup(Exception):
    """Raised on a worker where it waits, when rank 0's NOTICE has come: regroup without `lost`
    (every rank lost so far). The loop it interrupts attaches where it was (`state`, `counts`)."""

    def __init__(self, gen: int, lost: frozenset[int]):
        super().__init__(f"regroup {gen} without rank(s) {sorted(lost)}")
        self.gen, self.lost = gen, lost
        self.state: TrainState | None = None  # the updates this worker has applied
        self.counts = (0, 0)  # --quorum: gradients it contributed and dropped in the loop it left


@contextlib.contextmanager
def interrupted_at(state: Callable[[], TrainState], counts: Callable[[], tuple[int, int]] = lambda: (0, 0)):
    """Around a worker's loop: a Regroup (or a PeerLost: a take-over starts from it, failover.py)
    raised anywhere inside leaves carrying where the loop was, read when it is raised: the state of
    the updates applied (`state()`) and the gradients contributed and dropped (`counts()`; --quorum,
    and async's pushes). An inner loop's is kept."""
    try:
        yield
    except (Regroup, PeerLost) as r:
        if r.state is None:
            r.state, r.counts = state(), counts()
        raise


def minimum_workers(ctx: Context) -> int:
    """Below this many workers sync ends (--quorum Q: Q; plain sync: one)."""
    return ctx.cfg.quorum or 1


class Notices:
    """A worker's receive of rank 0's TAG_REGROUP messages, looked at in every wait of the loop
    that names it (sync.work: watch.during): a NOTICE raises Regroup; DONE says training is over
    (`done`)."""

    def __init__(self, ctx: Context):
        self.comm = ctx.comm
        self.box = Message(ctx.size)
        self.req = self._post()
        self.go = 0  # the last generation rank 0 said GO for
        self.done = False

    def _post(self):
        return self.comm.Irecv(self.box.spec(), source=PS_RANK, tag=TAG_REGROUP)

    def check(self) -> None:
        if self.done or not tested(self.req, PS_RANK):  # rank 0 dead (ULFM fails this receive): PeerLost
            return
        self.box.check(TAG_REGROUP, PS_RANK)
        if self.box.flags & FLAG_ENDED:
            self.done = True  # the last message rank 0 sends on this tag: nothing is left posted
            return
        gen = self.box.generation
        go = bool(self.box.flags & FLAG_GO)
        lost = frozenset(int(r) for r in np.flatnonzero(self.box.payload))
        self.req = self._post()
        if go:
            self.go = gen
            return
        raise Regroup(gen, lost)

    def _go_for(self, gen: int) -> bool:
        self.check()
        return self.go == gen

    def ready(self, ctx: Context, gen: int) -> None:
        """Tell rank 0 this worker is ready to regroup (generation `gen`), then wait for its GO,
        watching: a newer NOTICE (another worker lost meanwhile) raises Regroup here, and this
        worker starts over without that one too. Nothing blocks before GO."""
        msg = Message(0)
        msg.stamp(TAG_REGROUP, generation=gen)
        req = self.comm.Isend(msg.spec(), dest=PS_RANK, tag=TAG_REGROUP)
        # Looked at on every poll, not at the watch's pace (0.1 s): a worker that dies between its
        # READY and the collectives hangs the others there, so that window must stay milliseconds.
        poll(lambda: self._go_for(gen), WORKER_POLL_S * 50, ctx.watch)
        Poller(WORKER_POLL_S * 50, ctx.watch).all([req], [PS_RANK])

    def await_done(self, ctx: Context) -> None:
        """After the loop: until rank 0 says training is over (or a NOTICE raises Regroup)."""
        poll(lambda: self.done, WORKER_POLL_S * 50, ctx.watch)


def regroup(ctx: Context, r: Regroup) -> tuple[Context, TrainState]:
    """This worker's part of a regroup: the new communicator over the workers left, then the state
    of the one furthest behind (the module's doc, 2). Returns the new context and the state to train on from."""
    LEFT_BEHIND.append(r)  # the interrupted loop's frames: its buffers, which late messages may still reach
    layout = ctx.layout.without(r.lost)
    comm = mpiimpl.survivors(ctx.comm, layout.worker_ranks, REGROUP_TAG + r.gen, STRINGTAG.format(gen=r.gen))
    ctx = dataclasses.replace(ctx, layout=layout, worker_comm=comm)
    mine = r.state
    step = np.array([mine.global_step], np.int64)
    comm.Allreduce(MPI.IN_PLACE, step, op=MPI.MIN)
    root = np.array([comm.Get_rank() if mine.global_step == step[0] else comm.Get_size()], np.int64)
    comm.Allreduce(MPI.IN_PLACE, root, op=MPI.MIN)
    state = broadcast_state(ctx, comm, mine, int(root[0]))
    state.positions = [state.global_step] * ctx.workers  # each worker's new shard, from this step
    return ctx, state


def broadcast_state(ctx: Context, comm, mine: TrainState, root: int) -> TrainState:
    """`root`'s parameters, step, data deal and optimizer state on every worker of `comm`. The moving average
    (--ema-decay) lives on the coordinator only: the new coordinator keeps its own, or starts one (None)."""
    head = np.array([mine.global_step, mine.opt_t], np.int64)
    comm.Bcast(head, root=root)
    state = TrainState(None, int(head[0]), int(head[1]), ema=mine.ema if ctx.worker_index == 0 else None)
    bcast_ledger(comm, mine, state, root)
    for name in [k for k in state_arrays(ctx.cfg) if k != "ema"]:  # params, then the optimizer's
        a = np.ascontiguousarray(mine.array(name), np.float32)
        comm.Bcast([a, MPI.FLOAT], root=root)
        state.set_array(name, a)
    return state


class Arbiter:
    """Rank 0's side, inside sync.follow_coordinator: `lost` decides whether the job goes on and sends
    the NOTICEs; `requests` and `ready` take the workers' READY and send GO; `regrouped` takes the
    new coordinator's first status; `done` ends the workers' training phase. `awaiting` is the
    generation whose FLAG_REGROUPED the coordinator has not sent yet (0: none)."""

    def __init__(self, ctx: Context):
        self.ctx = ctx
        self.gen = 0
        self.awaiting = 0
        self.lost_ranks: frozenset[int] = frozenset()
        self.declared_at = 0.0
        self.going = False  # GO sent for generation `awaiting`: the workers are in the regroup's collectives
        self.expected: list[int] = []  # the workers left, whose READY this generation needs
        self.readied: set[int] = set()
        self.ready_boxes = {r: Message(0) for r in ctx.layout.worker_ranks}
        self.ready_reqs: dict = {}
        self.sends: list = []  # (message, its sends): never waited on, a worker may die before it takes its NOTICE

    def lost(self, e: PeerLost, layout) -> object:
        """The workers in `e` are lost: the new layout, after a NOTICE to every worker left; or
        PeerLost again when the job cannot go on (a server, a loss after GO while the workers
        regroup, or fewer workers left than it needs). A loss before GO (another worker killed
        before the first one was declared: a node with several ranks going down) just starts the
        regroup again, without both."""
        ctx = self.ctx
        if any(layout.is_server(r) for r in e.lost) or self.going:
            raise e
        layout = layout.without(e.lost)
        if layout.workers < minimum_workers(ctx):
            raise e
        self.gen += 1
        self.awaiting = self.gen
        if not self.declared_at:
            self.declared_at = time.monotonic()
        self.lost_ranks = layout.lost
        self.readied = set()
        self.expected = list(layout.worker_ranks)
        for r in self.expected:  # one receive per worker, kept across generations (a stale READY is re-posted)
            if not self.ready_reqs.get(r):
                self.ready_reqs[r] = self.ctx.comm.Irecv(self.ready_boxes[r].spec(), source=r, tag=TAG_REGROUP)
        self._tell(layout.worker_ranks, self.gen, 0)
        return layout

    def requests(self) -> tuple[list[int], list]:
        """The READY receives to wait on beside the coordinator's status: (their ranks, the requests)."""
        ranks = [r for r in self.expected if self.awaiting and not self.going and r not in self.readied]
        return ranks, [self.ready_reqs[r] for r in ranks]

    def ready(self, rank: int) -> None:
        """Worker `rank`'s READY came. Once every worker left is ready for this generation, GO: they
        are all alive and listening, and go into the regroup's collectives together."""
        box = self.ready_boxes[rank]
        box.check(TAG_REGROUP, rank, count=0)
        self.ready_reqs[rank] = None
        if box.generation != self.gen:  # for a generation superseded since
            self.ready_reqs[rank] = self.ctx.comm.Irecv(box.spec(), source=rank, tag=TAG_REGROUP)
            return
        self.readied.add(rank)
        if self.readied == set(self.expected):
            self.going = True
            self._tell(self.expected, self.gen, FLAG_GO)

    def regrouped(self, gen: int, step: int, workers: int) -> bool:
        """The coordinator's FLAG_REGROUPED of generation `gen` came: what it sends from now on counts.
        Says so in one line (how long the regroup took, from the loss being declared)."""
        if gen == self.awaiting and self.going:
            self.awaiting, self.going = 0, False
            say(f"mpitrain: {workers} worker(s) regrouped at global step {step}, "
                f"{time.monotonic() - self.declared_at:.2f} s after the loss was declared", sys.stderr)
            self.declared_at = 0.0
        return not self.awaiting

    def done(self, layout) -> None:
        """Training is over: every worker left may leave its loop (its sends are waited for with a
        bound and never raise: a worker lost now is the end of the run's business)."""
        reqs = self._tell(layout.worker_ranks, self.gen, FLAG_ENDED)
        wait_all(reqs, self.ctx.cfg.worker_timeout)

    def _tell(self, ranks, gen: int, flags: int) -> list:
        box = Message(self.ctx.size)
        box.payload[:] = 0
        box.payload[list(self.lost_ranks)] = 1
        box.stamp(TAG_REGROUP, flags=flags, generation=gen)
        reqs = [self.ctx.comm.Isend(box.spec(), dest=r, tag=TAG_REGROUP) for r in ranks]
        self.sends.append((box, reqs))  # kept alive until the end: a send to a dead worker never completes
        return reqs
