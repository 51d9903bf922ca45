"""Sync mode: the workers' loop (train; the first worker also reports to rank 0: work) over the Allreduce
step every worker takes (sync_step.SyncStep; with --local-steps, sync_outer.OuterSyncStep); rank 0's
follower of that coordinator and the other servers' loop are in sync_follow.py. --quorum's loop is in
quorum.py and shares the step. Who runs what: SyncMode, at the end.

Rank 0 is not in the gradient Allreduce: the workers average among themselves on their own
communicator and apply identical updates, so replicas stay bitwise identical. The coordinator
sends rank 0 a status for the bar, and its state at eval, checkpoint and end (each server its
slice), all on one tag.
"""

from __future__ import annotations

import math
from collections import deque
from contextlib import contextmanager

from mpitrain.core.compress import gather_words, scheme
from mpitrain.core.guard import Diverged
from mpitrain.core.ledger import SyncDeal
from mpitrain.core.optim import REGISTRY as OPTIMIZERS
from mpitrain.core.outer import LocalSteps, Overlap
from mpitrain.core.reports import LOSS_WINDOW, WorkerResult, mean_loss
from mpitrain.duties.checkpoint import INNER, OWN_MODEL, RESIDUAL, SUMS, TrainState
from mpitrain.duties.metrics import Progress
from mpitrain.duties.observe import ALLREDUCE, COMPUTE, WAIT
from mpitrain.launch.faults import Kill
from mpitrain.membership import elastic
from mpitrain.membership.elastic import interrupted_at
from mpitrain.membership.liveness import PeerLost
from mpitrain.modes.base import Mode, Trained
from mpitrain.modes.gradients import DealtBatches, GradientSource, sync_deal
from mpitrain.modes.report import CoordinatorReport
from mpitrain.modes.sync_outer import step_for
from mpitrain.modes.sync_step import SyncStep
from mpitrain.runtime import Context, start_state


def train(ctx: Context, start: TrainState, on_step=None) -> WorkerResult:
    """The plain sync loop, shared by sync workers and the single-process run, from global
    step `start.global_step` (a resumed run) to the budget. `on_step(step, loss, sync_step)` reports
    each step: to rank 0 (coordinator) or to the bar and checkpoints (single)."""
    be = ctx.backend
    params = be.asarray(start.params)
    step_fn = step_for(ctx, params, start)
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
