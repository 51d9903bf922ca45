"""MPI's exchange, the default: the sync workers' nonblocking Allreduce on their own communicator
(MPIReducer), and an async worker's Isend/Irecv to each server (MPIPushPull)."""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from mpitrain.core import ledger
from mpitrain.core.codec import CODECS
from mpitrain.core.compress import Pushes, Replies
from mpitrain.core.layout import PS_RANK
from mpitrain.duties.checkpoint import TrainState
from mpitrain.duties.observe import ALLREDUCE
from mpitrain.exchange.protocol import FLAG_DIVERGED, FLAG_FINAL, FLAG_LAST, FLAG_LEAVING, TAG_GRAD, TAG_PARAMS, Message
from mpitrain.exchange.transport import WORKER_POLL_S, Poller, collective_poll_s
from mpitrain.exchange.waiting import poll
from mpitrain.launch import mpiimpl
from mpitrain.launch.faults import kill_here, push_kill
from mpitrain.membership import elastic
from mpitrain.membership.liveness import CHECK_EVERY_S as VERDICT_POLL_S
from mpitrain.membership.liveness import PeerLost
from mpitrain.runtime import Context

ABANDONED: list = []  # requests a lost peer left pending, and their buffers: alive until the process ends
_SUM_OPS: dict = {}  # --compress -> its MPI SUM op, created once per process


def wire_sum(compress: str):
    """(MPI datatype, SUM op) for an Allreduce of --compress's wire-typed values. MPI has no
    portable float16 or bfloat16 SUM: a commutative user op (core.codec's `add`) over 2-byte
    elements (the datatype is UINT16_T, so MPI never splits an element)."""
    codec = CODECS[compress]
    if codec.add is None:
        return MPI.FLOAT, MPI.SUM
    if compress not in _SUM_OPS:
        _SUM_OPS[compress] = MPI.Op.Create(codec.add, commute=True)
    return MPI.UINT16_T, _SUM_OPS[compress]


class InFlight:
    """A workers' collective started and not yet awaited (a Reducer's `start`): its request, what MPI
    reads and writes (`spec`), the buffer the result lands in, and a failure a progress look found."""

    def __init__(self, req, spec, buf):
        self.req, self.spec, self.buf = req, spec, buf
        self.failed: str | None = None

    def abandon(self) -> None:
        """Left unawaited (a regroup, a lost peer): kept alive, as watch_collective keeps its own."""
        if self.req:
            ABANDONED.append((self.req, self.spec, self.buf))


class WorkersCollective:
    """A collective of the workers on their own communicator (rank 0 is not in it). Always
    nonblocking and watched (watch_collective): a blocking one cannot notice that rank 0 died (the
    workers would wait for a peer that has already stopped). It spins, as MPICH's blocking ones do,
    unless ranks outnumber cores (--wait; transport.collective_poll_s)."""

    def __init__(self, ctx: Context):
        self.ctx, self.be, self.comm = ctx, ctx.backend, ctx.worker_comm
        self.waiter = Poller(collective_poll_s(ctx.cfg.wait, ctx.node.oversubscribed), ctx.watch)

    @property
    def alone(self) -> bool:
        return self.comm is None or self.comm.Get_size() == 1

    def progress(self, flight: InFlight) -> None:
        """One look at a collective in flight, no wait: MPICH moves a nonblocking collective only inside an MPI
        call (no progress thread by default), so a worker computing meanwhile gives it a turn every step. A
        failure found here is kept for `land`, which waits for rank 0's verdict on it."""
        if flight.req and flight.failed is None:
            done = self.waiter.test([flight.req])
            if done is not None and done.failed:
                flight.failed = done.failed[0]

    def land(self, flight: InFlight) -> None:
        """Wait for the collective in flight to complete (watched, as every collective's wait). The caller has
        entered ALLREDUCE: `sum` before its start, SyncStep before an overlapped exchange lands."""
        if flight.failed is not None:
            await_verdict(self.ctx, flight.failed)
        watch_collective(self.ctx, self.waiter, flight.req, flight.spec)

    def sum(self, buf, part: slice | None = None) -> bool:
        """Exchange.base.Reducer's: the sum started and awaited at once."""
        if self.alone:
            return False
        self.ctx.activity.enter(ALLREDUCE)
        self.finish(self.start(buf, part))
        return True

    def gather_rows(self, mine: np.ndarray) -> np.ndarray | None:
        """Each worker's `mine` (float32, as long on each) as a row of a matrix in worker order, on worker 0
        (None on the others): what every worker holds for itself, for a checkpoint. Watched as the sum is."""
        if self.alone:
            return mine[None].copy()
        rows = np.empty((self.comm.Get_size(), mine.size), np.float32) if self.comm.Get_rank() == 0 else None
        req = self.comm.Igather([mine, MPI.FLOAT], None if rows is None else [rows, MPI.FLOAT], root=0)
        watch_collective(self.ctx, self.waiter, req, (mine, rows))
        return rows


