"""What rank 0 says of a run: the start lines, the summary (printed, --summary-json, the log's
end), the timeline, and every rank's verdict (the exit code and its one line)."""

from __future__ import annotations

import dataclasses
import hashlib
import signal
import sys
from pathlib import Path

import numpy as np

from mpitrain.core import ledger
from mpitrain.core.config_io import as_record
from mpitrain.core.console import say
from mpitrain.core.data import shard_left_note
from mpitrain.core.exitcodes import ExitCode, interrupted
from mpitrain.core.guard import Diverged
from mpitrain.core.model import model_name
from mpitrain.core.reports import Outcome, RoleResult, ShardReport, Summary, WorkerReport, WorkerResult
from mpitrain.core.stop import HEARD, VOTED, signal_name
from mpitrain.duties import checkpoint, observe
from mpitrain.duties.metrics import human_summary, staleness_summary, summary_stop_line, to_json, write_json_atomic
from mpitrain.duties.outputs import WRITES
from mpitrain.runtime import PS_RANK, Context, nothing_to_train
from mpitrain.version import __version__


def digest(params: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(params, np.float32).tobytes()).hexdigest()[:16]


def resume_hint(ctx: Context, lost: int) -> str:
    directory = ctx.cfg.checkpoint_dir
    if not directory:
        return "no --checkpoint-dir was given, so there is nothing to resume from"
    found = checkpoint.list_checkpoints(Path(directory))
    newest = f"the newest checkpoint is {found[-1]}" if found else f"no checkpoint was written to {directory} yet"
    if not lost:
        return f"{newest}; resume with the same command"
    return (f"{newest}; resume with the workers left: the same command with -np {ctx.size - lost} "
            f"(the data is re-sharded)")


def shard_report(ctx: Context, state) -> ShardReport:
    """What a parameter server says of its shard (the summary's ps_shards)."""
    s = ctx.shard
    return ShardReport(ctx.rank, ctx.host, ctx.layout.shard_index(ctx.rank), s.stop - s.start, state.busy_fraction,
                       state.global_step, state.bytes_in, state.bytes_out, staleness_summary(state.staleness),
                       as_dict(state.diverged), stop_signal=ctx.stop.signum,
                       stop_origin=ctx.stop.origin)


def worker_report(ctx: Context, wres: WorkerResult, evaluation: tuple[float, float]) -> WorkerReport:
    """The worker's report to rank 0 (reports.py: JSON bytes on the wire, never pickled)."""
    t = wres.time
    wall = max(t["wall_s"], 1e-9)
    breakdown = {"compute": t["compute_s"] / wall, "communication_and_wait": t["wait_s"] / wall,
                 "other": max(0.0, 1 - (t["compute_s"] + t["wait_s"]) / wall), "wall_seconds": t["wall_s"]}
    act = ctx.activity
    return WorkerReport(ctx.rank, wres.pushed, wres.dropped, as_dict(wres.diverged), wres.contributed, evaluation[0],
                        evaluation[1], digest(wres.params), breakdown, act.report(), stop_signal=ctx.stop.signum,
                        stop_origin=ctx.stop.origin,
                        bytes_moved=[act.bytes_sent, act.bytes_received],
                        exchanges=act.exchanges if ctx.mode.averages else wres.pushed,  # async: to the store too
                        counted=wres.counted)


