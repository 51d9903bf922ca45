"""Rank 0, the parameter server: owns the master parameters, the optimizer, the global step.

Async: one pre-posted Irecv per worker; whichever gradient completes is applied and answered
with fresh parameters. Sync: the workers average among themselves; rank 0 follows their
progress from the chief worker's status messages and receives the final parameters.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
from mpi4py import MPI

from mpitrain.metrics import Progress
from mpitrain.optim import Optimizer, decayed_lr
from mpitrain.protocol import FLAG_LAST, FLAG_STOP, TAG_GRAD, TAG_PARAMS, TAG_STATUS, Message
from mpitrain.runtime import PS_RANK, Context
from mpitrain.transport import CHIEF_POLL_S, PS_POLL_NO_OVERLAP_S, PS_POLL_S, Poller
from mpitrain.worker import LOSS_WINDOW, train_sync



@dataclass
class ServerState:
    params: np.ndarray
    global_step: int = 0
    local_steps: list[int] = field(default_factory=list)
    recent_losses: deque = field(default_factory=lambda: deque(maxlen=LOSS_WINDOW))
    train_s: float = 0.0
    busy_fraction: float = 0.0

    @property
    def final_loss(self) -> float:
        return float(np.mean(self.recent_losses)) if self.recent_losses else float("nan")


def init_and_broadcast(ctx: Context) -> np.ndarray:
    params = ctx.model.init_params(ctx.cfg.seed)
    if not ctx.local:
        ctx.comm.Bcast([params, MPI.FLOAT], root=PS_RANK)
    return params


class _Clock:
    """Wall and CPU time of rank 0 over training: busy fraction = CPU / wall."""

    def __init__(self):
        self.wall0, self.cpu0 = time.perf_counter(), time.process_time()

    def stop(self, state: ServerState) -> None:
        state.train_s = time.perf_counter() - self.wall0
        state.busy_fraction = (time.process_time() - self.cpu0) / max(state.train_s, 1e-9)


def serve_async(ctx: Context, progress: Progress) -> ServerState:
    cfg, comm = ctx.cfg, ctx.comm
    n, W = ctx.model.n_params, ctx.workers
    state = ServerState(init_and_broadcast(ctx), local_steps=[0] * W)
    clock = _Clock()
    opt = Optimizer(cfg.optimizer, n, np, momentum=cfg.momentum)
    wire = cfg.wire_dtype
    inbox = [Message(n, dtype=wire) for _ in range(W)]
    outbox = [Message(n, dtype=wire) for _ in range(W)]
    # float16 gradients are widened once, so the optimizer only ever sees float32.
    grad32 = np.empty(n, np.float32) if wire != np.float32 else None
    recv = [comm.Irecv(inbox[w].spec(), source=w + 1, tag=TAG_GRAD) for w in range(W)]
    sends = [MPI.REQUEST_NULL] * W
    # With --overlap a reply is not awaited until the worker's next gradient is computed, so
    # rank 0 can sleep longer between polls and leave the cores to the workers.
    poller = Poller(PS_POLL_S if cfg.overlap else PS_POLL_NO_OVERLAP_S)
    stopping = False
    while True:
        done = poller.some(recv)  # [] once every worker has been told to stop
        if not done:
            break
        for w in done:
            msg = inbox[w]
            msg.check(TAG_GRAD, w + 1)
            if not stopping:
                lr = decayed_lr(cfg.lr, cfg.lr_decay, state.global_step * ctx.global_batch, ctx.data.n_train)
                grad = msg.payload
                if grad32 is not None:
                    np.copyto(grad32, grad)
                    grad = grad32
                opt.step(state.params, grad, lr)
                state.global_step += 1
                state.local_steps[w] += 1
                state.recent_losses.append(msg.loss)
                progress.update(state.global_step, msg.loss)
                stopping = cfg.steps is not None and state.global_step >= cfg.steps
            stop_w = stopping or bool(msg.flags & FLAG_LAST)
            sends[w].Wait()  # the previous reply was consumed before this push: returns at once
            reply = outbox[w]
            reply.payload[:] = state.params  # a copy (cast with fp16): params change while it is in flight
            reply.stamp(TAG_PARAMS, state.global_step, state.local_steps[w], FLAG_STOP if stop_w else 0)
            sends[w] = comm.Isend(reply.spec(), dest=w + 1, tag=TAG_PARAMS)
            if not stop_w:
                recv[w] = comm.Irecv(msg.spec(), source=w + 1, tag=TAG_GRAD)
    poller.all(sends)
    clock.stop(state)
    return state


def serve_sync(ctx: Context, progress: Progress) -> ServerState:
    """Follow the chief worker. Status messages are header-only; the last one (FLAG_STOP)
    carries the final parameters. Same tag, so MPI's ordering delivers the final one last."""
    n, W = ctx.model.n_params, ctx.workers
    state = ServerState(init_and_broadcast(ctx), local_steps=[0] * W)
    clock = _Clock()
    chief = PS_RANK + 1
    box = Message(n)
    poller = Poller(CHIEF_POLL_S)
    while True:
        req = ctx.comm.Irecv(box.spec(), source=chief, tag=TAG_STATUS)
        poller.all([req])
        final = bool(box.flags & FLAG_STOP)
        box.check(TAG_STATUS, chief, count=n if final else 0)
        state.global_step = box.step
        progress.update(state.global_step, box.loss)
        if final:  # its loss is the chief's mean over the last LOSS_WINDOW steps
            state.recent_losses.clear()
            state.recent_losses.append(box.loss)
            state.params[:] = box.payload
            break
    state.local_steps = [state.global_step] * W
    clock.stop(state)
    return state


def run_local(ctx: Context, progress: Progress) -> tuple[ServerState, dict]:
    """One process: the sync loop with one worker, reporting straight to the bar."""
    state = ServerState(init_and_broadcast(ctx), local_steps=[0])
    clock = _Clock()

    def on_step(step: int, loss: float) -> None:
        state.recent_losses.append(loss)
        progress.update(step, loss)

    result = train_sync(ctx, state.params, on_step)
    state.params = result["params"]
    state.global_step = result["pushed"]
    state.local_steps = [result["pushed"]]
    clock.stop(state)
    return state, result
