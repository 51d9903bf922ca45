"""What the sync coordinator (worker 0) tells rank 0 and the other servers while it trains: a status
for the bar, its whole state at evaluation, checkpoint and end (follow_coordinator and keep_shard, in
sync.py, receive them). Plain sync, --quorum and --local-steps alike."""

from __future__ import annotations

import time

import numpy as np

from mpitrain.core.layout import PS_RANK
from mpitrain.core.reports import WorkerResult
from mpitrain.duties.checkpoint import Checkpointer, TrainState, state_arrays, to_flat
from mpitrain.duties.observe import PUSH
from mpitrain.exchange.protocol import (FLAG_CKPT, FLAG_DIVERGED, FLAG_EVAL, FLAG_FINAL, FLAG_REGROUPED, TAG_LEFT_OUT,
                                        TAG_PER_WORKER, TAG_STATUS, Message)
from mpitrain.exchange.shards import cut
from mpitrain.exchange.transport import NO_REQUEST, WORKER_POLL_S, Poller, send_table, tested
from mpitrain.runtime import Context

STATUS_EVERY_S = 0.2  # sync coordinator -> PS progress reports; off the hot path


def pushed_by(step: int, dealt: int | None) -> int:
    """A status's H_PUSHED, the gradients behind its state: the worker batches of the deal that its updates
    applied (plain sync), or its global step where nothing deals them (--quorum: one per update)."""
    return step if dealt is None else dealt


class CoordinatorReport:
    """The coordinator keeps rank 0 informed, all on one tag so the messages arrive in order: a
    header-only status every STATUS_EVERY_S; its parameters and optimizer state at --eval-every and
    checkpoint steps; the same, flagged STOP, at the end. With --num-ps K the state goes to the K
    servers, each its slice (shards.py). A worker that becomes the coordinator in a regroup starts with
    FLAG_REGROUPED."""

    def __init__(self, ctx: Context):
        self.ctx = ctx
        n = self.n = ctx.model.n_params
        self.names = state_arrays(ctx.cfg)
        self.servers = list(ctx.layout.server_ranks)
        self.slices = ctx.layout.shard_slices(n)
        self.status = Message(0)
        self.fulls = [Message((s.stop - s.start) * len(self.names)) for s in self.slices]  # one per server
        self.pending = [NO_REQUEST] * (1 + len(self.servers))  # a status, a full message per server
        self.left_out = [NO_REQUEST]  # --quorum: the batches left out, by epoch, before a state rank 0 saves
        self.left_out_buf = np.zeros((0, 2), np.int64)
        self.keeps = ctx.mode.worker_arrays(ctx.cfg)  # every worker's own arrays, before a state rank 0 saves
        self.own = [NO_REQUEST]
        self.own_buf = np.zeros((0, self.n * len(self.keeps)), np.float32)
        self.last_sent = 0.0
        self.ckpt = Checkpointer(ctx.cfg, ctx.fingerprint)  # only decides when; rank 0 writes
        self.waiter = Poller(WORKER_POLL_S, ctx.watch)  # a full message waits for its server: never a dead one

    def send_full(self, state: TrainState, flags: int, loss: float) -> None:
        ctx = self.ctx
        ctx.activity.enter(PUSH)
        self.waiter.all(self.pending[1:], self.servers)
        if ctx.mode.leaves_out and flags & (FLAG_CKPT | FLAG_FINAL):  # first: rank 0 takes it with the state
            self.waiter.all(self.left_out, [PS_RANK])
            self.left_out_buf = np.asarray(sorted(state.left_out.items()), np.int64).reshape(-1, 2)
            self.left_out[0] = send_table(ctx.comm, self.left_out_buf, PS_RANK, TAG_LEFT_OUT)
        if self.keeps and flags & (FLAG_CKPT | FLAG_FINAL):  # no rows: a state without them (a diverged end)
            self.waiter.all(self.own, [PS_RANK])
            kept = [state.per_worker[name] for name in self.keeps] if state.per_worker else []
            self.own_buf = np.ascontiguousarray(np.concatenate(kept, axis=1) if kept else self.own_buf[:0], np.float32)
            self.own[0] = send_table(ctx.comm, self.own_buf, PS_RANK, TAG_PER_WORKER)
        flat = to_flat(state, self.names)
        for k, (full, s, rank) in enumerate(zip(self.fulls, self.slices, self.servers), 1):
            cut(flat, self.names, self.n, s, full.payload)
            full.stamp(TAG_STATUS, state.global_step, pushed_by(state.global_step, state.dealt), flags, loss)
            self.pending[k] = full.send(ctx.comm, rank, TAG_STATUS)

    def report(self, step: int, loss: float, sync_step) -> None:
        """After global step `step` (sync_step: the SyncStep that took it)."""
        ctx, span = self.ctx, sync_step.span
        saves = sync_step.saves  # with Mode.worker_arrays the step decided, and the workers gave theirs
        flags = 0
        if sync_step.synced:  # --local-steps: the global model exists after an outer step only
            save = sync_step.saving if saves is not None else self.ckpt.due(step, span)
            flags = (FLAG_EVAL if ctx.eval_due(step, span) else 0) | (FLAG_CKPT if save else 0)
        if flags:
            if flags & FLAG_CKPT:
                self.ckpt.mark(step)
            self.send_full(sync_step.train_state(step), flags, loss)
            return
        now = time.perf_counter()
        if now - self.last_sent < STATUS_EVERY_S or not tested(self.pending[0], PS_RANK, ctx.watch):
            return  # rate-limited, and never more than one status in flight
        self._status(step, 0, loss, sync_step.dealt_at(step))
        self.last_sent = now

    def regrouped(self, step: int, gen: int, dealt: int | None = None) -> None:
        self.waiter.all(self.pending[:1], [PS_RANK])
        self._status(step, FLAG_REGROUPED, 0.0, dealt, generation=gen)

    def _status(self, step: int, flags: int, loss: float, dealt: int | None = None, generation: int = 0) -> None:
        self.status.stamp(TAG_STATUS, step, pushed_by(step, dealt), flags, loss, generation=generation)
        self.pending[0] = self.status.send(self.ctx.comm, PS_RANK, TAG_STATUS)

    def final(self, result: WorkerResult) -> None:
        self.send_full(result.train_state, FLAG_FINAL | (FLAG_DIVERGED if result.diverged else 0), result.recent_loss)
        self.waiter.all(self.pending + self.left_out + self.own, [PS_RANK] + self.servers + [PS_RANK] * 2)