def build_summary(ctx: Context, mine: RoleResult, reports: list, placements: list[str],
                  diverged: Diverged | None, joins: list[dict] = (), failovers: list[dict] = ()) -> Summary:
    cfg, state = ctx.cfg, mine.state
    workers = [r for r in reports if isinstance(r, WorkerReport)]
    shards = [shard_report(ctx, state)] + [r for r in reports if isinstance(r, ShardReport)]
    lost = state.lost_workers
    if ctx.mode.averages:  # gradients each worker had in the averaged updates
        worker_steps = [w.contributed for w in workers]
    else:  # rank 0 counts by worker index; the summary's lists follow worker_ranks, the lost apart
        index = ctx.layout.worker_index
        worker_steps = [state.worker_steps[index(w.rank)] for w in workers]
        # A record from before a take-over may name a rank of the old world that is no worker of this
        # one (a server shard killed as the budget was reached: CI, 2026-12-03): its count stays unknown.
        lost = [x if "worker_steps" in x or x["rank"] not in ctx.layout.worker_ranks
                else {**x, "worker_steps": state.worker_steps[index(x["rank"])]} for x in lost]
    trained = not nothing_to_train(ctx)
    steps = state.global_step - state.start_step  # this run only, when resumed: train_s is this run's
    samples = steps * ctx.global_batch
    step_times, slow = observe.attribute({w.rank: w.step_time for w in workers}, cfg.straggler_report)
    return Summary(
        mpitrain_version=__version__,
        mode=ctx.mode.name,
        model=model_name(cfg.model),
        model_description=ctx.model.description,
        dataset=ctx.data.name,
        world_size=ctx.size,
        workers=ctx.workers,
        global_step=state.global_step,
        worker_steps=worker_steps,
        gradients_pushed=[w.pushed for w in workers],
        wall_seconds=state.train_s,
        samples_per_second=samples / max(state.train_s, 1e-9) if trained else None,
        test_accuracy=mine.test_accuracy,
        test_loss=mine.test_loss,
        ema_test_loss=mine.ema[0],
        ema_test_accuracy=mine.ema[1],
        worker_ranks=[w.rank for w in workers],
        worker_test_accuracy=[w.test_accuracy for w in workers],
        final_loss=state.final_loss if trained else None,
        lost_workers=lost,
        joined_workers=list(joins),
        failovers=list(failovers),
        max_rss_mb=[{"rank": 0, "start": mine.max_rss_mb[0], "end": mine.max_rss_mb[1]}]
        + [{"rank": w.rank, "start": w.max_rss_mb[0], "end": w.max_rss_mb[1]} for w in workers
           if w.max_rss_mb],  # a single-process run's own worker report has none: its rank is 0, above
        dropped_gradients=sum(w.dropped for w in workers),
        dropped_gradients_per_worker=[w.dropped for w in workers],
        staleness=staleness_summary(state.staleness),
        quorum=ctx.mode.quorum(cfg, ctx.workers),
        lr_scaling="linear" if cfg.scaled_lr else "none",
        lr_effective=cfg.learning_rate * ctx.lr_scale,  # after the warm-up, before --lr-decay
        steps_per_second=steps / max(state.train_s, 1e-9) if trained else None,
        eval_history=state.eval_history,
        param_digest=digest(state.params),
        worker_param_digests=[w.digest for w in workers],
        time_breakdown=[w.time_breakdown for w in workers],
        worker_step_seconds=step_times,
        slow_workers=slow,
        ps_busy_fraction=None if ctx.single else state.busy_fraction,
        num_ps=len(ctx.layout.server_ranks),
        ps_shards=[] if ctx.single else [r.entry() for r in shards],
        resumed_from=state.resumed_from,
        checkpoints=mine.checkpoints,
        placement=placements,
        config=as_record(cfg),
        diverged=None if diverged is None else {k: v for k, v in as_dict(diverged).items() if k != "mine"},
        stopped=stop_record(ctx, state, reports, diverged),
        write_errors=WRITES.report(),
        trained=trained,
        worker_bytes=[None if ctx.single else w.bytes_moved for w in workers],  # one process: nothing goes through MPI
        bytes_per_sample=None if ctx.single else per_sample([w.bytes_moved for w in workers], samples),
        compute_utilisation=None if ctx.single or not workers else
        sum(w.time_breakdown["compute"] for w in workers) / len(workers),
        worker_exchanges=[w.exchanges for w in workers],
        epochs=epoch_account(ctx, state),
    )


