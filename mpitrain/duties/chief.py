"""Rank 0's duties, whoever trains: the run's state as rank 0 keeps it (ServerState), the start
state, and after each global step the bar, the log, --eval-every and checkpoints (ChiefDuties).
The async server (modes/async_.py), rank 0's sync follower (modes/sync.py) and the single-process run
(modes/single.py) each hand their steps to one ChiefDuties; the other servers (--num-ps) keep a ServerState too.
"""

from __future__ import annotations

import math
import sys
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from mpitrain.core.console import say
from mpitrain.core.guard import SMOOTHING, Diverged
from mpitrain.core.layout import PS_RANK
from mpitrain.core.reports import LOSS_WINDOW
from mpitrain.duties.checkpoint import BY_EPOCH, Checkpointer, TrainState
from mpitrain.duties.metrics import Progress, RunLog
from mpitrain.duties.observe import CHECKPOINT, EVAL, attribute, step_time_from_beat
from mpitrain.runtime import Context, start_state


@dataclass
class ServerState:
    params: np.ndarray
    global_step: int = 0
    worker_steps: list[int] = field(default_factory=list)
    recent_losses: deque = field(default_factory=lambda: deque(maxlen=LOSS_WINDOW))
    staleness: Counter = field(default_factory=Counter)  # staleness -> applied gradients
    eval_history: list[dict] = field(default_factory=list)
    checkpoints: list[str] = field(default_factory=list)  # written by this run, oldest first
    ema: np.ndarray | None = None  # --ema-decay: the averaged parameters at the end
    start_step: int = 0  # > 0 when resumed
    resumed_from: str | None = None  # the checkpoint it was resumed from
    diverged: Diverged | None = None  # once a loss was not finite or exploded
    log: RunLog | None = None  # --log-dir
    lost_workers: list[dict] = field(default_factory=list)  # async: workers declared lost, in order
    train_s: float = 0.0
    eval_s: float = 0.0  # rank 0's time in --eval-every evaluations so far
    deferred_evals: list[tuple] = field(default_factory=list)  # --eval-at-end: (when, params, ema), not yet evaluated
    busy_fraction: float = 0.0
    bytes_in: int = 0  # message bytes this server received and sent while training (--num-ps rows)
    bytes_out: int = 0
    dealt: int | None = None  # the deal (core/ledger.py), as TrainState keeps it
    deal_shards: int = 0
    redeal: list = field(default_factory=list)
    left_out: dict[int, int] = field(default_factory=dict)
    repeated: dict[int, int] = field(default_factory=dict)
    partial: dict[int, int] = field(default_factory=dict)

    @property
    def final_loss(self) -> float:
        return float(np.mean(self.recent_losses)) if self.recent_losses else float("nan")


def copy_state(state: TrainState) -> TrainState:
    """A snapshot of a training state that later steps do not change (rank 0's own state is the
    live parameters)."""
    return TrainState(np.array(state.params), state.global_step, state.opt_t,
                      {k: np.array(a) for k, a in state.opt_state.items()}, list(state.positions),
                      None if state.ema is None else np.array(state.ema), dealt=state.dealt,
                      deal_shards=state.deal_shards, redeal=list(state.redeal),
                      **{name: dict(getattr(state, name)) for name in BY_EPOCH})


