"""Ranks 1..N-1: compute gradients on a shard. Async push/pull, sync Allreduce step, local loop."""

from __future__ import annotations

import math
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from mpitrain.checkpoint import Checkpointer, TrainState, state_arrays, to_flat
from mpitrain.codec import wire_sum
from mpitrain.data import epoch_batches
from mpitrain.faults import Kill, injected_step
from mpitrain.guard import NON_FINITE, LossGuard
from mpitrain.optim import Optimizer, make_ema
from mpitrain.protocol import (FLAG_CKPT, FLAG_DIVERGED, FLAG_EVAL, FLAG_LAST, FLAG_STOP, TAG_DECISION, TAG_GRAD, TAG_PARAMS, TAG_READY,
                               TAG_STATUS, Message, ProtocolError)
from mpitrain.liveness import CHECK_EVERY_S as VERDICT_POLL_S
from mpitrain.liveness import PeerLost
from mpitrain.observe import ALLREDUCE, APPLY, COMPUTE, PULL, PUSH, WAIT
from mpitrain.runtime import PS_RANK, Context, start_state
from mpitrain.shards import cut
from mpitrain.transport import WORKER_POLL_S, Poller, collective_poll_s, tested
from mpitrain.waiting import poll

STATUS_EVERY_S = 0.2  # sync chief -> PS progress reports; off the hot path
LOSS_WINDOW = 20  # final_loss: mean minibatch loss of the last LOSS_WINDOW global steps
SWITCH_INTERVAL_S = 1e-4  # --quorum: GIL hand-over between the MPI thread and the compute thread


@dataclass
class WorkerResult:
    """What a worker's training loop hands back, async or sync (and the local run's sync loop)."""

    pushed: int  # gradients computed and sent (sync: local steps taken)
    params: np.ndarray  # host copy of the final parameters
    time: dict  # observe.Activity.times(): wall, compute and wait seconds
    dropped: int = 0  # gradients left out of every update (--quorum: late ones)
    contributed: int | None = None  # sync: gradients that went into updates
    recent_loss: float | None = None  # sync: mean minibatch loss of the last LOSS_WINDOW steps
    train_state: TrainState | None = None  # sync: what a checkpoint of the final step holds
    diverged: dict | None = None  # the non-finite or exploding loss that stopped the run, if any


class BatchStream:
    """This worker's minibatches, epoch after epoch, reshuffled each epoch from --seed.
    `budget` is the number of local steps allowed by --epochs (None: endless)."""

    def __init__(self, ctx: Context, taken: int = 0):
        cfg, be = ctx.cfg, ctx.backend
        self.ctx = ctx
        self.x = be.asarray(ctx.data.x_train)  # the whole train set lives on the device once
        self.y = be.asarray(ctx.data.y_train)
        self.spe = ctx.steps_per_epoch
        epochs = cfg.epochs_or_default
        self.budget = None if epochs is None else epochs * self.spe
        self.taken = taken  # batches already taken (a resumed run continues the same order)
        self._epoch_idx = None

    def next(self):
        ctx = self.ctx
        epoch, k = divmod(self.taken, self.spe)
        if k == 0 or self._epoch_idx is None:
            idx = epoch_batches(ctx.data.n_train, ctx.workers, ctx.worker_index, ctx.cfg.batch_size, epoch, ctx.cfg.seed)
            self._epoch_idx = ctx.backend.asarray(idx)
        self.taken += 1
        rows = self._epoch_idx[k]
        return self.x[rows], self.y[rows]

    @property
    def exhausted(self) -> bool:
        return self.budget is not None and self.taken >= self.budget


class Divergence:
    """A gradient is only usable when its loss and all its entries are finite. One BLAS dot
    product checks the entries (~1% of a step): NaN or inf anywhere makes it non-finite, and so do
    entries beyond ~1e19, which only a diverging run produces. A non-finite result is reported as
    a NaN loss, which stops training on every rank. MPITRAIN_INJECT_NAN (faults.py) makes a
    worker report NaN at a given local step."""

    def __init__(self, ctx: Context):
        self.xp = ctx.backend.xp
        self.inject_at = injected_step("MPITRAIN_INJECT_NAN", ctx.rank)
        self.steps = 0

    def check(self, loss: float, grad) -> float:
        self.steps += 1
        if self.steps == self.inject_at or not math.isfinite(loss) or not math.isfinite(float(self.xp.dot(grad, grad))):
            return float("nan")
        return loss


