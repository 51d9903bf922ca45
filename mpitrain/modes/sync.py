"""Sync mode: the Allreduce step every worker takes (SyncStep, summing through an exchange Reducer), the
workers' loop (train; the first worker also reports to rank 0: work); rank 0's follower of that
coordinator and the other servers' loop are in sync_follow.py. --quorum's loop is in
quorum.py and shares SyncStep. Who runs what: SyncMode, at the end.

Rank 0 is not in the gradient Allreduce: the workers average among themselves on their own
communicator and apply identical updates, so replicas stay bitwise identical. The coordinator
sends rank 0 a status for the bar, and its state at eval, checkpoint and end (each server its
slice), all on one tag.
"""

from __future__ import annotations

import math
from collections import deque
from contextlib import contextmanager

import numpy as np

from mpitrain.core.compress import gather_words, scheme
from mpitrain.core.guard import NON_FINITE, Diverged, LossGuard
from mpitrain.core.ledger import SyncDeal
from mpitrain.core.optim import REGISTRY as OPTIMIZERS
from mpitrain.core.optim import Optimizer, make_ema
from mpitrain.core.outer import LocalSteps, Overlap
from mpitrain.core.reports import LOSS_WINDOW, WorkerResult, mean_loss
from mpitrain.core.stop import VOTED
from mpitrain.duties.checkpoint import INNER, OWN_MODEL, RESIDUAL, SUMS, Checkpointer, TrainState, split_rows
from mpitrain.duties.metrics import Progress
from mpitrain.duties.observe import ALLREDUCE, APPLY, COMPUTE, WAIT
from mpitrain.exchange.base import Reducer
from mpitrain.exchange.compressed import reducer_for
from mpitrain.exchange.mpi import await_verdict
from mpitrain.launch.faults import Kill
from mpitrain.membership import elastic
from mpitrain.membership.elastic import interrupted_at
from mpitrain.membership.liveness import PeerLost
from mpitrain.modes.base import Mode, Trained
from mpitrain.modes.gradients import DealtBatches, GradientSource, sync_deal
from mpitrain.modes.report import CoordinatorReport
from mpitrain.modes.sync_slots import LOSS, ROOM_VOTE, SAVE_VOTE, STAMP, SYNC_SLOTS, VOTE, WEIGHT, stamp_period, torn
from mpitrain.runtime import Context, start_state


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
        self.local = None  # --local-steps H > 1: an Allreduce every H steps (outer.py)
        self.part = slice(0, n)  # the parameters the outer step in buf averages (--fragments: buf[n - len:n])
        if cfg.local_steps > 1:
            self.local = LocalSteps(cfg, params, be.xp, start.opt_state if start else None)
        self.overlap = None  # --outer-overlap T: the outer exchange in flight during T inner steps (outer.Overlap)
        if self.local is not None and cfg.outer_overlap is not None and not self.reducer.alone:
            self.overlap = Overlap(cfg.outer_overlap, params, be.xp)
            self.spare = be.xp.zeros_like(self.buf)  # the inner steps' gradients while buf is in flight
        self.synced = True  # the step just taken ended with the workers' models identical
        self.activity = ctx.activity
        self.deal: SyncDeal | None = None  # this worker's share of the data deal (train, quorum.train)
        self.own_weight = 1.0  # 0 in a step where the deal has no batch left for this worker
        # --quorum: the batches dealt to a worker not in an update's Q, by epoch, as of the updates applied
        self.left_out: dict[int, int] = dict(start.left_out) if start is not None else {}
        # What each worker holds for itself that a checkpoint keeps (Mode.worker_arrays: error feedback, the inner
        # optimizer's state): the coordinator decides where it saves before the step's sum and votes so (its own
        # Checkpointer: rank 0's follows the states it is sent), every worker then gives its rows (`kept`, on
        # the coordinator, of global step `kept_at`).
        self.keeps = ctx.mode.worker_arrays(cfg)
        self.saves = Checkpointer(cfg, ctx.fingerprint) if self.keeps and ctx.worker_index == 0 else None
        self.saving, self.last = False, False
        self.kept, self.kept_at = {}, -1
        rows = start.per_worker if start is not None else {}
        if self.keeps and rows and len(rows[self.keeps[0]]) == ctx.workers:  # (else they start afresh: broadcast_start)
            for name, mine in self._own().items():
                mine[...] = be.asarray(rows[name][ctx.worker_index])

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

    def train_state(self, step: int) -> TrainState:
        """Host copies of what a checkpoint needs (plain sync: every worker is at `step`)."""
        def host(a):
            return None if a is None else np.array(self.ctx.backend.to_host(a), np.float32)

        loc = self.local  # with --local-steps: the global model of the last outer step, and the outer momentum
        opt = self.opt.state if loc is None else {**self.opt.state, **loc.outer.state()}
        state = TrainState(host(self.params if loc is None else loc.anchor), step, self.opt.t,
                           {k: host(a) for k, a in opt.items()}, [step] * self.ctx.workers,
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
        saves, loc = self.saves, self.local
        if saves is None:
            return 0.0
        # --local-steps: the first outer step at or past a multiple (any of its span's steps)
        return float(saves.due(step + 1, 1 if loc is None else loc.span))

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
        """Sum over workers (the reducer), divide by the summed weight, apply; returns the mean loss.
        With --local-steps H, the step is this worker's own, and every H steps (and the `last`) an
        outer step follows (local_step)."""
        self.saving, self.last = False, last
        if self.local is not None:
            return self.local_step(step, last)
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
        weight = ctx.workers if self.local is not None or self.deal is None else self.deal.weight(step)
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

    def apply(self, step: int, loss: float | None = None) -> float:
        """Apply the mean gradient in buf (mean loss behind it, unless given) as update `step`, unless that loss
        says the run diverged (`why`); returns the mean loss. With --local-steps the mean is of
        outer gradients, and the outer optimizer steps the global model (the anchor) by it."""
        ctx, buf, n, loc = self.ctx, self.buf, self.n, self.local
        self.activity.enter(APPLY)
        loss = float(buf[n + LOSS]) if loss is None else loss
        self.why = NON_FINITE if not math.isfinite(loss) else self.guard.exploded(loss)
        if self.why:
            return loss  # diverged: every worker sees the same mean, and none applies it
        if loc is None:
            self.opt.step(self.params, buf[:n], ctx.lr_at(step))
        else:
            part = self.part  # (its outer gradient at the end of buf's values, as local_step put it)
            loc.outer.step(loc.anchor, buf[n - (part.stop - part.start):n], part=part)
            if self.overlap is None:
                self.params[part] = loc.anchor[part]
            else:
                self.overlap.rebase(self.params, loc.anchor)
            self.synced = True
        if self.ema:
            self.ema.update(self.params if loc is None else loc.anchor)
        return loss


def train(ctx: Context, start: TrainState, on_step=None) -> WorkerResult:
    """The plain sync loop, shared by sync workers and the single-process run, from global
    step `start.global_step` (a resumed run) to the budget. `on_step(step, loss, sync_step)` reports
    each step: to rank 0 (coordinator) or to the bar and checkpoints (single)."""
    be = ctx.backend
    params = be.asarray(start.params)
    step_fn = SyncStep(ctx, params, start)
    step_fn.deal = sync_deal(ctx, start)
    source = GradientSource(ctx, batches=DealtBatches(ctx, step_fn.deal))
    kill, act = Kill(ctx.rank), ctx.activity
    # --epochs ends where the deal does: after a loss (or a join) that is more (fewer) steps than the
    # job's budget in the workers it started with
    total = sync_total(ctx, step_fn.deal)
    recent = deque([float("nan")], maxlen=LOSS_WINDOW)  # nan only if resumed at the budget
    done = max(total, start.global_step)
    applied = start.global_step  # updates applied: where a regroup takes this worker's state from
    with interrupted_at(lambda: step_fn.train_state(applied)), abandoned(step_fn):
        for step in range(start.global_step, total):
            # A worker alone (the others lost) never waits, and a wait is where the watch is looked
            # at: rank 0's stop request (a worker joining) and its death must still reach it.
            ctx.watch.check()
            act.enter(COMPUTE, step)
            kill.at(step - start.global_step + 1)
            step_fn.compute(source)
            act.stepped()
            loss = step_fn.reduce_and_apply(step, last=step + 1 == total)
            if step_fn.why:
                return sync_result(step_fn, applied, loss, act.times(), contributed=step)
            if step_fn.synced:  # with --local-steps, only an outer step's state is the same on every worker
                applied = step + 1 if step_fn.overlap is None else step_fn.overlap.sent_at
            recent.append(loss)
            if on_step is not None:
                on_step(step + 1, loss, step_fn)
            if step_fn.stop:
                done = step + 1
                break
    return sync_result(step_fn, done, mean_loss(recent), act.times(), contributed=done)


@contextmanager
def abandoned(step_fn: SyncStep):
    """Whatever ends the loop, an outer exchange left in flight stays alive (SyncStep.abandon)."""
    try:
        yield
    finally:
        step_fn.abandon()


def sync_total(ctx: Context, deal: SyncDeal) -> int:
    """The global step a sync phase ends at: --steps, or where the deal runs out, at a short last step or
    (Mode.short_last_step False: --quorum) at the last step that deals every worker a batch."""
    ends = [s for s in (ctx.cfg.steps, deal.last_step(whole=not ctx.mode.short_last_step)) if s is not None]
    return min(ends)


def sync_result(step_fn: SyncStep, step: int, loss: float, timing: dict, contributed: int,
                 dropped: int = 0) -> WorkerResult:
    """What a sync worker (or the single-process run) reports at global step `step`. When the step
    diverged (step_fn.why) update `step` was not applied: the state is the last good one, and
    whether this worker's own loss was the culprit goes to rank 0."""
    state = step_fn.train_state(step)  # host copies; its params are the result's params
    diverged = None
    if step_fn.why:
        diverged = Diverged(step, loss=loss, why=step_fn.why, mine=not math.isfinite(step_fn.own_loss))
    return WorkerResult(step, state.params, timing, dropped, contributed, loss, state, diverged)


def work(ctx: Context, loop=train) -> WorkerResult:
    """A sync worker, training with `loop` (`train`, or quorum.train with --quorum: QuorumMode
    chooses). The first worker (the coordinator) also keeps rank 0 informed (CoordinatorReport). When a worker
    is lost (--on-lost-worker continue), rank 0's word interrupts the loop wherever it waits
    (elastic.Regroup): the workers left regroup and run the loop again from the step they agree
    on, the first of them the coordinator. The loop's end is rank 0's to declare (elastic.Notices)."""
    start = start_state(ctx)
    first = start.global_step  # this phase's first step: the counts below are of this phase's steps
    notices = None
    if ctx.regroups:
        notices = elastic.Notices(ctx)
    report = None
    contributed = dropped = 0  # --quorum: the counts of the loops a regroup interrupted
    regroup = None  # rank 0's word to act on before the loop (runs) again
    with ctx.watch.during(notices):  # rank 0's word to regroup interrupts every wait of the loop
        while True:
            result = None
            try:
                if regroup is not None:
                    notices.ready(ctx, regroup.gen)  # until rank 0's GO: every worker left is ready
                    ctx, start = elastic.regroup(ctx, regroup)
                    start.per_worker = {}  # each worker's own arrays start afresh with the regrouped workers
                    gen, regroup = regroup.gen, None
                    if ctx.worker_index == 0:
                        report = report or CoordinatorReport(ctx)
                        report.regrouped(start.global_step, gen, start.dealt)
                if ctx.worker_index == 0 and report is None:
                    report = CoordinatorReport(ctx)
                result = loop(ctx, start, report.report if ctx.worker_index == 0 else None)
                if ctx.worker_index == 0:
                    report.final(result)
                if notices is not None:
                    notices.await_done(ctx)
                break
            except PeerLost as e:  # rank 0 lost (--on-lost-server continue): what a take-over starts from
                if e.state is None and result is not None:  # after the loop: its final state
                    e.state, e.counts = result.train_state, (result.contributed or 0, result.dropped)
                if e.state is not None:  # and this phase's counts, as its report would have had them
                    e.counts = ((e.state.global_step - first, 0) if loop is train
                                else (e.counts[0] + contributed, e.counts[1] + dropped))
                raise
            except elastic.Regroup as r:
                if r.state is None and regroup is not None:  # a newer NOTICE before GO: the same state, fewer workers
                    r.state = regroup.state
                elif r.state is None:  # not from inside the loop: after it (its result), or before it (the start)
                    r.state = result.train_state if result is not None else start
                    r.counts = (result.contributed or 0, result.dropped) if result is not None else (0, 0)
                if loop is not train:  # plain sync counts every step it took part in already
                    contributed, dropped = contributed + r.counts[0], dropped + r.counts[1]
                regroup = r
    if loop is not train:
        result.contributed, result.dropped = (result.contributed or 0) + contributed, result.dropped + dropped
    # The loops count in global steps, where a worker's own steps are the ones from `first`: a
    # joiner's phases start late, and a run resumed from a checkpoint counts from there (as --quorum).
    # join.Carry.whole_job adds this process's earlier phases.
    result.pushed -= first
    if loop is train:
        result.contributed = result.pushed
    return result


from mpitrain.modes.sync_follow import follow_coordinator, keep_shard  # noqa: E402  (rank 0's side, below its loops)


class SyncMode(Mode):
    """Sync: the workers average every step's gradients with one Allreduce among themselves; rank
    0 follows the coordinator's word (the bar, evaluations, checkpoints) and keeps the model."""

    name = "sync"
    averages = True
    worker_comm = True
    deals = True

    def chief(self, ctx: Context, progress: Progress) -> Trained:
        return Trained(state=follow_coordinator(ctx, progress))

    def server(self, ctx: Context, progress=None) -> Trained:
        return Trained(state=keep_shard(ctx))

    def worker(self, ctx: Context, progress=None) -> Trained:
        return Trained(worker=work(ctx))

    def global_batch(self, cfg, workers: int) -> int:
        return cfg.batch_size * (cfg.quorum or workers)

    def worker_arrays(self, cfg) -> tuple[str, ...]:
        # the gathered parts' error feedback (and with --compress-replies the sums' it adds)
        names = (RESIDUAL, SUMS)[: 1 + cfg.compress_replies] if scheme(cfg.compress, cfg.sparsify) else ()
        if cfg.local_steps == 1:
            return names
        # --outer-overlap: its steps since its last outer step; --fragments: those of the parts not synced since
        own = (OWN_MODEL,) if cfg.outer_overlap or cfg.fragments > 1 else ()
        return names + own + tuple(INNER + a for a in OPTIMIZERS[cfg.optimizer].state)

    def quorum(self, cfg, workers: int) -> int | None:
        return cfg.quorum if cfg.quorum is not None else workers

    def why_no_regroup(self) -> str | None:
        return None

    def start_words(self, cfg, workers: int) -> str | None:
        """--local-steps H: what an outer step is, for the start line."""
        if cfg.local_steps == 1:
            return None
        if cfg.outer_rule == "nesterov":
            how = f"momentum {cfg.outer_beta:g}{cfg.outer_beta_why()}"
        else:  # sgd: at lr 1 the new global model is the workers' mean
            how = "plain averaging" if cfg.outer_learning_rate == 1 else "no momentum"
        return (f"sync, local steps: every {cfg.local_steps} steps {self.averaging(cfg, workers)} and take an "
                f"outer {cfg.outer_rule} step (lr {cfg.outer_learning_rate:g}, {how}); each inner step applies one "
                f"worker's batch at --lr{Overlap.words(cfg.outer_overlap)}{LocalSteps.words(cfg.fragments)}")

    def averaging(self, cfg, workers: int) -> str:
        """--local-steps H: whose models an outer step averages, and what it costs."""
        return f"the {workers} workers average their models (one exchange instead of {cfg.local_steps})"

    def exchange_words(self, cfg, n: int, workers: int) -> str | None:
        return gather_words(cfg, n, workers)

    def waits_for(self, cfg, workers: int) -> str:
        return "waiting for the workers' gradient Allreduce"

    # Also a status or an update from the coordinator, which waits on the others itself.
    waits_on_workers = frozenset({ALLREDUCE, WAIT})


SYNC = SyncMode()