def begin(ctx: Context) -> tuple[TrainState, ServerState, Checkpointer]:
    """The start state (fresh or resumed, broadcast to the workers), rank 0's view of it, and the
    checkpointer (which will not save the step it resumed from again)."""
    start = start_state(ctx)
    after_loss = ctx.handover.worker_steps if ctx.handover is not None and not ctx.mode.averages else None
    state = ServerState(start.params, global_step=start.global_step, worker_steps=list(after_loss or start.positions),
                        start_step=start.global_step, resumed_from=str(ctx.resume[0]) if ctx.resume else None)
    if ctx.mode.deals:
        state.deal_shards, state.dealt, state.left_out = ctx.deal(start).shards, ctx.dealt(start), dict(start.left_out)
    elif ctx.mode.leases and start.dealt is not None:  # async's ledger as the start left it (AsyncServer keeps it on)
        state.deal_shards, state.dealt, state.redeal = ctx.deal(start).shards, start.dealt, list(start.redeal)
        state.repeated, state.partial = dict(start.repeated), dict(start.partial)
    cfg = ctx.cfg
    if cfg.log_dir and ctx.rank == PS_RANK and ctx.outputs.log is not None:  # a later phase of the job: its log goes on
        state.log = ctx.outputs.log
    elif cfg.log_dir and ctx.rank == PS_RANK:
        state.log = ctx.outputs.log = RunLog(cfg.log_dir, {"mode": ctx.mode.name, "model": ctx.model.description,
                                         "dataset": ctx.data.name, "world_size": ctx.size, "workers": ctx.workers,
                                         "start_step": start.global_step}, cfg.log_every)
    ckpt = Checkpointer(ctx.cfg, ctx.fingerprint)
    ckpt.mark(start.global_step)
    state.checkpoints = ckpt.saved  # the same list: it grows as rank 0 saves
    return start, state, ckpt


class Clock:
    """Wall and CPU time of a server over training: busy fraction = CPU / wall. Its wall time starts where
    every rank's Activity does, as the collectives that start the phase end (trainer.connect), not once
    this server has set its duties up: that came 30-50 ms after the workers had started training, and
    a short run's summary said 0.00 s and 70 million samples/s."""

    def __init__(self, ctx: Context):
        self.wall0, self.cpu0 = ctx.activity.started, time.process_time()

    def elapsed(self) -> float:
        return time.perf_counter() - self.wall0

    def stop(self, state: ServerState) -> None:
        state.train_s = self.elapsed()
        state.busy_fraction = (time.process_time() - self.cpu0) / max(state.train_s, 1e-9)


def record_eval(ctx: Context, state: ServerState, clock: Clock, params: np.ndarray, step: int,
                ema: np.ndarray | None = None) -> None:
    """--eval-every: test-set loss and accuracy of rank 0's parameters at global step `step` (and of
    their moving average), with the wall time since training started when they were these
    (`seconds`) and that time less rank 0's evaluations before it (`training_seconds`: what a
    time-to-accuracy measure counts). With --eval-at-end only a copy now, evaluated by `finish`:
    where the workers train on while rank 0 evaluates, what it spent evaluating is not what they
    lost, and 'training seconds' computed so were far too short (2026-11-29: 0.7 s for a sync run
    of 6.5 s with 100 evaluations)."""
    ctx.activity.enter(EVAL)
    t0 = time.perf_counter()
    seconds = clock.elapsed()
    when = {"global_step": step, "seconds": seconds, "training_seconds": seconds - state.eval_s}
    if ctx.cfg.eval_at_end:
        state.deferred_evals.append((when, params.copy(), None if ema is None else ema.copy()))
    else:
        add_eval(ctx, state, when, params, ema)
    state.eval_s += time.perf_counter() - t0


def add_eval(ctx: Context, state: ServerState, when: dict, params, ema) -> None:
    """Evaluate `params` (and `ema`) on the test set; the entry, `when` they were these, goes to
    eval_history and the log."""
    be = ctx.backend  # rank 0's model computes on its backend's arrays (--ps-device)
    x, y = be.asarray(ctx.data.x_test), be.asarray(ctx.data.y_test)
    loss, acc, _ = ctx.model.evaluate(be.asarray(params), x, y)
    entry = {**when, "test_accuracy": acc, "test_loss": loss}
    if ema is not None:
        entry["ema_test_loss"], entry["ema_test_accuracy"], _ = ctx.model.evaluate(be.asarray(ema), x, y)
    state.eval_history.append(entry)
    if state.log:
        state.log.eval(entry)