class AsyncWorker:
    """Pull/compute/push, shaped like server.AsyncServer: the buffers and counters are fields,
    one method per step of the exchange. With --overlap (default) the reply to push k is
    received while the gradient of step k+1 is computed, so a worker never idles on the round
    trip; each gradient is then computed on parameters one exchange older. --no-overlap waits for
    every reply. With --num-ps K each push and pull is K messages, one per server, each over its
    slice of the one flat buffer (protocol.Message.shard_parts: received in place; sent from a
    copy but for the first server's); the servers count their own versions, and a worker stops
    when any server stops it (telling the others it leaves)."""

    def __init__(self, ctx: Context):
        be = ctx.backend
        self.ctx, self.model, self.be, self.comm, self.act = ctx, ctx.model, be, ctx.comm, ctx.activity
        n, wire = ctx.model.n_params, ctx.cfg.wire_dtype
        self.overlap = ctx.cfg.effective_overlap
        self.servers = list(ctx.layout.server_ranks)
        slices = ctx.layout.shard_slices(n)
        inbox = [Message(n, be.host_alloc, wire), Message(n, be.host_alloc, wire)]  # current / next parameters
        outbox = [Message(n, be.host_alloc, wire), Message(n, be.host_alloc, wire)]  # alternating: one in flight
        self.inbox = inbox
        self.inparts = [m.shard_parts(slices) for m in inbox]  # [buffer][server]; with one server, the buffers
        self.outparts = [m.shard_parts(slices, sending=True) for m in outbox]
        self.outbox = outbox
        self.peers = self.servers + self.servers  # of reqs: a receive from each server, then a send to each
        # NumPy + float32: compute straight from the receive buffer and into the send buffer.
        self.zero_copy = be.mirror(inbox[0].payload) is inbox[0].payload
        start = start_state(ctx)
        if self.zero_copy:
            inbox[0].payload[:] = start.params
            self.params = inbox[0].payload
        else:
            self.params = be.asarray(start.params)
        self.grads = [be.mirror(m.payload) for m in outbox]
        self.cur = 0  # which inbox holds the parameters in use
        self.versions = [start.global_step] * len(self.servers)  # each server's step of those parameters
        self.batches = BatchStream(ctx, start.position(ctx.worker_index))
        self.poller = Poller(WORKER_POLL_S, ctx.watch)
        self.straggler, self.divergence, self.kill = Straggler(ctx), Divergence(ctx), Kill(ctx.rank)
        self.reqs: list = []  # the exchange in flight: a receive from each server, then a send to each
        self.pushed = 0
        self.sent_last = False
        self.diverged: dict = {}  # filled when a server stops the run because a loss diverged

    def run(self) -> WorkerResult:
        while True:
            if self.reqs and (not self.overlap or self.sent_last):
                if self._adopt_reply():
                    break
                if self.sent_last:
                    raise ProtocolError("the parameter server did not stop this worker after its last gradient")
            slot = self.pushed % 2
            loss, used_versions = self._compute(slot)
            if self.reqs and self._adopt_reply():
                break  # the gradient just computed is not pushed: training is over
            self._push(slot, loss, used_versions)
        for part in self.inparts[0] + self.inparts[1] + self.outparts[0] + self.outparts[1]:
            part.free()
        return WorkerResult(self.pushed, self.be.to_host(self.params).copy(), self.act.times(),
                            diverged=self.diverged or None)

    def _compute(self, slot: int) -> tuple[float, list[int]]:
        """The next minibatch's gradient into outbox `slot`; its loss and the versions it used."""
        self.act.enter(COMPUTE, self.versions[0])
        x, y = self.batches.next()
        t0 = time.perf_counter()
        used_versions = self.versions
        grad = self.grads[slot]
        loss = self.divergence.check(self.model.loss_and_grad(self.params, x, y, grad), grad)
        self.be.download(grad, self.outbox[slot].payload)
        self.straggler.pause(time.perf_counter() - t0)
        self.act.stepped()
        return loss, used_versions

    def _push(self, slot: int, loss: float, used_versions: list[int]) -> None:
        """Send the gradient in outbox `slot` to every server and post the receives of their replies."""
        last = self.batches.exhausted
        self.kill.at(self.pushed + 1)
        self.act.enter(PUSH)
        for part, version in zip(self.outparts[slot], used_versions):
            part.refresh()
            part.stamp(TAG_GRAD, version, self.pushed + 1, FLAG_LAST if last else 0, loss)
        comm, nxt = self.comm, self.inparts[1 - self.cur]
        self.reqs = ([comm.Irecv(part.spec(), source=rank, tag=TAG_PARAMS) for part, rank in zip(nxt, self.servers)]
                     + [comm.Isend(part.spec(), dest=rank, tag=TAG_GRAD)
                        for part, rank in zip(self.outparts[slot], self.servers)])
        self.pushed += 1
        self.sent_last = last

    def _adopt_reply(self) -> bool:
        """Wait for the exchange in flight; make its replies the current parameters. True when
        told to stop."""
        self.act.enter(PULL)
        self.poller.all(self.reqs, self.peers)
        self.reqs = []
        nxt = 1 - self.cur
        for part, rank in zip(self.inparts[nxt], self.servers):
            part.check(TAG_PARAMS, rank)
        self.cur = nxt
        if self.zero_copy:
            self.params = self.inbox[nxt].payload
        else:
            self.be.upload(self.params, self.inbox[nxt].payload)
        parts = self.inparts[nxt]
        self.versions = [part.step for part in parts]
        if any(part.flags & FLAG_DIVERGED for part in parts):
            self.diverged["global_step"] = self.versions[0]
        stopped = [bool(part.flags & FLAG_STOP) for part in parts]
        if any(stopped) and not all(stopped):
            self._leave([rank for rank, stop in zip(self.servers, stopped) if not stop])
        return any(stopped)

    def _leave(self, ranks: list[int]) -> None:
        """Another server stopped this worker (--steps reached there first): these ones, still
        waiting for its next gradient, get a header-only goodbye instead."""
        bye = Message(0)
        bye.stamp(TAG_GRAD, self.versions[0], self.pushed, FLAG_STOP)
        self.poller.all([self.comm.Isend(bye.spec(), dest=rank, tag=TAG_GRAD) for rank in ranks], ranks)