class MPIReducer(WorkersCollective):
    """The workers' Allreduce, in the wire type of --compress, staged through host memory where MPI
    cannot read the buffer (a GPU without CUDA-aware MPI)."""

    def __init__(self, ctx: Context, count: int):
        super().__init__(ctx)
        cfg, be = ctx.cfg, ctx.backend
        wire = np.dtype(cfg.wire_dtype)
        self.wire = None  # what travels: the buffer itself (NumPy or CUDA-aware, float32), else a staged copy
        if wire != np.float32 or (be.is_gpu and not be.cuda_aware):
            self.wire = be.host_alloc(wire.itemsize * count).view(wire)
        self.mpi_type, self.op = wire_sum(cfg.compress)

    def start(self, buf, part: slice | None = None) -> InFlight:
        """Start summing `buf` over the workers, in place (staged through the wire buffer where MPI cannot
        read it, or it travels in another type). `part`: an elementwise sum needs no word of which it is."""
        if self.wire is not None:  # (`buf` may be the tail of SyncStep's: --fragments' part)
            wire = self.wire[:buf.shape[0]]
            self.be.download(buf, wire)
            spec, op = [wire, self.mpi_type], self.op
        else:
            self.be.download(buf, buf)  # NumPy: nothing; CUDA-aware: finish compute before MPI reads
            spec, op = [buf, MPI.FLOAT], MPI.SUM
        return InFlight(self.comm.Iallreduce(MPI.IN_PLACE, spec, op=op), spec, buf)

    def finish(self, flight: InFlight) -> None:
        """Wait for the sum started by `start`; it is then in that buffer."""
        self.land(flight)
        travelled = flight.spec[0]  # `buf` itself, or the wire's part it was staged through
        if self.wire is not None:
            self.be.upload(flight.buf, travelled)
        self.ctx.activity.moved(travelled.nbytes, travelled.nbytes)


def watch_collective(ctx: Context, waiter: Poller, req, spec) -> None:
    """Wait for the workers' collective `req` over the buffer `spec`; a part that failed (a worker died
    in it) waits for rank 0's verdict (await_verdict)."""
    try:
        done = waiter.some([req])
    except BaseException:
        # Left pending (a regroup, a lost peer): the live workers' parts may still arrive, and MPI
        # writes them into the buffer, which must never be memory that was freed and reused.
        # (First suspected of a CI run's regroup going on from exploded parameters; it was not
        # that: sync's check of the sum's exact slots is what stopped it, modes/sync_slots.torn.)
        ABANDONED.append((req, spec))
        raise
    if done.failed:
        await_verdict(ctx, done.failed[0])


def held_copy(ex) -> TrainState:
    """A message-path exchange's held() (MPIPushPull, mailbox.MailPushPull): what a take-over starts from
    (rank 0 lost, failover.py), the parameters this worker holds at the global step each server answered
    them at."""
    return TrainState(np.array(ex.be.to_host(ex.params), np.float32), ex.versions[0], versions=list(ex.versions),
                      mark=ex.mark)


def first_mark(ctx: Context, start: TrainState) -> tuple[int, int]:
    """A message-path exchange's mark until rank 0's first answer: what the start's parameters hold (the
    checkpoint's deal, core/ledger.mark), so a take-over before that answer misses nothing."""
    return ledger.mark(ctx.dealt(start), start.redeal)