def log_train(ctx: Context, state: ServerState, clock: Clock, step: int, loss: float, force: bool = False,
              **extra) -> None:
    """--log-dir: the training scalars at a global step (loss, lr, samples/s, each worker's step
    time from its heartbeats, and what the caller adds)."""
    if state.log is None or not (force or state.log.due(step)):
        return
    lr = ctx.lr_at(step)
    rate = (step - state.start_step) * ctx.global_batch / max(clock.elapsed(), 1e-9)
    state.log.train(step, True, loss=loss, lr=lr, samples_per_second=rate, **extra)
    rows, _ = attribute(beat_step_times(ctx), ctx.cfg.straggler_report)
    if rows:
        state.log.workers(step, rows)


def seen_workers(ctx: Context) -> dict[int, tuple]:
    """Watch.seen() of the workers only (rank 0 also watches the other servers, --num-ps)."""
    return {r: seen for r, seen in ctx.watch.seen().items() if not ctx.layout.is_server(r)}


def beat_step_times(ctx: Context) -> dict[int, dict]:
    """Each worker's step time as its last heartbeat told it."""
    return {r: step_time_from_beat(b) for r, (b, _, _) in seen_workers(ctx).items() if b is not None}


def record_lost(state: ServerState, rank: int, why: str, then: str = "", loud: bool = True, repeated: int = 0) -> None:
    """A worker declared lost: in the summary (lost_workers), on stderr (rank 0's line; `loud`),
    and in the log. `repeated`: the batches of its last push dealt again though in the parameters (the store's)."""
    info = {"rank": rank, "global_step": state.global_step, "reason": why}
    if repeated:
        info["batches_repeated"] = repeated
    state.lost_workers.append(info)
    if loud:
        say(f"mpitrain: worker rank {rank} lost at global step {state.global_step} ({why}){then}", sys.stderr)
    if state.log:
        state.log.event("worker_lost", **info)


PENDING_SAVES = 4


class SoundLoss:
    """Whether the newest training loss looks like a sound model's: finite, under the guard's line
    (--divergence-factor x the run's first loss, guard.LossGuard) and under JUMP x the lowest
    smoothed loss so far (a jump, or a climb, which the smoothed loss follows and its lowest does not).
    It judges the parameters the loss was computed on: the guard itself stops a run only once its
    smoothed loss crossed the line, steps after the explosion began. --divergence-factor 0 turns it
    off with the guard."""

    JUMP = 4.0  # a sound run's minibatch losses stay within a few times their mean (a deferred save costs a step)

    def __init__(self, factor: float):
        self.factor, self.first, self.smoothed, self.lowest, self.ok = factor, None, None, None, True

    def saw(self, loss: float) -> None:
        if self.factor <= 0:
            return
        if not math.isfinite(loss):
            self.ok = False
            return
        if self.first is None:
            self.first = self.smoothed = self.lowest = loss
            return
        self.ok = loss <= self.factor * self.first and loss <= self.JUMP * self.lowest
        self.smoothed += SMOOTHING * (loss - self.smoothed)
        self.lowest = min(self.lowest, self.smoothed)