def run_async(ctx: Context) -> WorkerResult:
    return AsyncWorker(ctx).run()


class SyncStep:
    """One synchronous update: average the workers' gradients with Allreduce, then apply the same
    optimizer step on every worker, so replicas stay bitwise identical. The buffer is
    [gradient..., loss, weight]: the loss rides along so every worker knows the mean loss, and the
    weight (1, or 0 for a worker left out of a --quorum step) so the sum divides by the number of
    gradients actually in it."""

    def __init__(self, ctx: Context, params, start: TrainState | None = None):
        cfg, be, model = ctx.cfg, ctx.backend, ctx.model
        self.ctx, self.params = ctx, params
        n = model.n_params
        self.n = n
        self.buf = be.xp.zeros(n + 2, be.xp.float32)
        wire = np.dtype(cfg.wire_dtype)
        # What travels: the buffer itself (NumPy or CUDA-aware, float32), else a staged copy.
        self.wire = None
        if wire != np.float32 or (be.is_gpu and not be.cuda_aware):
            self.wire = be.host_alloc(wire.itemsize * (n + 2)).view(wire)
        self.mpi_type, self.op = wire_sum(cfg.compress)
        self.opt = Optimizer(cfg.optimizer, n, be.xp, momentum=cfg.momentum)
        self.ema = None
        self.own_loss = 0.0  # this worker's own minibatch loss in the step being reduced
        self.divergence = Divergence(ctx)
        self.guard = LossGuard(cfg.divergence_factor)  # on the mean loss: every worker decides alike
        self.why: str | None = None  # set when the step just reduced diverged (and was not applied)
        if start is not None:
            self.opt.restore(start.opt_t, start.opt_state)
            if ctx.worker_index == 0:  # the chief (or the local run) keeps the moving average
                self.ema = make_ema(cfg.ema_decay, params, be.xp, start.global_step, start.ema)
        self.comm = ctx.worker_comm
        self.activity = ctx.activity
        # Always nonblocking and watched: a blocking Allreduce cannot notice that rank 0 died (the
        # workers would wait for a peer that has already stopped). It spins, as MPICH's blocking
        # one does, unless ranks outnumber cores (--wait; transport.collective_poll_s).
        self.waiter = Poller(collective_poll_s(ctx.cfg.wait, ctx.node.oversubscribed), ctx.watch)

    def train_state(self, step: int) -> TrainState:
        """Host copies of what a checkpoint needs (plain sync: every worker is at `step`)."""
        def host(a):
            return None if a is None else np.array(self.ctx.backend.to_host(a), np.float32)

        return TrainState(host(self.params), step, self.opt.t, {k: host(a) for k, a in self.opt.state.items()},
                          [step] * self.ctx.workers, host(self.ema.avg) if self.ema else None)

    def compute(self, x, y) -> float:
        """This worker's gradient on the current parameters, weight 1."""
        grad = self.buf[: self.n]
        loss = self.divergence.check(self.ctx.model.loss_and_grad(self.params, x, y, grad), grad)
        self._weigh(loss)
        return loss

    def load(self, grad, loss: float) -> None:
        """A gradient computed elsewhere (the quorum helper thread), weight 1."""
        self.buf[: self.n] = grad
        self._weigh(loss)

    def _weigh(self, loss: float) -> None:
        self.own_loss = loss
        self.buf[self.n] = loss
        self.buf[self.n + 1] = 1.0

    def abstain(self) -> None:
        """Weight 0: join the collective without a gradient."""
        self.own_loss = 0.0
        self.buf[...] = 0.0

    def _allreduce(self, spec, op) -> None:
        done = self.waiter.some([self.comm.Iallreduce(MPI.IN_PLACE, spec, op=op)])
        if done.failed:
            await_verdict(self.ctx, done.failed[0])

    def reduce_and_apply(self, step: int) -> float:
        """Sum over workers, divide by the summed weight, apply; returns the mean loss."""
        ctx, be, buf = self.ctx, self.ctx.backend, self.buf
        if self.comm is not None and self.comm.Get_size() > 1:
            self.activity.enter(ALLREDUCE)
            if self.wire is not None:
                be.download(buf, self.wire)
                self._allreduce([self.wire, self.mpi_type], self.op)
                be.upload(buf, self.wire)
            else:
                be.download(buf, buf)  # NumPy: nothing; CUDA-aware: finish compute before MPI reads
                self._allreduce([buf, MPI.FLOAT], MPI.SUM)
            buf *= be.xp.float32(1.0) / buf[self.n + 1]
        self.activity.enter(APPLY)
        loss = float(buf[self.n])
        self.why = NON_FINITE if not math.isfinite(loss) else self.guard.exploded(loss)
        if self.why:
            return loss  # diverged: every worker sees the same mean, and none applies it
        self.opt.step(self.params, buf[: self.n], ctx.lr_at(step))
        if self.ema:
            self.ema.update(self.params)
        return loss


