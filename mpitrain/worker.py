"""Ranks 1..N-1: compute gradients on a shard. Async push/pull, sync Allreduce step, local loop."""

from __future__ import annotations

import time
from collections import deque

import numpy as np
from mpi4py import MPI

from mpitrain.data import epoch_batches
from mpitrain.optim import Optimizer, decayed_lr
from mpitrain.protocol import FLAG_LAST, FLAG_STOP, TAG_GRAD, TAG_PARAMS, TAG_STATUS, Message, ProtocolError
from mpitrain.runtime import PS_RANK, Context
from mpitrain.transport import WORKER_POLL_S, Poller

STATUS_EVERY_S = 0.2  # sync chief -> PS progress reports; off the hot path
LOSS_WINDOW = 20  # final_loss: mean minibatch loss of the last LOSS_WINDOW global steps


class BatchStream:
    """This worker's minibatches, epoch after epoch, reshuffled each epoch from --seed.
    `budget` is the number of local steps allowed by --epochs (None: endless)."""

    def __init__(self, ctx: Context):
        cfg, be = ctx.cfg, ctx.backend
        self.ctx = ctx
        self.x = be.asarray(ctx.data.x_train)  # the whole train set lives on the device once
        self.y = be.asarray(ctx.data.y_train)
        self.spe = ctx.steps_per_epoch
        epochs = cfg.epochs_or_default
        self.budget = None if epochs is None else epochs * self.spe
        self.taken = 0
        self._epoch_idx = None

    def next(self):
        ctx = self.ctx
        epoch, k = divmod(self.taken, self.spe)
        if k == 0:
            idx = epoch_batches(ctx.data.n_train, ctx.workers, ctx.worker_index, ctx.cfg.batch_size, epoch, ctx.cfg.seed)
            self._epoch_idx = ctx.backend.asarray(idx)
        self.taken += 1
        rows = self._epoch_idx[k]
        return self.x[rows], self.y[rows]

    @property
    def exhausted(self) -> bool:
        return self.budget is not None and self.taken >= self.budget


class WorkerStats:
    def __init__(self):
        self.compute_s = 0.0
        self.started = time.perf_counter()

    def as_dict(self, poller: Poller | None, comm_s: float = 0.0) -> dict:
        wall = time.perf_counter() - self.started
        wait = (poller.waited_s if poller else 0.0) + comm_s
        return {"wall_s": wall, "compute_s": self.compute_s, "wait_s": wait}


def receive_initial_params(ctx: Context) -> np.ndarray:
    """Rank 0 initialises the parameters (float32, whatever the wire format); workers never
    initialise their own."""
    host = np.empty(ctx.model.n_params, np.float32)
    ctx.comm.Bcast([host, MPI.FLOAT], root=PS_RANK)
    return host


def run_async(ctx: Context) -> dict:
    """Pull/compute/push. With --overlap (default) the reply to push k is received while the
    gradient of step k+1 is computed, so a worker never idles on the round trip; each gradient
    is then computed on parameters one exchange older. --no-overlap waits for every reply."""
    model, be, comm = ctx.model, ctx.backend, ctx.comm
    n, wire = model.n_params, ctx.cfg.wire_dtype
    overlap = ctx.cfg.overlap
    inbox = [Message(n, be.host_alloc, wire), Message(n, be.host_alloc, wire)]  # current / next parameters
    outbox = [Message(n, be.host_alloc, wire), Message(n, be.host_alloc, wire)]  # alternating: one in flight
    # NumPy + float32: compute straight from the receive buffer and into the send buffer.
    zero_copy = be.mirror(inbox[0].payload) is inbox[0].payload
    initial = receive_initial_params(ctx)
    if zero_copy:
        inbox[0].payload[:] = initial
        params = inbox[0].payload
    else:
        params = be.asarray(initial)
    grads = [be.mirror(m.payload) for m in outbox]
    cur, version = 0, 0
    batches = BatchStream(ctx)
    poller, stats = Poller(WORKER_POLL_S), WorkerStats()
    reqs: list = []
    pushed = 0
    sent_last = False

    def adopt_reply() -> bool:
        """Wait for the pending reply; make it the current parameters. True when told to stop."""
        nonlocal cur, params, version
        poller.all(reqs)
        nxt = 1 - cur
        inbox[nxt].check(TAG_PARAMS, PS_RANK)
        cur = nxt
        if zero_copy:
            params = inbox[cur].payload
        else:
            be.upload(params, inbox[cur].payload)
        version = inbox[cur].step
        return bool(inbox[cur].flags & FLAG_STOP)

    while True:
        if reqs and (not overlap or sent_last):
            stop = adopt_reply()
            reqs = []
            if stop:
                break
            if sent_last:
                raise ProtocolError("the parameter server did not stop this worker after its last gradient")
        x, y = batches.next()
        slot = pushed % 2
        t0 = time.perf_counter()
        used_version = version
        loss = model.loss_and_grad(params, x, y, grads[slot])
        be.download(grads[slot], outbox[slot].payload)
        stats.compute_s += time.perf_counter() - t0
        if reqs:
            stop = adopt_reply()
            reqs = []
            if stop:
                break  # the gradient just computed is not pushed: training is over
        last = batches.exhausted
        outbox[slot].stamp(TAG_GRAD, used_version, pushed + 1, FLAG_LAST if last else 0, loss)
        reqs = [comm.Irecv(inbox[1 - cur].spec(), source=PS_RANK, tag=TAG_PARAMS),
                comm.Isend(outbox[slot].spec(), dest=PS_RANK, tag=TAG_GRAD)]
        pushed += 1
        sent_last = last
    return {"pushed": pushed, "params": be.to_host(params).copy(), "time": stats.as_dict(poller)}


