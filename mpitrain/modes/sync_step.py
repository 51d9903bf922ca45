"""One synchronous update (SyncStep): every worker's gradient summed through an exchange Reducer, the same
optimizer step applied on every worker. Sync's loop (sync.train) and --quorum's (quorum.py) take it from
sync_outer.step_for, which wraps it for --local-steps (OuterSyncStep) in one place."""

from __future__ import annotations

import math

import numpy as np

from mpitrain.core.guard import NON_FINITE, LossGuard
from mpitrain.core.ledger import SyncDeal
from mpitrain.core.optim import Optimizer, make_ema
from mpitrain.core.stop import VOTED
from mpitrain.duties.checkpoint import INNER, OWN_MODEL, RESIDUAL, SUMS, Checkpointer, TrainState, split_rows
from mpitrain.duties.observe import APPLY
from mpitrain.exchange.base import Reducer
from mpitrain.exchange.compressed import reducer_for
from mpitrain.exchange.mpi import await_verdict
from mpitrain.modes.gradients import GradientSource
from mpitrain.modes.sync_slots import LOSS, ROOM_VOTE, SAVE_VOTE, STAMP, SYNC_SLOTS, VOTE, WEIGHT, stamp_period, torn
from mpitrain.runtime import Context


class SyncStep:
    """One synchronous update: average the workers' gradients with Allreduce, then apply the same
    optimizer step on every worker, so replicas stay bitwise identical. The buffer is
    [gradient..., loss, weight, stop, room, save, stamp]: the loss rides along so every worker knows the mean
    loss, the weight (1 from each worker) so the sum divides by the number of gradients in it, three votes
    (1 from a worker that knows of a stop request; 1 from one that knows rank 0 makes room for a new
    member; 1 from the coordinator where a checkpoint will keep every worker's own arrays) so that every
    worker ends the phase after the same step (`stop`) and knows why, or gives its own arrays (`saving`), and the
    step's stamp (the same from each worker) so that a sum holding a part of another step, or garbage, is never
    taken for this one (`torn`). --quorum sums its gradients on the
    coordinator instead (QuorumCoordinator) and every worker `apply`s the mean."""

    def __init__(self, ctx: Context, params, start: TrainState | None = None, reducer: Reducer | None = None):
        cfg, be, model = ctx.cfg, ctx.backend, ctx.model
        self.ctx, self.params = ctx, params
        self.n = n = model.n_params
        self.buf = be.xp.zeros(n + SYNC_SLOTS, be.xp.float32)
        self.reducer = reducer or reducer_for(ctx, n, SYNC_SLOTS)
        self.opt = Optimizer(cfg.optimizer, n, be.xp, momentum=cfg.momentum)
        self.ema = None
        self.own_loss = 0.0  # this worker's own minibatch loss in the step being reduced
        self.guard = LossGuard(cfg.divergence_factor)  # on the mean loss: every worker decides alike
        self.why: str | None = None  # set when the step just reduced diverged (and was not applied)
        self.stop = False  # set when the step just reduced is the last: a stop, or room to make (core/stop.py)
        self.period = stamp_period(cfg.compress, ctx.workers)
        if start is not None:
            self.opt.restore(start.opt_t, start.opt_state)
            if ctx.worker_index == 0:  # the coordinator (or the single-process run) keeps the moving average
                self.ema = make_ema(cfg.ema_decay, params, be.xp, start.global_step, start.ema)
        self.part = slice(0, n)  # the parameters a sum averages (--fragments: buf[n - len:n], OuterSyncStep)
        self.overlap = None  # --outer-overlap T (OuterSyncStep): the outer exchange in flight
        self.synced = True  # the step just taken ended with the workers' models identical (always, here)
        self.activity = ctx.activity
        self.deal: SyncDeal | None = None  # this worker's share of the data deal (train, quorum.train)
        self.own_weight = 1.0  # 0 in a step where the deal has no batch left for this worker
        # --quorum: the batches dealt to a worker not in an update's Q, by epoch, as of the updates applied
        self.left_out: dict[int, int] = dict(start.left_out) if start is not None else {}
        # What each worker holds for itself that a checkpoint keeps (Mode.worker_arrays: error feedback, the inner
        # optimizer's state): the coordinator decides where it saves before the step's sum and votes so (its own
        # Checkpointer: rank 0's follows the states it is sent), every worker then gives its rows (`kept`, on
        # the coordinator, of global step `kept_at`).
        self.begin(start)  # (before each worker's own arrays are restored below: OuterSyncStep's global model)
        self.keeps = ctx.mode.worker_arrays(cfg)
        self.saves = Checkpointer(cfg, ctx.fingerprint) if self.keeps and ctx.worker_index == 0 else None
        self.saving, self.last = False, False
        self.kept, self.kept_at = {}, -1
        rows = start.per_worker if start is not None else {}
        if self.keeps and rows and len(rows[self.keeps[0]]) == ctx.workers:  # (else they start afresh: broadcast_start)
            for name, mine in self._own().items():
                mine[...] = be.asarray(rows[name][ctx.worker_index])

    def begin(self, start: TrainState | None) -> None:
        """What a step built on this one sets up from the start's parameters, the global model (OuterSyncStep)."""

    def _own(self) -> dict:
        """This worker's arrays of Mode.worker_arrays, by name (on its device)."""
        mine = {RESIDUAL: lambda: self.reducer.compressor.residual, SUMS: lambda: self.reducer.sums,
                OWN_MODEL: lambda: self.params}
        return {name: mine[name]() if name in mine else self.opt.state[name[len(INNER):]] for name in self.keeps}

    def dealt_at(self, step: int) -> int | None:
        """The deal's batches in the updates up to global step `step` (None: nothing deals them)."""
        return None if self.deal is None else self.deal.dealt_at(step)

    def _dealt(self, state: TrainState) -> TrainState:
        if self.deal is not None:
            state.dealt, state.deal_shards = self.deal.dealt_at(state.global_step), self.deal.deal.shards
            state.left_out = dict(self.left_out)
        return state

    def leave_out(self, step: int, span: int, chosen) -> None:
        """--quorum: update `step + 1` (to `step + span`) took the batches of the workers in `chosen` only."""
        for epoch, n in self.deal.left_out(step, span, chosen).items():
            self.left_out[epoch] = self.left_out.get(epoch, 0) + n

    @property
    def span(self) -> int:
        """The global steps between two states every worker holds alike (--local-steps: an outer step's)."""
        return 1

    def global_model(self):
        """The parameters every worker holds alike (--local-steps: the last outer step's)."""
        return self.params

    def saved_optimizer(self) -> dict:
        """The optimizer's arrays a checkpoint keeps (--local-steps: the outer optimizer's too)."""
        return self.opt.state

    def train_state(self, step: int) -> TrainState:
        """Host copies of what a checkpoint needs (plain sync: every worker is at `step`)."""
        def host(a):
            return None if a is None else np.array(self.ctx.backend.to_host(a), np.float32)

        state = TrainState(host(self.global_model()), step, self.opt.t,
                           {k: host(a) for k, a in self.saved_optimizer().items()}, [step] * self.ctx.workers,
                           host(self.ema.avg) if self.ema else None)
        if self.kept_at == step:  # (gathered at this step only: a regroup's state has none, and they start afresh)
            state.per_worker = self.kept
        return self._dealt(state)

    def compute(self, source: GradientSource) -> float:
        """This worker's gradient on the current parameters, weight 1; weight 0 and a zero gradient
        where the deal has no batch left for it in this step (the others' mean is the update)."""
        if source.batches.idle:
            source.batches.skip()
            self.buf[: self.n] = 0
            self._weigh(0.0, 0.0)
            return 0.0
        loss = source.compute(self.params, self.buf[: self.n])
        self._weigh(loss)
        return loss

    def _weigh(self, loss: float, weight: float = 1.0) -> None:
        self.own_loss, self.own_weight = loss, weight
        if self.reducer.alone:  # nothing to sum: the loss and the vote stay here (_average)
            return
        self.buf[self.n + LOSS] = loss
        self.buf[self.n + WEIGHT] = weight
        stop = self.ctx.stop  # this worker's own stop and room votes
        self.buf[self.n + VOTE], self.buf[self.n + ROOM_VOTE] = float(stop.requested), float(stop.room)

    def _save_vote(self, step: int) -> float:
        """The coordinator's: 1 where the state after update `step` is a checkpoint's (Mode.worker_arrays only)."""
        if self.saves is None:
            return 0.0
        # --local-steps: the first outer step at or past a multiple (any of its span's steps)
        return float(self.saves.due(step + 1, self.span))

    def _keep_own(self, step: int) -> None:
        """After update `step`'s sum: every worker's own arrays to the coordinator, where the state is saved
        (a checkpoint's vote, or the phase's last step: the final state is saved too)."""
        if not self.keeps or not (self.saving or self.stop or self.last):
            return
        if self.saves is not None and self.saving:
            self.saves.mark(step + 1)
        be, n = self.ctx.backend, self.n
        rows = self.reducer.gather_rows(np.concatenate([np.asarray(be.to_host(a), np.float32)
                                                        for a in self._own().values()]))
        self.kept = {} if rows is None else split_rows(rows, self.keeps, n)
        self.kept_at = step + 1

    def reduce_and_apply(self, step: int, last: bool = False) -> float:
        """Sum over workers (the reducer), divide by the summed weight, apply; returns the mean loss."""
        self.saving, self.last = False, last
        loss = self.apply(step, self._average(step))
        self._keep_own(step)
        return loss

    def _average(self, step: int, lo: int = 0) -> float | None:
        """Sum [values..., loss, weight, stop, room and save votes, stamp] over the workers, check the exact
        slots (`torn`), divide by the weight (each worker's 1); the votes are the same sum on every worker, so
        all stop (or give their own arrays) after this step. A worker alone returns its loss (as float32, as
        the buffer would hold it); None: it is in buf. `lo`: the values start there (--fragments' part)."""
        buf, ctx = self.buf, self.ctx
        if self.reducer.alone:
            self.stop, loss = ctx.stop.due, float(np.float32(self.own_loss))
            self.saving = bool(self._save_vote(step))
            return loss
        stamp = self._stamp(step)
        self.reducer.sum(buf[lo:], self.part)  # (all of buf and every parameter but with --fragments)
        self._summed(step, stamp)

    def _stamp(self, step: int) -> int:
        """The exact slots this worker writes before update `step`'s sum: its step stamp and the save vote."""
        stamp = 1 + step % self.period
        self.buf[self.n + STAMP] = stamp
        self.buf[self.n + SAVE_VOTE] = self._save_vote(step)
        return stamp

    def _summed(self, step: int, stamp: int) -> None:
        """The sum in buf: check its exact slots, divide by the weight, act on the votes (after update `step`)."""
        buf, n, ctx = self.buf, self.n, self.ctx
        tail = [float(x) for x in ctx.backend.to_host(buf[n:])]  # one copy from a GPU
        votes = tail[VOTE], tail[ROOM_VOTE], tail[SAVE_VOTE]
        weight = self.weight(step)
        why = torn(ctx.workers, tail[WEIGHT], votes, tail[STAMP], stamp, weight)
        if why:
            await_verdict(ctx, why)
        buf *= ctx.backend.xp.float32(1.0) / buf[n + WEIGHT]
        if votes[0]:
            ctx.stop.request(origin=f"{VOTED} ({votes[0]:g} of {ctx.workers}) in the sum of update {step + 1}")
        if votes[1]:
            ctx.stop.make_room()
        # The sum's votes alone: a word heard during the Allreduce (after this worker voted) is the next
        # step's vote, or this worker would end the phase a step before the others (a hang, seen in a join).
        self.stop = any(votes[:2])
        self.saving = bool(votes[2])

    def weight(self, step: int) -> int:
        """The workers' summed weight in update `step`: those the deal gave a batch (one each)."""
        return self.ctx.workers if self.deal is None else self.deal.weight(step)

    def abandon(self) -> None:
        """The loop left (a regroup, a lost peer): nothing of this step's is in flight (OuterSyncStep's may be)."""

    def apply(self, step: int, loss: float | None = None) -> float:
        """Apply the mean in buf (mean loss behind it, unless given) as update `step`, unless that loss says the
        run diverged (`why`); returns the mean loss."""
        buf, n = self.buf, self.n
        self.activity.enter(APPLY)
        loss = float(buf[n + LOSS]) if loss is None else loss
        self.why = NON_FINITE if not math.isfinite(loss) else self.guard.exploded(loss)
        if self.why:
            return loss  # diverged: every worker sees the same mean, and none applies it
        self.update(step)
        if self.ema:
            self.ema.update(self.global_model())
        return loss

    def update(self, step: int) -> None:
        """The mean gradient in buf, one step of the optimizer on every worker alike."""
        self.opt.step(self.params, self.buf[:self.n], self.ctx.lr_at(step))