def await_verdict(ctx: Context, why: str) -> None:
    """The gradient Allreduce failed: a worker died in the middle of it. Rank 0 notices within
    --worker-timeout and either tells the workers left to regroup (elastic.Regroup is raised here)
    or ends the job naming that worker; a worker that stopped here on its own would be taken for a
    second lost one. So wait for rank 0, still watching it: if it is gone too, PeerLost ends this
    rank."""
    if mpiimpl.ends_job_on_error_exit():
        # Open MPI under ULFM: rank 0 does not abort (mpiimpl.farewell) and ULFM names the dead
        dead = mpiimpl.failed_ranks(ctx.worker_comm, ctx.comm)
        left = len(set(ctx.layout.worker_ranks) - set(dead))
        if dead and not (ctx.regroups and left >= elastic.minimum_workers(ctx)):
            raise PeerLost({rank: f"the gradient Allreduce failed ({why})" for rank in dead})
    if not ctx.watch.watched:  # --worker-timeout 0: nobody will decide
        raise PeerLost({PS_RANK: f"the gradient Allreduce failed ({why}) and --worker-timeout is 0"})
    poll(lambda: False, VERDICT_POLL_S, ctx.watch)  # ends in PeerLost (rank 0's Abort ends this process first)


class MPIPushPull:
    """An async worker's messages (exchange.base.PushPull): a push is a gradient to every server
    (with --num-ps K each its slice of the one flat buffer, protocol.Message.shard_parts: received
    in place; sent from a copy but for the first server's), answered by each with its slice of
    the parameters. Two receive buffers (the parameters in use, the next) and two send buffers
    (one may still be in flight). NumPy + float32: computed straight from the receive buffer and
    into the send buffer."""

    def __init__(self, ctx: Context, start: TrainState):
        be = ctx.backend
        self.ctx, self.be, self.comm = ctx, be, ctx.comm
        n = ctx.model.n_params
        self.servers = list(ctx.layout.server_ranks)
        self.slices = slices = ctx.layout.shard_slices(n)
        # How each server's slice travels (--num-ps K: K ways, each of its slice), each way one of two buffers:
        # a gradient or the parameters as they are, one flat message a part per server; else (--compress
        # int8|int4, --sparsify) a message of its own per server, each with its error feedback.
        self.pushes = [Pushes(ctx.cfg, s.stop - s.start, be) for s in slices]
        self.replies = [Replies(ctx.cfg, s.stop - s.start, be) for s in slices]  # with --compress-replies: changes
        self.inbox, self.inparts, self.in_bytes = self._buffers(self.replies, n, False)  # the parameters now / next
        self.outbox, self.outparts, self.out_bytes = self._buffers(self.pushes, n, True)  # one may be in flight
        self.peers = self.servers + self.servers  # of reqs: a receive from each server, then a send to each
        self.zero_copy = self.inbox is not None and be.mirror(self.inbox[0].payload) is self.inbox[0].payload
        if self.zero_copy:
            self.inbox[0].payload[:] = start.params
            self.params = self.inbox[0].payload
        else:  # its own array, which each reply overwrites (or, compressed, adds to)
            self.params = be.asarray(np.array(start.params, np.float32))
        # computed into the flat message itself where it can be; else into an array each push compresses from
        self.grads = ([self.pushes[0].gradient(m.payload) for m in self.outbox] if self.outbox is not None
                      else [be.xp.zeros(n, be.xp.float32) for _ in range(2)])
        self.cur = 0  # which inbox holds the parameters in use
        self.versions = [start.global_step] * len(self.servers)  # each server's step of those parameters
        self.poller = Poller(WORKER_POLL_S, ctx.watch)
        self.reqs: list = []  # the exchange in flight: a receive from each server, then a send to each
        self.failed = None  # what `progress` found failed in it (transport.Completed)
        self.diverged_at: int | None = None
        self.lent = None
        self.mark = first_mark(ctx, start)
        self.kill_at = push_kill(ctx.rank)  # MPITRAIN_INJECT_KILL=RANK:STEP:parted

    def _buffers(self, ways: list, n: int, sending: bool) -> tuple[list | None, list[list], int]:
        """Two buffers of a way (pushes or replies): (the flat messages or None, each buffer's message per server,
        the bytes one buffer moves through MPI)."""
        alloc = self.be.host_alloc
        if ways[0].scheme is None:
            flat = [Message(n, alloc, ways[0].dtype) for _ in range(2)]
            return flat, [m.shard_parts(self.slices, sending) for m in flat], flat[0].buf.nbytes
        own = [[Message(w.count, alloc, w.dtype) for w in ways] for _ in range(2)]
        return None, own, sum(m.buf.nbytes for m in own[0])

    @property
    def in_flight(self) -> bool:
        return bool(self.reqs)

    def gradient(self, slot: int):
        return self.grads[slot]

    def push(self, slot: int, loss: float, versions: list[int], count: int, last: bool, lease=None) -> None:
        """Send the gradient of `slot` to every server and post the receives of their answers."""
        grad = self.grads[slot]
        if self.outbox is not None:  # the flat message: the gradient is in it (or written there whole)
            self.pushes[0].write(grad, self.outbox[slot].payload)
        else:
            for way, part, s in zip(self.pushes, self.outparts[slot], self.slices):
                way.write(grad[s], part.payload)
        for part, version in zip(self.outparts[slot], versions):
            part.refresh()
            part.stamp(TAG_GRAD, version, count, FLAG_LAST if last else 0, loss, lease=lease)
        self.ctx.activity.moved(sent=self.out_bytes)
        comm, nxt = self.comm, self.inparts[1 - self.cur]
        if self.kill_at == (count, "parted") and len(self.servers) > 1:  # sent to the others, then killed
            others = list(zip(self.outparts[slot], self.servers))[1:]
            sends = [comm.Isend(part.spec(), dest=rank, tag=TAG_GRAD) for part, rank in others]
            self.poller.all(sends, self.servers[1:])
            kill_here()
        self.reqs = ([comm.Irecv(part.spec(), source=rank, tag=TAG_PARAMS) for part, rank in zip(nxt, self.servers)]
                     + [comm.Isend(part.spec(), dest=rank, tag=TAG_GRAD)
                        for part, rank in zip(self.outparts[slot], self.servers)])

    def progress(self) -> None:
        """One look at the exchange in flight, no wait (--local-steps with --overlap: once an inner step). MPICH
        moves a message only inside an MPI call, and a gradient of a few hundred KB goes by rendezvous: without a
        look, its transfer would wait for the pull. A request that failed is kept for `pull`, which raises it."""
        if self.reqs and self.failed is None:
            done = self.poller.test(self.reqs)
            if done is not None and done.failed:
                self.failed = done

    def pull(self, count: int) -> bool:
        """Wait for the exchange in flight; make its answers the current parameters. True when a
        server stopped this worker (the others, still waiting for its next gradient, are told)."""
        if self.failed is not None:  # found by `progress` (MPICH frees a failed Testsome's requests: now null)
            self.poller.lost(self.failed, self.peers)
        self.poller.all(self.reqs, self.peers)
        self.reqs = []
        nxt = 1 - self.cur
        self.ctx.activity.moved(received=self.in_bytes)
        for part, rank in zip(self.inparts[nxt], self.servers):
            part.check(TAG_PARAMS, rank)
        self.cur = nxt
        if self.zero_copy:
            self.params = self.inbox[nxt].payload
        else:
            for way, part, s in zip(self.replies, self.inparts[nxt], self.slices):
                way.read(part.payload, self.params[s])
        parts = self.inparts[nxt]
        self.versions = [part.step for part in parts]
        self.lent, self.mark = parts[0].lease, parts[0].mark  # rank 0's: it keeps the ledger
        if any(part.flags & FLAG_DIVERGED for part in parts):
            self.diverged_at = self.versions[0]
        stopped = [bool(part.flags & FLAG_FINAL) for part in parts]
        if any(stopped) and not all(stopped):
            self.leave(count, [rank for rank, stop in zip(self.servers, stopped) if not stop])
        return any(stopped)

    def leave(self, count: int, ranks: list[int] | None = None) -> None:
        """This worker stops (another server stopped it, or it has nothing to train): these servers
        (all by default), still waiting for its next gradient, get a header-only goodbye instead."""
        ranks = self.servers if ranks is None else ranks
        bye = Message(0)
        bye.stamp(TAG_GRAD, self.versions[0], count, FLAG_LEAVING)
        self.poller.all([self.comm.Isend(bye.spec(), dest=rank, tag=TAG_GRAD) for rank in ranks], ranks)

    def held(self) -> TrainState:
        return held_copy(self)

    def close(self) -> None:
        for part in self.inparts[0] + self.inparts[1] + self.outparts[0] + self.outparts[1]:
            part.free()