def train_sync(ctx: Context, start: TrainState, on_step=None) -> WorkerResult:
    """The sync loop shared by sync workers and the local (one-process) run, from global step
    `start.global_step` (a resumed run) to the budget. `on_step(step, loss, sync_step)` reports
    each step: to rank 0 (chief worker) or to the bar and checkpoints (local)."""
    if ctx.with_quorum:
        return train_sync_quorum(ctx, start, on_step)
    be = ctx.backend
    params = be.asarray(start.params)
    step_fn = SyncStep(ctx, params, start)
    batches = BatchStream(ctx, start.position(ctx.worker_index))
    straggler, kill, act = Straggler(ctx), Kill(ctx.rank), ctx.activity
    total = ctx.global_step_budget
    recent = deque([float("nan")], maxlen=LOSS_WINDOW)  # nan only if resumed at the budget
    for step in range(start.global_step, total):
        act.enter(COMPUTE, step)
        kill.at(step - start.global_step + 1)
        x, y = batches.next()
        t0 = time.perf_counter()
        step_fn.compute(x, y)
        straggler.pause(time.perf_counter() - t0)
        act.stepped()
        loss = step_fn.reduce_and_apply(step)
        if step_fn.why:
            return _sync_result(step_fn, step, loss, act.times(), contributed=step)
        recent.append(loss)
        if on_step is not None:
            on_step(step + 1, loss, step_fn)
    done = max(total, start.global_step)
    return _sync_result(step_fn, done, _mean_loss(recent), act.times(), contributed=done)