def epoch_account(ctx: Context, state) -> list[dict] | None:
    """What every epoch begun saw (core/ledger.py): the job's deal, as the modes deal or lend it; None for a
    state from before the ledger."""
    if state.dealt is None or not (ctx.mode.deals or ctx.mode.leases):
        return None
    return ledger.epochs(ctx.deal(state), state.dealt, state.redeal, state.left_out, state.repeated, state.partial)


def per_sample(moved: list[list[int] | None], samples: int) -> float | None:
    """Every worker's bytes sent and received per sample trained (None: not counted, or no sample)."""
    if not moved or any(m is None for m in moved) or samples <= 0:
        return None
    return sum(sum(m) for m in moved) / samples


def stop_record(ctx: Context, state, reports: list, diverged: Diverged | None) -> dict | None:
    """Rank 0: whether a stop request ended the run before its budget, and by which signal (its
    own, or the one a reporting rank received). A run that reached its budget anyway is done."""
    stop = ctx.stop
    if diverged or not stop.requested or ctx.budget_reached(state):
        return None
    signum = stop.signum or next((r.stop_signal for r in reports if r.stop_signal), 0) or int(signal.SIGTERM)
    origin = stop_origin(stop.origin, reports)
    stop.request(signum)  # the goodbye tells the workers which one (their exit code)
    return {"signal": signal_name(signum), "global_step": state.global_step, "origin": origin,
            "resume": resume_hint(ctx, 0) if ctx.cfg.checkpoint_dir else "no --checkpoint-dir: nothing was saved"}


def stop_origin(mine: str, reports: list) -> str:
    """Where a stop began ("rank 2: SIGTERM received"): the first rank (rank 0, then the reports' order)
    that knows it at first hand, else one that took it from the sync workers' vote, else rank 0's word."""
    origins = [(PS_RANK, mine)] + [(r.rank, r.stop_origin) for r in reports if r.stop_origin]
    rank, origin = min(origins, key=lambda ko: 3 if not ko[1] else 2 if ko[1].startswith(HEARD) else
                       1 if ko[1].startswith(VOTED) else 0)
    return f"rank {rank}: {origin or 'not known'}"


def publish(ctx: Context, mine: RoleResult, reports: list, placements: list[str],
            diverged: Diverged | None, joins: list[dict], failovers: list[dict] = ()) -> dict:
    """Rank 0: the summary (printed, --summary-json, the log's end) and the timeline; the
    goodbyes follow (ending.say_goodbye)."""
    cfg, state = ctx.cfg, mine.state
    if cfg.timeline:
        try:
            write_timeline(ctx, reports, placements)
        except OSError as e:
            WRITES.failed("timeline", "--timeline", cfg.timeline, e, "the run goes on without it")
    summary = build_summary(ctx, mine, reports, placements, diverged, joins, failovers).to_dict()
    ctx.outputs.close_bar()
    for line in human_summary(summary):
        say(line)
    if state.log:
        state.log.close(summary)
    if cfg.summary_json:
        try:
            write_json_atomic(cfg.summary_json, summary)
        except OSError as e:
            WRITES.failed("summary", "--summary-json", cfg.summary_json, e, "the summary follows on standard output")
            WRITES.incomplete = True
    summary["write_errors"] = WRITES.report()  # this run's last writes included
    if WRITES.incomplete:  # the result must not be lost with the file: one JSON object, one line
        say(to_json(summary, sort_keys=True))
    return summary


