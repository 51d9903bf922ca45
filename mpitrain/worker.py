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
from mpitrain.codec import encode, wire_sum
from mpitrain.data import epoch_batches
from mpitrain.faults import Kill, injected_step
from mpitrain.guard import NON_FINITE, LossGuard
from mpitrain.optim import Optimizer, make_ema
from mpitrain.protocol import (FLAG_CKPT, FLAG_DIVERGED, FLAG_EVAL, FLAG_LAST, FLAG_STOP, FLAG_STOP_STEP, TAG_GRAD,
                               TAG_PARAMS, TAG_QGRAD, TAG_STATUS, TAG_UPDATE, Message, ProtocolError)
from mpitrain.liveness import CHECK_EVERY_S as VERDICT_POLL_S
from mpitrain.liveness import PeerLost
from mpitrain.observe import ALLREDUCE, APPLY, COMPUTE, PULL, PUSH, WAIT
from mpitrain.runtime import PS_RANK, Context, start_state
from mpitrain.shards import cut
from mpitrain.stopping import STOP
from mpitrain.transport import WORKER_POLL_S, Poller, collective_poll_s, tested
from mpitrain.waiting import poll

SYNC_SLOTS = 3  # behind a sync step's gradient: loss, weight, stop vote (SyncStep)
STATUS_EVERY_S = 0.2  # sync chief -> PS progress reports; off the hot path
LOSS_WINDOW = 20  # final_loss: mean minibatch loss of the last LOSS_WINDOW global steps
SWITCH_INTERVAL_S = 1e-4  # --quorum: GIL hand-over between the MPI thread and the compute thread
# --quorum: updates the chief keeps for a worker still computing before it waits for it, and the
# memory they may take (a worker that far behind is a straggler at 32x: waiting costs little then).
UPDATES_IN_FLIGHT = 32
UPDATES_IN_FLIGHT_BYTES = 256 << 20
# --quorum: the chief computes its own gradients on its main thread while they take at most
# PACE_SLACK times as long as the Q-th fastest other worker's (ChiefPace). Not less: the chief's
# gradients measure slower than the others' even in plain sync (digits, 2 cores: 1.4-1.6x), and so
# do those of its thread when it is not slow (0.8-1.45x), while a straggler worth a thread is
# slower than that. One preempted step is not a slow chief either: it moves after PACE_RUN
# gradients in a row said so, and each other worker's time is the lower median of its last
# PACE_WINDOW pushes.
PACE_SLACK = 2.0
PACE_RUN, PACE_WINDOW = 3, 5


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
        # Resumed with its own epochs done (the others' are not): a gradient now would train past
        # the budget, so it leaves at once.
        running = not self.batches.exhausted
        if not running:
            self._leave(self.servers)
        while running:
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
    [gradient..., loss, weight, stop]: the loss rides along so every worker knows the mean loss, the
    weight (1 from each worker) so the sum divides by the number of gradients in it, and the stop
    vote (1 from a worker that knows of a stop request) so that every worker stops after the same
    step (`stop`). --quorum sums its gradients on the chief worker instead (QuorumChief) and every
    worker `apply`s the mean."""

    def __init__(self, ctx: Context, params, start: TrainState | None = None):
        cfg, be, model = ctx.cfg, ctx.backend, ctx.model
        self.ctx, self.params = ctx, params
        n = model.n_params
        self.n = n
        self.buf = be.xp.zeros(n + SYNC_SLOTS, be.xp.float32)
        wire = np.dtype(cfg.wire_dtype)
        # What travels: the buffer itself (NumPy or CUDA-aware, float32), else a staged copy.
        self.wire = None
        if wire != np.float32 or (be.is_gpu and not be.cuda_aware):
            self.wire = be.host_alloc(wire.itemsize * (n + SYNC_SLOTS)).view(wire)
        self.mpi_type, self.op = wire_sum(cfg.compress)
        self.opt = Optimizer(cfg.optimizer, n, be.xp, momentum=cfg.momentum)
        self.ema = None
        self.own_loss = 0.0  # this worker's own minibatch loss in the step being reduced
        self.divergence = Divergence(ctx)
        self.guard = LossGuard(cfg.divergence_factor)  # on the mean loss: every worker decides alike
        self.why: str | None = None  # set when the step just reduced diverged (and was not applied)
        self.stop = False  # set when the step just reduced is the last: a stop was requested (stopping.py)
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

    def _weigh(self, loss: float) -> None:
        self.own_loss = loss
        self.buf[self.n] = loss
        self.buf[self.n + 1] = 1.0
        self.buf[self.n + 2] = 1.0 if STOP.requested else 0.0

    def _allreduce(self, spec, op) -> None:
        done = self.waiter.some([self.comm.Iallreduce(MPI.IN_PLACE, spec, op=op)])
        if done.failed:
            await_verdict(self.ctx, done.failed[0])

    def reduce_and_apply(self, step: int) -> float:
        """Sum over workers, divide by the summed weight, apply; returns the mean loss."""
        be, buf = self.ctx.backend, self.buf
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
        self.stop = bool(buf[self.n + 2] > 0)  # the same sum on every worker: all stop after this step
        if self.stop:
            STOP.request()
        return self.apply(step)

    def apply(self, step: int) -> float:
        """Apply the mean gradient in buf (mean loss behind it) as update `step`, unless that loss
        says the run diverged (`why`); returns the mean loss."""
        ctx, buf = self.ctx, self.buf
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
    done = max(total, start.global_step)
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
        if step_fn.stop:
            done = step + 1
            break
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
    """--quorum, on the chief when it is the slow one (ChiefPace): computes its gradients off the
    main thread, so the main thread keeps gathering the others' while a slow gradient of its own
    is still being computed. It works on its own snapshot of the parameters; the main thread owns
    all MPI calls."""

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
        self.seconds = 0.0  # how long the last gradient took (ChiefPace)
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
                self.loss, t0 = self.compute(self.snapshot)
                self.ctx.activity.helper_computed(t0, t0 + self.seconds, self.version)
            except BaseException as e:  # surfaced on the main thread by `finished`
                self.error = e
            self._done.set()

    def compute(self, params) -> tuple[float, float]:
        """The next batch's gradient on `params` into `grad` (the straggler's pause included), on
        this thread, or on the main thread while this one is idle (ChiefPace). Its loss and when it
        started; `seconds` says how long it took."""
        x, y = self.batches.next()
        t0 = time.perf_counter()
        loss = self.divergence.check(self.ctx.model.loss_and_grad(params, x, y, self.grad), self.grad)
        self.straggler.pause(time.perf_counter() - t0)
        self.seconds = time.perf_counter() - t0
        return loss, t0


class QuorumUpdate:
    """--quorum, chief -> every other worker: one step's update. The payload is the averaged
    gradient, which every worker applies with its own optimizer (replicas stay bitwise identical),
    then one weight per worker, 1 if its gradient is in the average; the mean loss rides in the
    header. Wire-typed like every gradient (--compress), weights included (0 and 1 are exact)."""

    def __init__(self, ctx: Context):
        be, n = ctx.backend, ctx.model.n_params
        self.msg = Message(n + ctx.workers, be.host_alloc, ctx.cfg.wire_dtype)
        self.gradient, self.weights = self.msg.payload[:n], self.msg.payload[n:]
        self.xp = np if isinstance(self.msg.payload, np.ndarray) else be.xp  # device memory with CUDA-aware MPI
        self.reqs: list = []  # its sends, one per other worker

    def weigh(self, chosen: list[int]) -> None:
        weights = np.zeros(len(self.weights), np.float32)
        weights[chosen] = 1.0
        encode(self.xp, self.xp.asarray(weights), self.weights)

    def chose(self, w: int) -> bool:
        return bool(self.weights[w] != 0)  # 0 is all-zero bits in every wire type


class UpdateRing:
    """--quorum, on the chief: each step's update goes to every other worker from a buffer of its
    own, free again once all its sends are done. A worker busy with a slow gradient receives the
    updates afterwards, in order; up to UPDATES_IN_FLIGHT wait for it (fewer for a big model),
    then the chief waits too."""

    def __init__(self, ctx: Context, peers: list[int], poller: Poller):
        self.ctx, self.peers, self.poller = ctx, peers, poller
        self.busy: deque[QuorumUpdate] = deque()
        self.free: list[QuorumUpdate] = [QuorumUpdate(ctx)]
        self.most = max(2, min(UPDATES_IN_FLIGHT, UPDATES_IN_FLIGHT_BYTES // self.free[0].msg.buf.nbytes))
        self.made = 1

    def take(self) -> QuorumUpdate:
        self._reap()
        if self.free:
            return self.free.pop()
        if self.made < self.most:
            self.made += 1
            return QuorumUpdate(self.ctx)
        oldest = self.busy.popleft()
        act = self.ctx.activity
        phase = act.phase
        act.enter(WAIT)  # on the workers that are behind, not on rank 0 (what a stall line says)
        between_workers(self.ctx, lambda: self.poller.all(oldest.reqs, self.peers))
        act.enter(phase)
        return oldest

    def send(self, update: QuorumUpdate) -> None:
        spec = update.msg.spec()
        update.reqs = [self.ctx.comm.Isend(spec, dest=r, tag=TAG_UPDATE) for r in self.peers]
        self.busy.append(update)

    def delivered(self) -> bool:
        self._reap()
        return not self.busy

    def _reap(self) -> None:
        def sent(u: QuorumUpdate) -> bool:
            return all(tested(r, p) for r, p in zip(u.reqs, self.peers))

        while self.busy and between_workers(self.ctx, lambda: sent(self.busy[0])):
            self.free.append(self.busy.popleft())


def between_workers(ctx: Context, call):
    """Run `call` (an MPI wait or test between workers). A message to or from a worker that failed
    is the lost worker's case, which rank 0 judges (await_verdict); rank 0 lost raises on."""
    try:
        return call()
    except PeerLost as e:
        if PS_RANK in e.lost:
            raise
        await_verdict(ctx, next(iter(e.lost.values())))