def _sync_result(step_fn: SyncStep, step: int, loss: float, timing: dict, contributed: int,
                 dropped: int = 0) -> WorkerResult:
    """What a sync worker (or the local run) reports at global step `step`. When the step
    diverged (step_fn.why) update `step` was not applied: the state is the last good one, and
    whether this worker's own loss was the culprit goes to rank 0."""
    state = step_fn.train_state(step)  # host copies; its params are the result's params
    diverged = None
    if step_fn.why:
        diverged = {"global_step": step, "loss": loss, "why": step_fn.why,
                    "mine": not math.isfinite(step_fn.own_loss)}
    return WorkerResult(step, state.params, timing, dropped, contributed, loss, state, diverged)


def await_verdict(ctx: Context, why: str) -> None:
    """The gradient Allreduce failed: a worker died in the middle of it. Rank 0 notices within
    --worker-timeout and ends the job naming that worker (sync cannot go on without it); a worker
    that stopped here on its own would be taken for a second lost one. So wait for rank 0, still
    watching it: if it is gone too, PeerLost ends this rank."""
    if not ctx.watch.watched:  # --worker-timeout 0: nobody will decide
        raise PeerLost({PS_RANK: f"the gradient Allreduce failed ({why}) and --worker-timeout is 0"})
    poll(lambda: False, VERDICT_POLL_S, ctx.watch)  # ends in PeerLost (rank 0's Abort ends this process first)


def _mean_loss(recent: deque) -> float:
    values = [v for v in recent if v == v]  # drop the nan placeholder
    return float(np.mean(values)) if values else float("nan")


class GradientThread:
    """--quorum: computes gradients off the main thread, so the main thread can join every step's
    collectives (with zero weight when it has nothing fresh) while a slow gradient is still being
    computed. It works on its own snapshot of the parameters; the main thread owns all MPI calls."""

    def __init__(self, ctx: Context, taken: int = 0):
        be, n = ctx.backend, ctx.model.n_params
        self.ctx = ctx
        self.snapshot = be.xp.empty(n, be.xp.float32)
        self.grad = be.xp.empty(n, be.xp.float32)
        self.batches = BatchStream(ctx, taken)
        self.straggler = Straggler(ctx)
        self.divergence = Divergence(ctx)
        self.version: int | None = None  # None: idle; else the step its parameters belong to
        self.loss = float("nan")
        self.error: BaseException | None = None
        self._go, self._done, self._quit = threading.Event(), threading.Event(), False
        self._thread = threading.Thread(target=self._run, name="mpitrain-gradient", daemon=True)
        self._thread.start()

    def start(self, params, version: int) -> None:
        self.snapshot[...] = params
        self.version = version
        self._done.clear()
        self._go.set()

    @property
    def idle(self) -> bool:
        return self.version is None

    @property
    def finished(self) -> bool:
        if self.error is not None:
            raise RuntimeError("the gradient thread failed") from self.error
        return self.version is not None and self._done.is_set()

    def discard(self) -> None:
        self.version = None

    def close(self) -> None:
        self._done.wait()  # a gradient still being computed at the end is simply not used
        self._quit = True
        self._go.set()
        self._thread.join()

    def _run(self) -> None:
        be = self.ctx.backend
        if be.is_gpu:
            be.cp.cuda.Device(be.device_id).use()  # CuPy's current device is per thread
        self._done.set()
        while True:
            self._go.wait()
            self._go.clear()
            if self._quit:
                return
            try:
                x, y = self.batches.next()
                t0 = time.perf_counter()
                self.loss = self.divergence.check(self.ctx.model.loss_and_grad(self.snapshot, x, y, self.grad), self.grad)
                self.straggler.pause(time.perf_counter() - t0)
                self.ctx.activity.helper_computed(t0, time.perf_counter(), self.version)
            except BaseException as e:  # surfaced on the main thread by `finished`
                self.error = e
            self._done.set()