def verdict(ctx: Context, mine: RoleResult, reports: list, summary: dict | None, diverged: Diverged | None) -> Outcome:
    """The exit code and error line of a run that got to its end."""
    own = None if ctx.rank == PS_RANK else dataclasses.asdict(mine.report)
    outcome = Outcome(ExitCode.OK, summary, own)
    if ctx.rank == PS_RANK:
        outcome.params = np.asarray(mine.state.params, np.float32).copy()
        outcome.model = ctx.model.with_backend(np)
    if ctx.rank == PS_RANK and not ctx.single and not any(isinstance(r, WorkerReport) for r in reports):
        outcome.code = ExitCode.PEER_LOST  # every worker was lost: the budget was not finished
        outcome.error = "mpitrain: every worker was lost"
    elif ctx.rank == PS_RANK and mine.state.lost_workers:
        outcome.code = ExitCode.WORKER_LOST
        lost = ", ".join(f"rank {w['rank']}" for w in mine.state.lost_workers)
        outcome.error = f"mpitrain: the budget was finished without lost worker(s) {lost} (exit 8)"
    elif ctx.rank == PS_RANK and summary["failovers"]:  # a scheduler must see the loss as it does a worker's
        outcome.code = ExitCode.WORKER_LOST
        outcome.error = "mpitrain: the budget was finished after rank 0 was lost and a worker took over (exit 8)"
    stopped = summary["stopped"] if ctx.rank == PS_RANK else ctx.stop.requested
    if stopped and not diverged:
        outcome.code = interrupted(ctx.stop.signum or int(signal.SIGTERM))
        outcome.error = (summary_stop_line(summary) if ctx.rank == PS_RANK else
                         f"mpitrain: stopped ({signal_name(ctx.stop.signum)}); rank 0 saved the run")
    # Incomplete outputs outrank a lost worker: both finished the budget, but this one needs the user.
    if ctx.rank == PS_RANK and WRITES.incomplete and outcome.code in (ExitCode.OK, ExitCode.WORKER_LOST):
        outcome.code = ExitCode.OUTPUTS_INCOMPLETE
        outcome.error = ("mpitrain: training finished, but its outputs are incomplete (see write_errors in the "
                         "summary above): free space or fix the folder, then run the same command again")
        say(outcome.error, sys.stderr)
    if diverged:
        outcome.code = ExitCode.DIVERGED
        if ctx.rank == PS_RANK:
            # The folder's newest, whichever run wrote it (a resumed run may not have saved yet):
            # a diverged state is never saved (ChiefDuties._may_save), so it is the last good one.
            folder = ctx.cfg.checkpoint_dir
            outcome.error = diverged.line([str(p) for p in checkpoint.list_checkpoints(Path(folder))] if folder else [])
            say(outcome.error, sys.stderr)
        else:  # a worker knows the step only; rank 0 printed the line with the loss and whose it was
            outcome.error = f"mpitrain: training diverged at global step {diverged.global_step} (rank 0 says why)"
    return outcome


def timeline_events(ctx: Context) -> list[dict]:
    timeline = ctx.activity.timeline
    return timeline.events(ctx.rank) if timeline is not None else []


def write_timeline(ctx: Context, reports: list[dict], placements: list[str]) -> None:
    """--timeline: rank 0's spans and those the workers and the other servers sent with their
    reports, one track per rank (a lost worker's are lost with it)."""
    events = timeline_events(ctx)
    for r in reports:
        if r.rank != ctx.rank:
            events += r.timeline
    observe.write_trace(ctx.cfg.timeline, events, dict(enumerate(placements)))
    say(f"mpitrain: timeline of {len(events):,} spans written to {ctx.cfg.timeline} (open it in ui.perfetto.dev)")