class SyncStep:
    """One synchronous update: average the workers' gradients with Allreduce, then apply the same
    optimizer step on every worker, so replicas stay bitwise identical. The loss rides along as
    one extra element, so every worker also knows the mean loss (and would stop together)."""

    def __init__(self, ctx: Context, params):
        cfg, be, model = ctx.cfg, ctx.backend, ctx.model
        self.ctx, self.params = ctx, params
        n = model.n_params
        self.n = n
        self.buf = be.xp.zeros(n + 1, be.xp.float32)  # [gradient..., loss]
        wire = np.dtype(cfg.wire_dtype)
        # What travels: the buffer itself (NumPy, float32) or a host copy (GPU, or float16).
        self.wire = None
        if be.is_gpu or wire != np.float32:
            self.wire = be.host_alloc(wire.itemsize * (n + 1)).view(wire)
        self.mpi_type, self.op = (MPI.FLOAT, MPI.SUM) if wire == np.float32 else (MPI.UINT16_T, fp16_sum_op())
        self.opt = Optimizer(cfg.optimizer, n, be.xp, momentum=cfg.momentum)
        self.comm = ctx.worker_comm
        self.comm_s = 0.0

    def __call__(self, x, y, step: int) -> float:
        ctx, be = self.ctx, self.ctx.backend
        buf = self.buf
        loss = ctx.model.loss_and_grad(self.params, x, y, buf[: self.n])
        buf[self.n] = loss
        if self.comm is not None and self.comm.Get_size() > 1:
            t0 = time.perf_counter()
            if self.wire is not None:
                be.download(buf, self.wire)
                self.comm.Allreduce(MPI.IN_PLACE, [self.wire, self.mpi_type], op=self.op)
                be.upload(buf, self.wire)
            else:
                self.comm.Allreduce(MPI.IN_PLACE, [buf, MPI.FLOAT], op=MPI.SUM)
            self.comm_s += time.perf_counter() - t0
            buf *= be.xp.float32(1.0 / self.comm.Get_size())
        samples = step * ctx.global_batch  # examples seen before this update
        self.opt.step(self.params, buf[: self.n], decayed_lr(ctx.cfg.lr, ctx.cfg.lr_decay, samples, ctx.data.n_train))
        return float(buf[self.n])


_FP16_SUM = None


def fp16_sum_op():
    """MPI has no portable float16 SUM: a commutative user op over 2-byte elements (the
    datatype is UINT16_T so MPI never splits an element)."""
    global _FP16_SUM
    if _FP16_SUM is None:
        def fp16_sum(inbuf, inoutbuf, datatype):
            acc = np.frombuffer(inoutbuf, np.float16)
            acc += np.frombuffer(inbuf, np.float16)

        _FP16_SUM = MPI.Op.Create(fp16_sum, commute=True)
    return _FP16_SUM


def sync_total_steps(ctx: Context) -> int:
    """Every worker computes the same number: sync steps are deterministic."""
    cfg = ctx.cfg
    budgets = []
    if cfg.steps is not None:
        budgets.append(cfg.steps)
    epochs = cfg.epochs_or_default
    if epochs is not None:
        budgets.append(epochs * ctx.steps_per_epoch)
    return min(budgets)


def train_sync(ctx: Context, params_host: np.ndarray, on_step=None) -> dict:
    """The sync loop shared by sync workers and the local (one-process) run.
    `on_step(step, loss)` reports progress: to rank 0 (chief worker) or to the bar (local)."""
    be = ctx.backend
    params = be.asarray(params_host)
    step_fn = SyncStep(ctx, params)
    batches = BatchStream(ctx)
    stats = WorkerStats()
    total = sync_total_steps(ctx)
    recent = deque(maxlen=LOSS_WINDOW)
    for step in range(total):
        x, y = batches.next()
        t0 = time.perf_counter()
        loss = step_fn(x, y, step)
        stats.compute_s += time.perf_counter() - t0
        recent.append(loss)
        if on_step is not None:
            on_step(step + 1, loss)
    stats.compute_s -= step_fn.comm_s
    return {"pushed": total, "params": be.to_host(params).copy(), "recent_loss": float(np.mean(recent)),
            "time": stats.as_dict(None, step_fn.comm_s)}


def run_sync(ctx: Context) -> dict:
    """A sync worker. The first worker (the chief) also keeps rank 0 informed: a header-only
    status every STATUS_EVERY_S, then the final parameters, all on one tag so they arrive in order."""
    n = ctx.model.n_params
    host = receive_initial_params(ctx)
    if ctx.worker_index != 0:
        return train_sync(ctx, host)
    status = Message(0)
    pending = [MPI.REQUEST_NULL]
    last_sent = [0.0]

    def report(step: int, loss: float) -> None:
        now = time.perf_counter()
        if now - last_sent[0] < STATUS_EVERY_S or not pending[0].Test():
            return  # rate-limited, and never more than one status in flight
        status.stamp(TAG_STATUS, step, step, 0, loss)
        pending[0] = ctx.comm.Isend(status.spec(), dest=PS_RANK, tag=TAG_STATUS)
        last_sent[0] = now

    result = train_sync(ctx, host, report)
    pending[0].Wait()
    final = Message(n)
    final.payload[:] = result["params"]
    final.stamp(TAG_STATUS, result["pushed"], result["pushed"], FLAG_STOP, result["recent_loss"])
    ctx.comm.Send(final.spec(), dest=PS_RANK, tag=TAG_STATUS)
    return result