class ChiefDecider:
    """--quorum, on the chief worker: the step's decider. The other workers' READYs for the
    current step, and the chief's own gradient, are counted in the order they are seen; the first
    Q make the step's DECISION (one weight per worker), sent to every other worker. READYs for a
    step already decided are late: ignored here (their worker counts its dropped gradient)."""

    def __init__(self, ctx: Context, poller: Poller):
        self.ctx, self.Q, self.poller = ctx, ctx.cfg.quorum, poller
        self.others = list(ctx.layout.worker_ranks[1:])
        self.inbox = [Message(0) for _ in self.others]
        self.recv = [ctx.comm.Irecv(m.spec(), source=r, tag=TAG_READY) for m, r in zip(self.inbox, self.others)]
        self.sends: list = []
        self.decision = Message(ctx.workers)
        self.step = 0
        self.chosen: list[int] = []  # worker indices, in the order their gradients were seen ready
        self.stopped = 0  # other workers whose last READY (FLAG_STOP) came in

    def begin(self, step: int) -> None:
        self.step, self.chosen = step, []

    def ready(self, loss: float) -> None:
        """The chief's own gradient for the current step is ready."""
        self._choose(0)

    def decided(self) -> bool:
        """Take in the READYs that came; once Q gradients are ready, tell every other worker."""
        self._take_readies()
        if len(self.chosen) < self.Q:
            return False
        self._sent()  # the previous step's (tiny, eager: long gone) before its buffer is rewritten
        self.decision.payload[:] = 0.0
        self.decision.payload[self.chosen] = 1.0
        self.decision.stamp(TAG_DECISION, self.step)
        self.sends = [self.ctx.comm.Isend(self.decision.spec(), dest=r, tag=TAG_DECISION) for r in self.others]
        return True

    def close(self) -> None:
        """After the last step: every other worker says it is done (its last READY), so no
        receive is left posted."""
        self._sent()
        poll(lambda: self._take_readies() or self.stopped == len(self.others), WORKER_POLL_S, self.ctx.watch)

    def _choose(self, w: int) -> None:
        if len(self.chosen) < self.Q and w not in self.chosen:
            self.chosen.append(w)

    def _take_readies(self) -> None:
        for i, (msg, rank) in enumerate(zip(self.inbox, self.others)):
            while self.recv[i] and between_workers(self.ctx, lambda: tested(self.recv[i], rank)):
                msg.check(TAG_READY, rank)
                if msg.flags & FLAG_STOP:
                    self.stopped += 1  # that worker sends nothing more: its receive is not re-posted
                    break
                if msg.step == self.step:
                    self._choose(i + 1)
                self.recv[i] = self.ctx.comm.Irecv(msg.spec(), source=rank, tag=TAG_READY)

    def _sent(self) -> None:
        between_workers(self.ctx, lambda: self.poller.all(self.sends, self.others))