class ChiefDuties:
    """Rank 0 after each global step, the same whatever the mode: the bar and the log
    (`stepped`), test accuracy at --eval-every (`evaluate`) and checkpoints (`save`), with the
    run's ServerState (`state`), its start state and wall clock. The caller says when: it knows
    where the whole state is (its own, gathered from the other servers, or sent by the chief
    worker)."""

    def __init__(self, ctx: Context, progress: Progress):
        self.ctx, self.progress = ctx, progress
        self.start, self.state, self.ckpt = begin(ctx)
        self.clock = Clock(ctx)
        self.sound = SoundLoss(ctx.cfg.divergence_factor)
        # Periodic saves, written once a loss computed on their parameters proves them sound. Async
        # losses come a few steps behind (staleness): a few may wait at once.
        self.pending: deque[TrainState] = deque(maxlen=PENDING_SAVES)
        self.deferred = False  # a save was due while the loss was not sound: the next sound step saves

    def stepped(self, step: int, loss: float, force_log: bool = False, basis: int | None = None,
                **log_extra) -> None:
        """Global step `step` was applied; `loss` was computed on the parameters of step `basis`
        (async: its gradient's version; otherwise the step before)."""
        self.progress.update(step, loss)
        self.sound.saw(loss)
        self._settle(step - 1 if basis is None else basis)
        log_train(self.ctx, self.state, self.clock, step, loss, force=force_log, **log_extra)

    def advance(self, step: int, loss: float, whole: Callable[[bool, bool], TrainState],
                basis: int | None = None, span: int = 1, **log_extra) -> None:
        """The one call of a server after each global step, however it got there: the bar and the
        log, then the evaluation and the checkpoint due at `step`, on the whole state as
        `whole(evaluate, save)` gives it (asked only when one is due). The budget's last step is
        saved once, at the end (the server's final save: with --num-ps the other servers may not
        have applied their last gradients yet, and a save of the same step is skipped). `span`: the
        global steps this update made (async --local-steps: a push's inner steps); what fell due
        at any of them is done now."""
        self.stepped(step, loss, basis=basis, **log_extra)
        evaluate = self.ctx.eval_due(step, span)
        save = self.save_due(step, span) and step < self.ctx.global_step_budget
        if not (evaluate or save):
            return
        state = whole(evaluate, save)
        if save:
            self.save(state)
        if evaluate:
            self.evaluate(state, step)

    def save_due(self, step: int, span: int = 1) -> bool:
        return (self.deferred or self.ckpt.due(step, span)) and self.sound.ok and self.state.diverged is None

    def evaluate(self, whole: TrainState, step: int) -> None:
        record_eval(self.ctx, self.state, self.clock, whole.params, step, whole.ema)

    def save(self, whole: TrainState, final: bool = False, at_once: bool = False) -> None:
        """A diverged run writes nothing more: the state at the step that diverged is the
        explosion's. A periodic save is written once the next step's loss, computed on its
        parameters, is sound (SoundLoss), and dropped if not, so that the folder's newest checkpoint
        is always one to resume from ("the last good checkpoint is ..."). A final one (the end, a
        stop, rank 0's last words) is written at once; so is one `at_once`, if the newest loss is
        sound (sync: rank 0 hears the loss only when the coordinator (worker 0) sends, so a save waiting for
        the next would wait a whole interval)."""
        if self.state.diverged is not None:
            self.pending.clear()
        elif final:
            self.pending.clear()
            self._write(whole, final=True)
        elif not self.sound.ok:
            self.deferred = self.ckpt.enabled
        else:
            self.deferred = False
            if at_once:
                self._write(whole)
            elif self.ckpt.enabled:
                self.pending.append(copy_state(whole))  # full: the oldest unjudged one goes, a newer stays

    def _settle(self, basis: int) -> None:
        """Judge the pending saves by the first loss computed on their parameters (or later ones):
        sound, written; not, dropped, every one (the next sound step saves)."""
        if not self.sound.ok:
            self.deferred = self.deferred or bool(self.pending)
            self.pending.clear()
        while self.pending and basis >= self.pending[0].global_step:
            self._write(self.pending.popleft())

    def _write(self, whole: TrainState, final: bool = False) -> None:
        self.ctx.activity.enter(CHECKPOINT, whole.global_step)
        self.ckpt.save(whole, final=final)

    def finish(self) -> ServerState:
        """The end of training: its time stops, then what --eval-at-end kept is evaluated."""
        self.clock.stop(self.state)
        for when, params, ema in self.state.deferred_evals:
            add_eval(self.ctx, self.state, when, params, ema)
        self.state.deferred_evals.clear()
        return self.state
