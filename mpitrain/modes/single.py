"""One process (`python -m mpitrain`, or a world of 1): the plain sync loop with one worker and no
parameter server, handing its steps to rank 0's duties (chief.py) itself, as rank 0 does for a
distributed run. Who runs what: SingleMode, at the end."""

from __future__ import annotations

import dataclasses

from mpitrain.core.reports import WorkerResult
from mpitrain.duties.chief import ChiefDuties, ServerState
from mpitrain.duties.metrics import Progress
from mpitrain.modes.base import Mode, Trained
from mpitrain.modes.sync import train
from mpitrain.runtime import Context


def run_single(ctx: Context, progress: Progress) -> tuple[ServerState, WorkerResult]:
    """One process: the sync loop with one worker, reporting straight to the bar and saving
    checkpoints itself."""
    duties = ChiefDuties(ctx, progress)

    def on_step(step: int, loss: float, sync_step) -> None:
        duties.advance(step, loss, lambda evaluate, save: sync_step.train_state(step), staleness=0, worker_steps=[step])

    result = train(ctx, duties.start, on_step)
    state = duties.finish()
    state.params = result.params
    state.global_step = result.pushed
    state.worker_steps = [result.pushed]
    state.recent_losses.append(result.recent_loss)
    state.ema = result.train_state.ema
    state.dealt = result.train_state.dealt
    if result.diverged:
        state.diverged = dataclasses.replace(result.diverged, ranks=[0])
    duties.save(result.train_state, final=True)
    return state, result


class SingleMode(Mode):
    """One process: rank 0 is the one worker and keeps the model itself."""

    name = "single"
    averages = True  # its one gradient per step is that step's update
    deals = True

    def chief(self, ctx: Context, progress: Progress) -> Trained:
        return Trained(*run_single(ctx, progress))


SINGLE = SingleMode()