class ChiefFollower:
    """--quorum, on every worker but the chief: READY to the chief when this worker's gradient for
    the step is ready, then the chief's DECISION."""

    def __init__(self, ctx: Context, poller: Poller):
        self.ctx, self.poller = ctx, poller
        self.chief = ctx.layout.worker_rank(0)
        self.msg, self.decision = Message(0), Message(ctx.workers)
        self.sent = self.pending = MPI.REQUEST_NULL
        self.step = 0

    def begin(self, step: int) -> None:
        self.step = step
        self.pending = self.ctx.comm.Irecv(self.decision.spec(), source=self.chief, tag=TAG_DECISION)

    def ready(self, loss: float) -> None:
        self._say(self.step, 0, loss)

    def decided(self) -> bool:
        if not between_workers(self.ctx, lambda: tested(self.pending, self.chief)):
            return False
        self.decision.check(TAG_DECISION, self.chief, count=self.ctx.workers)
        if self.decision.step != self.step:
            raise ProtocolError(f"the chief decided step {self.decision.step} while this worker is at step {self.step}")
        return True

    def close(self) -> None:
        self._say(self.step, FLAG_STOP, 0.0)  # no more READY from this worker
        between_workers(self.ctx, lambda: self.poller.all([self.sent], [self.chief]))

    def _say(self, step: int, flags: int, loss: float) -> None:
        between_workers(self.ctx, lambda: self.poller.all([self.sent], [self.chief]))  # tiny, eager: long gone
        self.msg.stamp(TAG_READY, step, 0, flags, loss)
        self.sent = self.ctx.comm.Isend(self.msg.spec(), dest=self.chief, tag=TAG_READY)


def between_workers(ctx: Context, call):
    """Run `call` (an MPI wait or test between workers). A message to or from a worker that failed
    is the lost worker's case, which rank 0 judges (await_verdict); rank 0 lost raises on."""
    try:
        return call()
    except PeerLost as e:
        if PS_RANK in e.lost:
            raise
        await_verdict(ctx, next(iter(e.lost.values())))


class QuorumLoop:
    """Sync with --quorum Q < workers. Per step: the helper computes on the current parameters;
    when done, the main thread says READY to the chief worker (the chief counts its own); the chief
    answers every worker with the step's DECISION, the weights of the first Q ready workers;
    everyone joins the Allreduce, with zero weight if not chosen. A gradient that was not chosen,
    or finishes after its step closed, is dropped and counted; the helper then starts again from
    the current parameters. Rank 0 is not in the loop: it follows the chief's status, as in plain
    sync, and ends the run if a worker is lost."""

    def __init__(self, ctx: Context, start: TrainState, on_step=None):
        self.ctx, self.start, self.on_step = ctx, start, on_step
        self.params = ctx.backend.asarray(start.params)
        self.step_fn = SyncStep(ctx, self.params, start)
        self.helper = GradientThread(ctx, start.position(ctx.worker_index))
        poller = Poller(WORKER_POLL_S, ctx.watch)
        self.decider = ChiefDecider(ctx, poller) if ctx.worker_index == 0 else ChiefFollower(ctx, poller)
        self.dropped = self.contributed = 0
        self.step = start.global_step  # the step being decided
        self.reported = False  # READY said for it

    def run(self) -> WorkerResult:
        ctx, step_fn, helper = self.ctx, self.step_fn, self.helper
        # The main thread polls MPI between short sleeps; by default CPython lets the compute
        # thread keep the GIL for 5 ms before handing it back, which would make every step wait.
        switch = sys.getswitchinterval()
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        total = ctx.global_step_budget
        recent = deque([float("nan")], maxlen=LOSS_WINDOW)
        diverged = None
        for step in range(self.start.global_step, total):
            self._await_decision(step)
            if self.decider.decision.payload[ctx.worker_index] > 0:
                step_fn.load(helper.grad, helper.loss)  # only READY workers are chosen: it is finished
                helper.discard()
                self.contributed += 1
            else:
                step_fn.abstain()
                if helper.finished and helper.version == step:
                    self.dropped += 1  # ready, but after Q others
                    helper.discard()
            loss = step_fn.reduce_and_apply(step)
            if step_fn.why:
                diverged = step
                break
            recent.append(loss)
            if self.on_step is not None:
                self.on_step(step + 1, loss, step_fn)
        helper.close()
        sys.setswitchinterval(switch)
        self.decider.close()
        timing = ctx.activity.times()
        if diverged is not None:
            return _sync_result(step_fn, diverged, loss, timing, self.contributed, self.dropped)
        return _sync_result(step_fn, max(total, self.start.global_step), _mean_loss(recent), timing,
                            self.contributed, self.dropped)

    def _await_decision(self, step: int) -> None:
        """Keep the helper busy and say READY when its gradient for `step` is done, until the
        step is decided."""
        self.step, self.reported = step, False
        self.decider.begin(step)
        self.ctx.activity.enter(WAIT, step)
        poll(self._decided, WORKER_POLL_S, self.ctx.watch)

    def _decided(self) -> bool:
        helper, step = self.helper, self.step
        while not self.decider.decided():
            if helper.idle:
                helper.start(self.params, step)
            elif helper.finished and not self.reported:
                if helper.version != step:  # computed on parameters of a step that closed without it
                    self.dropped += 1
                    helper.discard()
                    continue  # look again at once, then start the helper on the current parameters
                self.decider.ready(helper.loss)
                self.reported = True
                continue  # the chief's own gradient may complete the quorum at once
            return False
        return True