def announce(ctx: Context, placements: list[str], regrown: bool = False) -> None:
    """Rank 0, before training: where every rank runs, and what this run starts from (after a
    join: the checkpoint saved to make room, which is no resume of the user's)."""
    cfg = ctx.cfg
    for line in placements:
        say(line)
    if ctx.single:
        say(f"mpitrain: one process: {cfg.alone_words} (mpirun -np 3 gives 1 parameter server + 2 workers)")
    lr = cfg.learning_rate
    line = f"mpitrain: {cfg.optimizer}, learning rate {lr:g} " + (
        "(--lr)" if cfg.lr is not None else f"({cfg.optimizer}'s default; --lr sets another)")
    if ctx.lr_scale > 1:
        warm = f"after a {cfg.warmup_epochs:g}-epoch warm-up" if cfg.warmup_epochs > 0 else "from the first step"
        line += (f"; sync: learning rate {lr:g} x {ctx.lr_scale} gradients per update = {lr * ctx.lr_scale:g} "
                 f"{warm} (--lr-scaling none keeps {lr:g})")
    say(line)
    for words in (ctx.mode.start_words(cfg, ctx.workers),
                  ctx.mode.exchange_words(cfg, ctx.model.n_params, ctx.workers)):
        if words:
            say(f"mpitrain: {words}")
    for note in ctx.data.notes:  # e.g. a class that never occurs in training
        say(note, sys.stderr)
    left = shard_left_note(ctx.data.n_train, ctx.workers, cfg.batch_size)
    if left:
        say(left, sys.stderr)
    if ctx.handover is not None:
        say(f"mpitrain: {taken_over(ctx.handover.record)}", sys.stderr)
    elif ctx.resume:
        path, st = ctx.resume
        WRITES.newest_checkpoint = str(path)
        say(f"mpitrain: training on from {path} (global step {st.global_step}), saved to make room" if regrown
            else f"mpitrain: resuming from {path} (global step {st.global_step}); --fresh starts over")
    elif cfg.fresh and cfg.checkpoint_dir:
        moved = checkpoint.set_aside(Path(cfg.checkpoint_dir))
        if moved:
            say(f"mpitrain: --fresh: earlier checkpoints kept in {moved}")


def divergence(ctx: Context, mine: RoleResult, reports: list) -> Diverged | None:
    """Rank 0: where training diverged and whose loss it was; workers: whether it did."""
    if ctx.rank != 0:
        return Diverged.from_dict(mine.report.diverged)
    d = mine.state.diverged
    if d is None:
        return None
    told = {r.rank: Diverged.from_dict(r.diverged) for r in reports if isinstance(r, WorkerReport) and r.diverged}
    ranks = d.ranks or [rank for rank, theirs in told.items() if theirs.mine]
    if d.why is None and told:  # sync: rank 0 learnt only the step; the workers know the rest
        first = next(iter(told.values()))
        d = dataclasses.replace(d, why=first.why, loss=first.loss)
    return dataclasses.replace(d, ranks=ranks)


def as_dict(d: Diverged | None) -> dict | None:
    """A Diverged as reports and the summary carry it (JSON)."""
    return None if d is None else dataclasses.asdict(d)


def taken_over(record: dict) -> str:
    """The line a take-over's new rank 0 starts its phase with (failover.Handover.record)."""
    lost, servers = record["updates_lost_at_most"], record["servers"]
    what = "no update lost" if lost == 0 else f"at most {lost} update(s) lost (async: those the lost server applied after the freshest copy)"
    K = len(servers)
    if record["successor"] != 0:
        who = f"rank 0 was lost ({record['lost']}); rank {record['successor']} took over as rank 0"
    else:
        shards = ", ".join(f"{k}/{K}" for k in record["lost_shards"])
        who = (f"parameter-server shard {shards} was lost ({record['lost']}); rank "
               f"{', '.join(str(servers[k]) for k in record['lost_shards'])} took it over")
    for key, how in (("state_kept", "kept"), ("state_restarted", "started again")):
        names = [a.removeprefix(checkpoint.OPT_PREFIX) for a in record.get(key, [])]
        if names:  # the optimizer's state and moving average, where the run has any
            what += f"; {how}: {', '.join(names)}"
    return (f"{who} at global step {record['global_step']}, {record['seconds']:.2f} s after the loss was noticed, with "
            f"{record['ranks'] - K} worker(s); {what}")
