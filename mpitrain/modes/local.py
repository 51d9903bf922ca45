"""One process (`python -m mpitrain`, or a world of 1): the plain sync loop with one worker and no
parameter server, handing its steps to rank 0's duties (chief.py) itself, as rank 0 does for a
distributed run. Who runs what: LocalMode, at the end."""

from __future__ import annotations

import dataclasses

from mpitrain.core.reports import WorkerResult
from mpitrain.duties.chief import ChiefDuties, ServerState
from mpitrain.duties.metrics import Progress
from mpitrain.modes.base import CHIEF, Mode, Trained
from mpitrain.modes.sync import train
from mpitrain.runtime import Context


def run_local(ctx: Context, progress: Progress) -> tuple[ServerState, WorkerResult]:
    """One process: the sync loop with one worker, reporting straight to the bar and saving
    checkpoints itself."""
    duties = ChiefDuties(ctx, progress)

    def on_step(step: int, loss: float, sync_step) -> None:
        duties.advance(step, loss, lambda evaluate, save: sync_step.train_state(step), staleness=0, local_steps=[step])

    result = train(ctx, duties.start, on_step)
    state = duties.finish()
    state.params = result.params
    state.global_step = result.pushed
    state.local_steps = [result.pushed]
    state.recent_losses.append(result.recent_loss)
    state.ema = result.train_state.ema
    if result.diverged:
        state.diverged = dataclasses.replace(result.diverged, ranks=[0])
    duties.save(result.train_state, final=True)
    return state, result


class LocalMode(Mode):
    """One process: rank 0 is the one worker and keeps the model itself."""

    name = "local"
    averages = True  # its one gradient per step is that step's update

    def role(self, layout, rank: int) -> str:
        return CHIEF

    def chief(self, ctx: Context, progress: Progress) -> Trained:
        return Trained(*run_local(ctx, progress))


LOCAL = LocalMode()
