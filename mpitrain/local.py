"""One process (`python -m mpitrain`, or a world of 1): the sync loop with one worker and no
parameter server, reporting straight to the progress bar, the log and the checkpoints, as rank 0
does for a distributed run (its bookkeeping is server.py's)."""

from __future__ import annotations

from mpitrain.metrics import Progress
from mpitrain.observe import CHECKPOINT
from mpitrain.runtime import Context
from mpitrain.server import Clock, ServerState, begin, log_train, record_eval
from mpitrain.worker import WorkerResult, train_sync


def run_local(ctx: Context, progress: Progress) -> tuple[ServerState, WorkerResult]:
    """One process: the sync loop with one worker, reporting straight to the bar and saving
    checkpoints itself."""
    start, state, ckpt = begin(ctx)
    clock = Clock()

    def on_step(step: int, loss: float, sync_step) -> None:
        progress.update(step, loss)
        log_train(ctx, state, clock, step, loss, staleness=0, local_steps=[step])
        if ctx.eval_due(step):
            st = sync_step.train_state(step)
            record_eval(ctx, state, clock, st.params, step, st.ema)
        if ckpt.due(step):
            ctx.activity.enter(CHECKPOINT, step)
            ckpt.save(sync_step.train_state(step))

    result = train_sync(ctx, start, on_step)
    state.params = result.params
    state.global_step = result.pushed
    state.local_steps = [result.pushed]
    state.recent_losses.append(result.recent_loss)
    clock.stop(state)
    state.ema = result.train_state.ema
    if result.diverged:
        state.diverged = {**result.diverged, "ranks": [0]}
    ckpt.save(result.train_state, final=True)
    return state, result
