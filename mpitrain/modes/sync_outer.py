"""--local-steps H in sync and --quorum (core/outer.py): OuterSyncStep, a SyncStep whose workers each apply their
own gradient (inner steps) and, every H steps, average how far they moved from the global model (an outer
step); with --fragments F a part of the parameters each H/F steps, with --outer-overlap T landing T inner steps
later. The one place --local-steps changes a sync step: step_for chooses it for sync's and --quorum's loops."""

from __future__ import annotations

import numpy as np

from mpitrain.core.outer import LocalSteps, Overlap
from mpitrain.duties.checkpoint import TrainState
from mpitrain.duties.observe import ALLREDUCE, APPLY
from mpitrain.exchange.base import Reducer
from mpitrain.modes.sync_step import SyncStep
from mpitrain.runtime import Context


def step_for(ctx: Context, params, start: TrainState | None = None, reducer: Reducer | None = None) -> SyncStep:
    """The sync step this run takes: OuterSyncStep with --local-steps H > 1, else the plain one."""
    return (OuterSyncStep if ctx.cfg.local_steps > 1 else SyncStep)(ctx, params, start, reducer)


class OuterSyncStep(SyncStep):
    """A SyncStep with --local-steps H: `reduce_and_apply` applies this worker's own gradient, and every H steps
    (and the budget's last) an outer step follows on every worker alike (`local_step`). The state every worker
    holds alike is the global model (the anchor) and the outer momentum, after an outer step only (`synced`)."""

    def begin(self, start: TrainState | None) -> None:
        """The global model (the anchor) and the outer optimizer from the start, before a resume gives each worker
        its own model back (--outer-overlap, --fragments: SyncStep's rows)."""
        cfg, be = self.ctx.cfg, self.ctx.backend
        self.local = LocalSteps(cfg, self.params, be.xp, start.opt_state if start else None)
        if cfg.outer_overlap is not None and not self.reducer.alone:
            self.overlap = Overlap(cfg.outer_overlap, self.params, be.xp)
            self.spare = be.xp.zeros_like(self.buf)  # the inner steps' gradients while buf is in flight

    @property
    def span(self) -> int:
        return self.local.span

    def global_model(self):
        return self.local.anchor

    def saved_optimizer(self) -> dict:
        return {**self.opt.state, **self.local.outer.state()}

    def weight(self, step: int) -> int:
        return self.ctx.workers  # an outer step's mean is over every worker's outer gradient

    def reduce_and_apply(self, step: int, last: bool = False) -> float:
        """This worker's own gradient; every H steps (and the `last`) an outer step follows (local_step)."""
        self.saving, self.last = False, last
        return self.local_step(step, last)

    def local_step(self, step: int, last: bool) -> float:
        """--local-steps H: apply this worker's own gradient (its own loss comes back); at an outer
        step, then average the workers' outer gradients anchor - local with their mean inner loss
        and stop votes, and apply the same outer step on every worker (the mean loss comes back). A
        diverged mean is not applied: the anchor stays the last good global model."""
        ctx, be, buf, n, loc = self.ctx, self.ctx.backend, self.buf, self.n, self.local
        self.activity.enter(APPLY)
        self.why, self.synced = None, False
        if self.own_weight:  # a step without a batch for this worker leaves its model as it is
            self.opt.step(self.params, buf[:n], ctx.lr_at(step))
            loc.losses.append(self.own_loss)
        ov, due = self.overlap, loc.due(step, last)
        if ov is not None and ov.flight is not None:
            ov.moved = ov.moved or bool(self.own_weight)
            self.reducer.progress(ov.flight)
            if step + 1 >= ov.lands_at or due:  # T steps later, or sooner where the next outer step is due
                loss = self._land(step)
                if self.why or self.stop or not due:
                    return loss
        if not due:
            return self.own_loss
        self.part = part = loc.part(step, last)  # (all of them but with --fragments)
        lo = n - (part.stop - part.start)
        be.xp.subtract(loc.anchor[part], self.params[part], out=self.buf[lo:n])
        self._weigh(float(np.mean(loc.losses)) if loc.losses else 0.0)
        loc.losses.clear()
        if ov is None:
            loss = self.apply(step, self._average(step, lo))
            self._keep_own(step)  # after the outer step: a checkpoint keeps the model this worker goes on from
            return loss
        stamp = self._stamp(step)  # written before the start: MPI reads the buffer from then on
        ov.launch(self.reducer.start(self.buf[lo:], part), stamp, self.params, step, last, self.buf, part)
        self.buf, self.spare = self.spare, self.buf
        return self._land(step) if ov.lands_at == step + 1 else self.own_loss

    def _land(self, step: int) -> float:
        """--outer-overlap: the outer exchange in flight lands after update `step`: the outer step, and this
        worker's own steps since it was sent kept on top of the new global model (Overlap.rebase)."""
        flight, stamp = self.overlap.flight, self.overlap.stamp
        self.activity.enter(ALLREDUCE)
        self.reducer.finish(flight)
        self.overlap.flight = None
        self.buf, self.spare = self.overlap.buf, self.buf  # the gradient just computed was applied already
        self._summed(step, stamp)
        loss = self.apply(step)
        self._keep_own(step)  # after the rebase: a checkpoint keeps the model this worker goes on from
        return loss

    def abandon(self) -> None:
        """The loop left with an outer exchange in flight (a regroup, a lost peer): MPI may still write it."""
        if self.overlap is not None and self.overlap.flight is not None:
            self.overlap.flight.abandon()

    def update(self, step: int) -> None:
        """The mean outer gradient in buf: the outer optimizer steps the global model (the anchor) by it."""
        loc, buf, n, part = self.local, self.buf, self.n, self.part
        loc.outer.step(loc.anchor, buf[n - (part.stop - part.start):n], part=part)  # (its place, as local_step put it)
        if self.overlap is None:
            self.params[part] = loc.anchor[part]
        else:
            self.overlap.rebase(self.params, loc.anchor)
        self.synced = True
