"""--stall-warning: the one line a rank prints when nothing moved for that long (what it waits
for, and each peer's state from its heartbeats)."""

from __future__ import annotations

from mpitrain.duties import observe
from mpitrain.duties.chief import seen_workers
from mpitrain.exchange.protocol import BEAT_GLOBAL_STEP
from mpitrain.membership import liveness
from mpitrain.runtime import PS_RANK, Context

STALL_DETAIL_WORKERS = 4  # a stall line describes every worker up to this many, else only the late ones


def server_stall_line(ctx: Context, step: int, stalled_s: float) -> str:
    """Rank 0, no global step for --stall-warning seconds: what it waits for, and each worker's
    state from its heartbeats (the ones not waiting are those the others wait for)."""
    cfg = ctx.cfg
    seen = seen_workers(ctx)
    silent_after = liveness.silent_after(cfg.worker_timeout)
    what = ctx.mode.waits_for(cfg, ctx.workers)
    if not seen:
        return observe.describe_server_stall(what, step, stalled_s, ["--worker-timeout 0: no heartbeats say "
                                                                     "what the workers do"], [])
    culprits = observe.not_arrived(seen, silent_after)
    # One line, also with many workers: those waiting are only counted past a few.
    shown = [r for r in seen if r in culprits or len(seen) <= STALL_DETAIL_WORKERS]
    peers = [observe.peer_state(r, *seen[r], silent_after, cfg.worker_timeout) for r in shown]
    if len(shown) < len(seen):
        peers.append(f"{len(seen) - len(shown)} other worker(s) waiting")
    # Sync: the coordinator's status is rate-limited, the workers' beats may be newer.
    step = max([step] + [int(b[BEAT_GLOBAL_STEP]) for b, _, _ in seen.values() if b is not None])
    return observe.describe_server_stall(what, step, stalled_s, peers, culprits)


def worker_stall_line(ctx: Context, stalled_s: float) -> str | None:
    """A worker without progress for --stall-warning seconds while it waits on rank 0 (in an
    Allreduce, or for a --quorum step's update, it waits on other workers: rank 0, which hears
    from all of them, says who)."""
    act, cfg = ctx.activity, ctx.cfg
    if act.phase in ctx.mode.waits_on_workers or act.phase in (observe.COMPUTE, observe.IDLE):
        return None
    seen = ctx.watch.seen()
    silent_after = liveness.silent_after(cfg.worker_timeout)
    ps = ("--worker-timeout 0: no heartbeats say what rank 0 does" if PS_RANK not in seen
          else observe.peer_state(PS_RANK, *seen[PS_RANK], silent_after, cfg.worker_timeout))
    return (f"mpitrain: rank {ctx.rank}: no progress for {stalled_s:.0f} s (--stall-warning), in "
            f"{observe.PHASES[act.phase]} waiting on the parameter server at global step {act.step:,}; {ps}")