def arrived(ctx: Context, req, peer: int) -> bool:
    """Whether `req`, a message between workers, is complete (`tested`, through between_workers)."""
    return between_workers(ctx, lambda: tested(req, peer))


class ChiefPace:
    """--quorum, on the chief: where its own gradients are computed. On its main thread
    (`inline`) at first: no hand-over to a thread, and no polling beside the computation on the
    cores the other workers need; the pushes that came meanwhile count first. Once PACE_RUN
    gradients of its own in a row took more than PACE_SLACK times the Q-th fastest other
    worker's (each push says how long it took), on its gradient thread, so that a slow chief never
    holds a step up; back on its main thread once PACE_RUN in a row on the thread did not."""

    def __init__(self, others: int, quorum: int):
        self.quorum = quorum
        self.others = [deque(maxlen=PACE_WINDOW) for _ in range(others)]  # their compute times, seconds
        self.inline = True
        self.run = 0  # its gradients in a row that said it computes in the wrong place

    def heard(self, i: int, seconds: float) -> None:
        self.others[i].append(seconds)

    def computed(self, seconds: float) -> None:
        """One gradient of its own took `seconds`, inline or on the thread."""
        known = sorted(sorted(d)[(len(d) - 1) // 2] for d in self.others if d)  # lower medians
        if len(known) < self.quorum:
            return  # nothing to compare with yet
        slow = seconds > PACE_SLACK * known[self.quorum - 1]
        self.run = self.run + 1 if slow == self.inline else 0
        if self.run >= PACE_RUN:
            self.inline, self.run = not self.inline, 0


class QuorumChief:
    """Sync with --quorum Q < workers, on the chief worker (worker 0). Each step takes the first Q
    gradients computed on the current parameters, in the order it sees them: its own or another
    worker's, pushed to it. It averages them, sends the average to every other worker
    (UpdateRing: it never waits for a worker that is still computing) and applies it. It computes
    its own gradients on its main thread unless it is the slow one (ChiefPace); then on its
    gradient thread, while the main thread gathers, so a slow gradient of its own never holds a
    step up: it is dropped like any late one. Rank 0 is not in the loop: it follows the chief's
    status, as in plain sync, and ends the run if a worker is lost."""

    def __init__(self, ctx: Context, start: TrainState, on_step=None):
        be, n = ctx.backend, ctx.model.n_params
        self.ctx, self.start, self.on_step, self.n, self.Q = ctx, start, on_step, n, ctx.cfg.quorum
        self.params = be.asarray(start.params)
        self.step_fn = SyncStep(ctx, self.params, start)
        self.helper = GradientThread(ctx, start.position(ctx.worker_index))
        self.others = list(ctx.layout.worker_ranks[1:])
        wire = ctx.cfg.wire_dtype
        self.narrow = np.dtype(wire) != np.float32
        self.inbox = [Message(n, be.host_alloc, wire) for _ in self.others]
        self.landing = [be.mirror(m.payload) for m in self.inbox]  # float32 on the device; NumPy: the payload
        self.recv = [ctx.comm.Irecv(m.spec(), source=r, tag=TAG_QGRAD) for m, r in zip(self.inbox, self.others)]
        self.updates = UpdateRing(ctx, self.others, Poller(WORKER_POLL_S, ctx.watch))
        self.kill = Kill(ctx.rank)
        self.pace = ChiefPace(len(self.others), self.Q)
        self.chosen: list[int] = []  # worker indices whose gradients are in the current step's sum
        self.own_for: int | None = None  # the step of its last own gradient: one per step at most
        self.own_loss = 0.0
        self.dropped = self.contributed = self.stopped = 0

    def run(self) -> WorkerResult:
        ctx, step_fn = self.ctx, self.step_fn
        # The main thread polls MPI between short sleeps; by default CPython lets the compute
        # thread keep the GIL for 5 ms before handing it back, which would make every step wait.
        switch = sys.getswitchinterval()
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        total = ctx.global_step_budget
        recent = deque([float("nan")], maxlen=LOSS_WINDOW)
        diverged, loss = None, float("nan")
        for step in range(self.start.global_step, total):
            self.kill.at(step - self.start.global_step + 1)
            self.chosen = []
            ctx.activity.enter(WAIT, step)
            poll(lambda: self._gathered(step), WORKER_POLL_S, ctx.watch)
            last = STOP.requested  # a stop request: this update is the last, and says so
            loss = self._update(step, FLAG_STOP_STEP if last else 0)
            if step_fn.why:
                diverged = step
                break
            recent.append(loss)
            if self.on_step is not None:
                self.on_step(step + 1, loss, step_fn)
            if last:
                total = step + 1
                break
        self.helper.close()
        sys.setswitchinterval(switch)
        ctx.activity.enter(WAIT)
        poll(self._closed, WORKER_POLL_S, ctx.watch)
        timing = ctx.activity.times()
        if diverged is not None:
            return _sync_result(step_fn, diverged, loss, timing, self.contributed, self.dropped)
        return _sync_result(step_fn, max(total, self.start.global_step), _mean_loss(recent), timing,
                            self.contributed, self.dropped)

    def _gathered(self, step: int) -> bool:
        """Take in what is ready for `step`; compute its own gradient, or start it on the thread,
        if the step still needs one. True once Q are in."""
        helper = self.helper
        if helper.finished:
            self.pace.computed(helper.seconds)
            if helper.version == step:
                self._add(0, helper.grad, helper.loss)
            else:
                self.dropped += 1  # computed on parameters of a step that closed without it
            helper.discard()
        self._take_pushes(step)
        if len(self.chosen) >= self.Q:
            return True
        if helper.idle and self.own_for != step:
            self.own_for = step
            if self.pace.inline:
                return self._compute_inline(step)
            helper.start(self.params, step)
        return False

    def _take_pushes(self, step: int) -> None:
        for i, rank in enumerate(self.others):
            if len(self.chosen) < self.Q and self.recv[i] and arrived(self.ctx, self.recv[i], rank):
                self._receive(i, step)

    def _compute_inline(self, step: int) -> bool:
        """Its own gradient for `step`, on the main thread (in the gradient thread's buffer: the
        thread is idle). The pushes that came meanwhile were first. True once Q are in."""
        helper, act = self.helper, self.ctx.activity
        act.enter(COMPUTE, step)
        loss, _ = helper.compute(self.params)
        act.stepped()
        act.enter(WAIT, step)
        self._take_pushes(step)
        self.pace.computed(helper.seconds)  # against what the pushes just taken say too
        if len(self.chosen) < self.Q:
            self._add(0, helper.grad, loss)
        else:
            self.dropped += 1  # in time, but after Q others
        return len(self.chosen) >= self.Q

    def _receive(self, i: int, step: int | None) -> None:
        """Worker i's message, while step `step` is being gathered (None: after the last one)."""
        msg, rank = self.inbox[i], self.others[i]
        msg.check(TAG_QGRAD, rank)
        if msg.flags & FLAG_STOP:
            self.stopped += 1  # that worker sends nothing more: its receive is not posted again
            return
        if step is not None and msg.step > step:
            raise ProtocolError(f"worker rank {rank} sent a gradient for step {msg.step} "
                                f"while the chief is at step {step}")
        self.pace.heard(i, msg.seconds)
        if msg.step == step and len(self.chosen) < self.Q:
            self.ctx.backend.upload(self.landing[i], msg.payload)
            self._add(i + 1, self.landing[i], msg.loss)
        # else late: its worker learns from the update that it was left out, and counts it
        self.recv[i] = self.ctx.comm.Irecv(msg.spec(), source=rank, tag=TAG_QGRAD)

    def _add(self, w: int, grad, loss: float) -> None:
        buf, n = self.step_fn.buf, self.n
        if w == 0:
            self.own_loss = loss
        if self.chosen:
            buf[:n] += grad
            buf[n] += loss
        else:
            buf[:n] = grad
            buf[n] = loss
        self.chosen.append(w)

    def _update(self, step: int, flags: int = 0) -> float:
        """Average the step's gradients, send the average to every other worker, apply it."""
        ctx, be, buf, n = self.ctx, self.ctx.backend, self.step_fn.buf, self.n
        ctx.activity.enter(PUSH)
        buf[: n + 1] *= be.xp.float32(1.0 / len(self.chosen))
        update = self.updates.take()
        be.download(buf[:n], update.gradient)
        if self.narrow:
            be.upload(buf[:n], update.gradient)  # apply what the others will: the wire's rounding included
        update.weigh(self.chosen)
        update.msg.stamp(TAG_UPDATE, step, len(self.chosen), flags, float(buf[n]))
        self.updates.send(update)
        own = 0 in self.chosen
        self.contributed += own
        self.step_fn.own_loss = self.own_loss if own else 0.0
        return self.step_fn.apply(step)

    def _closed(self) -> bool:
        """After the last step: every update delivered, and every other worker's last message
        (STOP) in, so that no receive is left posted."""
        for i, rank in enumerate(self.others):
            while self.recv[i] and arrived(self.ctx, self.recv[i], rank):
                self._receive(i, None)
        return self.stopped == len(self.others) and self.updates.delivered()


class QuorumFollower:
    """Sync with --quorum, on every worker but the chief: compute a gradient on the current
    parameters, push it to the chief unless the step already closed, and apply every update the
    chief sends, in order. One thread is enough: no collective waits for this worker, and the
    updates that come while it computes queue up until it takes them."""

    def __init__(self, ctx: Context, start: TrainState):
        be, n = ctx.backend, ctx.model.n_params
        self.ctx, self.start, self.n = ctx, start, n
        self.params = be.asarray(start.params)
        self.step_fn = SyncStep(ctx, self.params, start)
        self.chief = ctx.layout.worker_rank(0)
        # Two push buffers, alternating: a push the chief did not need may still be in flight when
        # the next gradient is computed. NumPy float32: computed straight into the message.
        self.outs = [Message(n, be.host_alloc, ctx.cfg.wire_dtype) for _ in range(2)]
        self.grads = [be.mirror(m.payload) for m in self.outs]
        self.sends = [MPI.REQUEST_NULL] * 2
        self.update = QuorumUpdate(ctx)
        self.batches = BatchStream(ctx, start.position(ctx.worker_index))
        self.straggler, self.divergence, self.kill = Straggler(ctx), Divergence(ctx), Kill(ctx.rank)
        self.poller = Poller(WORKER_POLL_S, ctx.watch)
        self.total = ctx.global_step_budget
        self.step = start.global_step  # updates applied: the parameters are those of this step
        self.pending = MPI.REQUEST_NULL
        self.mine: int | None = None  # the step of the gradient pushed and not yet answered
        self.my_loss = 0.0
        self.computed = self.contributed = self.dropped = 0
        self.recent = deque([float("nan")], maxlen=LOSS_WINDOW)
        self.loss = float("nan")

    def run(self) -> WorkerResult:
        ctx, act, step_fn = self.ctx, self.ctx.activity, self.step_fn
        self._post()
        while self.step < self.total and not step_fn.why:
            step, slot = self.step, self.computed % 2
            act.enter(COMPUTE, step)
            self.kill.at(self.computed + 1)
            self._sent(slot)  # two pushes ago: long gone
            x, y = self.batches.next()
            t0 = time.perf_counter()
            grad = self.grads[slot]
            loss = self.divergence.check(ctx.model.loss_and_grad(self.params, x, y, grad), grad)
            self.straggler.pause(time.perf_counter() - t0)
            took = time.perf_counter() - t0
            act.stepped()
            self.computed += 1
            self._take_updates()
            if self.step != step or step_fn.why:
                self.dropped += 1  # the step closed while this gradient was computed
                continue
            self._push(slot, step, 0, loss, took)
            self.mine, self.my_loss = step, loss
            act.enter(WAIT)
            poll(lambda: self._take_updates() and (self.step != step or step_fn.why), WORKER_POLL_S, ctx.watch)
        act.enter(WAIT)
        self._sent(0)
        self._push(0, self.step, FLAG_STOP, 0.0)  # no more from this worker
        between_workers(ctx, lambda: self.poller.all(self.sends, [self.chief] * 2))
        timing = act.times()
        if step_fn.why:
            return _sync_result(step_fn, self.step, self.loss, timing, self.contributed, self.dropped)
        return _sync_result(step_fn, max(self.total, self.start.global_step), _mean_loss(self.recent), timing,
                            self.contributed, self.dropped)

    def _sent(self, slot: int) -> None:
        between_workers(self.ctx, lambda: self.poller.all([self.sends[slot]], [self.chief]))

    def _push(self, slot: int, step: int, flags: int, loss: float, seconds: float = 0.0) -> None:
        self.ctx.activity.enter(PUSH)
        out = self.outs[slot]
        self.ctx.backend.download(self.grads[slot], out.payload)
        out.stamp(TAG_QGRAD, step, self.computed, flags, loss, seconds)
        self.sends[slot] = self.ctx.comm.Isend(out.spec(), dest=self.chief, tag=TAG_QGRAD)

    def _post(self) -> None:
        if self.step < self.total:
            self.pending = self.ctx.comm.Irecv(self.update.msg.spec(), source=self.chief, tag=TAG_UPDATE)

    def _take_updates(self) -> bool:
        """Apply every update that came, in order; True if any did."""
        took = False
        while self.pending and arrived(self.ctx, self.pending, self.chief):
            took = True
            self._apply()
            if not self.step_fn.why:
                self._post()
        return took

    def _apply(self) -> None:
        u, step_fn, n = self.update, self.step_fn, self.n
        u.msg.check(TAG_UPDATE, self.chief, count=n + self.ctx.workers)
        if u.msg.step != self.step:
            raise ProtocolError(f"the chief sent the update of step {u.msg.step} "
                                f"while this worker is at step {self.step}")
        step_fn.own_loss = 0.0
        if self.mine == self.step:
            if u.chose(self.ctx.worker_index):
                self.contributed += 1
                step_fn.own_loss = self.my_loss
            else:
                self.dropped += 1  # in time, but after Q others
            self.mine = None
        self.ctx.backend.upload(step_fn.buf[:n], u.gradient)
        step_fn.buf[n] = u.msg.loss
        self.loss = step_fn.apply(self.step)
        if not step_fn.why:
            self.recent.append(self.loss)
            self.step += 1
            if u.msg.flags & FLAG_STOP_STEP:
                self.total = self.step  # the chief's last update: a stop was requested


def train_sync_quorum(ctx: Context, start: TrainState, on_step=None) -> WorkerResult:
    if ctx.worker_index == 0:
        return QuorumChief(ctx, start, on_step).run()
    return QuorumFollower(ctx, start).run()


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