def train_sync_quorum(ctx: Context, start: TrainState, on_step=None) -> WorkerResult:
    return QuorumLoop(ctx, start, on_step).run()


def run_sync(ctx: Context) -> WorkerResult:
    """A sync worker. The first worker (the chief) also keeps rank 0 informed, all on one tag so
    the messages arrive in order: a header-only status every STATUS_EVERY_S; its parameters and
    optimizer state at --eval-every and checkpoint steps; the same, flagged STOP, at the end.
    With --num-ps K the state goes to the K servers, each its slice (shards.py)."""
    start = start_state(ctx)
    if ctx.worker_index != 0:
        return train_sync(ctx, start)
    n = ctx.model.n_params
    names = state_arrays(ctx.cfg)
    servers = list(ctx.layout.server_ranks)
    slices = ctx.layout.shard_slices(n)
    status = Message(0)
    fulls = [Message((s.stop - s.start) * len(names)) for s in slices]  # one per server
    pending = [MPI.REQUEST_NULL] * (1 + len(servers))  # one status, one full message per server in flight at most
    last_sent = [0.0]
    ckpt = Checkpointer(ctx.cfg, ctx.fingerprint)  # only decides when; rank 0 writes
    waiter = Poller(WORKER_POLL_S, ctx.watch)  # a full message waits for its server: never a dead one

    def send_full(state: TrainState, flags: int, loss: float) -> None:
        ctx.activity.enter(PUSH)
        waiter.all(pending[1:], servers)
        flat = to_flat(state, names)
        for k, (full, s, rank) in enumerate(zip(fulls, slices, servers), 1):
            cut(flat, names, n, s, full.payload)
            full.stamp(TAG_STATUS, state.global_step, state.global_step, flags, loss)
            pending[k] = ctx.comm.Isend(full.spec(), dest=rank, tag=TAG_STATUS)

    def report(step: int, loss: float, sync_step: SyncStep) -> None:
        flags = (FLAG_EVAL if ctx.eval_due(step) else 0) | (FLAG_CKPT if ckpt.due(step) else 0)
        if flags:
            if flags & FLAG_CKPT:
                ckpt.mark(step)
            send_full(sync_step.train_state(step), flags, loss)
            return
        now = time.perf_counter()
        if now - last_sent[0] < STATUS_EVERY_S or not tested(pending[0], PS_RANK, ctx.watch):
            return  # rate-limited, and never more than one status in flight
        status.stamp(TAG_STATUS, step, step, 0, loss)
        pending[0] = ctx.comm.Isend(status.spec(), dest=PS_RANK, tag=TAG_STATUS)
        last_sent[0] = now

    result = train_sync(ctx, start, report)
    send_full(result.train_state, FLAG_STOP | (FLAG_DIVERGED if result.diverged else 0), result.recent_loss)
    waiter.all(pending, [PS_RANK] + servers)
    return result


class Straggler:
    """--straggler RANK:SECONDS / RANK:xFACTOR for this rank: sleep after each gradient."""

    def __init__(self, ctx: Context):
        specs = [(kind, value) for rank, kind, value in ctx.cfg.stragglers if rank == ctx.rank and not ctx.local]
        self.delay = sum(v for k, v in specs if k == "delay")
        self.factor = 1.0
        for k, v in specs:
            if k == "factor":
                self.factor *= v

    def pause(self, compute_s: float) -> None:
        extra = self.delay + (self.factor - 1.0) * compute_s
        if extra > 0:
            time.sleep(extra)
