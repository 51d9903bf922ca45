"""One training run on one rank: agree on setup, train in the rank's role, evaluate, report."""

from __future__ import annotations

import dataclasses
import hashlib
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

import numpy as np
from mpi4py import MPI

from mpitrain import asyncps, checkpoint, join, liveness, local, lock, mpiimpl, observe, outputs, quorum, stopping, sync
from mpitrain.config import TrainConfig, UsageError, agreed_fields, as_record, disagreement, plain_value
from mpitrain.model import model_name
from mpitrain.version import __version__
from mpitrain.faults import Kill
from mpitrain.guard import Diverged
from mpitrain.console import say
from mpitrain.metrics import (Progress, human_summary, staleness_summary, summary_stop_line, to_json,
                              write_json_atomic)
from mpitrain.exitcodes import ExitCode, interrupted
from mpitrain.lock import exit_without_finalize
from mpitrain.outputs import WRITES
from mpitrain.liveness import PeerLost, mpi_error_reason
from mpitrain.protocol import (BEAT_GLOBAL_STEP, FLAG_PEER_LOST, FLAG_REFORM, FLAG_STOPPED, TAG_REPORT, Message,
                               ProtocolError)
from mpitrain.protocol import VERSION as PROTOCOL_VERSION
from mpitrain.reports import ShardReport, Summary, WorkerReport, from_bytes, to_bytes
from mpitrain.runtime import PS_RANK, Context, Node, broadcast_start, node_info, setup
from mpitrain.stopping import STOP, signal_name
from mpitrain.chief import begin, record_lost, seen_workers
from mpitrain.transport import END_POLL_S, Poller
from mpitrain.waiting import poll
from mpitrain.gradients import WorkerResult

ABORT_FLUSH_S = 0.5
STALL_DETAIL_WORKERS = 4  # a stall line describes every worker up to this many, else only the late ones
FINALIZE_MIN_S = 5.0  # a healthy MPI_Finalize takes milliseconds: every rank arrives within that of the others


@dataclasses.dataclass
class RoleResult:
    """What training in its role left on this rank: rank 0 (and a local run) its final state and
    evaluation; a worker its report; a server other than rank 0 its shard's report."""

    state: object = None  # server.ServerState: rank 0 and the local run
    test_loss: float = float("nan")  # rank 0: of its final parameters
    test_accuracy: float = float("nan")
    ema: tuple = (None, None)  # rank 0, --ema-decay: test loss and accuracy of the moving average
    worker: WorkerReport | None = None  # a worker's (and the local run's) report to rank 0
    shard: ShardReport | None = None  # a server's other than rank 0
    max_rss_mb: list[float] = dataclasses.field(default_factory=list)  # start and end of training

    @property
    def report(self) -> WorkerReport | ShardReport | None:
        return self.worker or self.shard

    @property
    def checkpoints(self) -> list[str]:
        return self.state.checkpoints if self.state is not None else []


@dataclasses.dataclass
class Outcome:
    """How a run ended on this rank: the exit code, and what the Python API hands back."""

    code: int
    summary: dict | None = None  # rank 0
    report: dict | None = None  # a worker: its own report to rank 0
    error: str | None = None  # the one line, on every rank, when the code is not 0
    params: np.ndarray | None = None  # rank 0: the final flat parameters (host)
    model: object = None  # rank 0: their layout, on NumPy (model.Model), for the API's predict
    grown: tuple | None = None  # a worker joined: (the flags, the new world, its node) of the run's next phase
    # A peer was lost: MPI_Finalize would wait for it forever, so this process must end without it
    # (the command line does at once; the Python API when the interpreter exits: api.LostPeer).
    mpi_broken: bool = False


def agree_on_setup(cfg: TrainConfig | None, comm, node: Node, err: str | None) -> tuple[Context | None, str | None]:
    """Every rank sets up, then all compare notes. (None, the line rank 0 printed) if any failed."""
    ctx = None
    if err is None:
        try:
            ctx = setup(cfg, comm, node)
        except UsageError as e:
            err = str(e)
    notes = comm.allgather((err, identity(ctx)))  # setup-time only; every rank reaches it on every path
    failed = [(r, e) for r, (e, _) in enumerate(notes) if e]
    if not failed:
        failed = mismatches([ident for _, ident in notes])
    if not failed:
        return ctx, None
    rank, message = failed[0]
    where = "" if len(failed) == comm.Get_size() else f" on rank {rank}"
    line = f"mpitrain: error{where}: {message}"
    if comm.Get_rank() == 0:
        say(line, sys.stderr)
    return None, line


# What every rank must agree on before exchanging a single buffer: the code, the wire format, and
# every flag not marked per-rank in config.py (a mixed install or MPMD launch fails here, in one
# line, instead of in a truncated message, on garbage, or in a hang).
AGREED = agreed_fields()


def identity(ctx: Context | None) -> dict | None:
    return None if ctx is None else identity_of(ctx.cfg, ctx.model)


def identity_of(cfg: TrainConfig, model) -> dict:
    return {"mpitrain": __version__, "protocol": PROTOCOL_VERSION, "layer_sizes": list(model.sizes),
            **{k: plain_value(cfg, k) for k in AGREED}}


def mismatches(idents: list[dict | None]) -> list[tuple[int, str]]:
    out = []
    for rank, ident in enumerate(idents[1:], 1):
        detail = disagreement(idents[0], ident)
        if detail:
            out.append((rank, f"it disagrees with rank 0 ({detail}); start every rank from the same "
                              f"mpitrain install with the same flags"))
    return out


def digest(params: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(params, np.float32).tobytes()).hexdigest()[:16]


def _evaluate(ctx: Context, params_host: np.ndarray) -> tuple[float, float]:
    be = ctx.backend
    loss, acc, _ = ctx.model.evaluate(be.asarray(params_host), be.asarray(ctx.data.x_test), be.asarray(ctx.data.y_test))
    return loss, acc


def role_of(ctx: Context) -> tuple[str, str]:
    """(role, mode) of this rank: its key in ROLES."""
    if ctx.local:
        return "local", "local"
    mode = "quorum" if ctx.with_quorum else ctx.cfg.mode
    if ctx.rank == PS_RANK:
        return "chief", mode
    return ("shard" if ctx.is_ps else "worker"), mode


# Who runs what: the one place a run chooses its loop, by role and mode. rank 0 ("chief") and the
# local run get the progress bar and return rank 0's ServerState (the local run also its worker
# result); another server of --num-ps ("shard") its ServerState; a worker its WorkerResult.
# --quorum is sync's worker loop with quorum.py's steps; rank 0 and the servers follow as in sync.
ROLES = {
    ("local", "local"): local.run_local,
    ("chief", "async"): asyncps.serve,
    ("chief", "sync"): sync.follow_chief,
    ("chief", "quorum"): sync.follow_chief,
    ("shard", "async"): asyncps.serve_shard,
    ("shard", "sync"): sync.keep_shard,
    ("shard", "quorum"): sync.keep_shard,
    ("worker", "async"): asyncps.work,
    ("worker", "sync"): sync.work,
    ("worker", "quorum"): lambda ctx: sync.work(ctx, quorum.train),
}


def train_role(ctx: Context) -> RoleResult:
    """Run this rank's part (ROLES); return what it reports to rank 0 (rank 0 also keeps its state)."""
    cfg = ctx.cfg
    if nothing_to_train(ctx):
        return already_trained(ctx)
    role, mode = role_of(ctx)
    loop = ROLES[role, mode]
    if role == "shard":  # --num-ps: a server of one shard, reporting to rank 0
        return RoleResult(shard=shard_report(ctx, loop(ctx)))
    if role in ("chief", "local"):
        # The job's one bar: a later phase (a join, a respawn) goes on with it; closed by publish.
        progress = ctx.outputs.progress or Progress(cfg.progress, ctx.global_step_budget, ctx.global_batch)
        ctx.outputs.progress = progress
        if cfg.stall_warning > 0 and role == "chief":
            ctx.watch.stall = observe.Stall(cfg.stall_warning, lambda: progress.step,
                                            lambda stalled_s: server_stall_line(ctx, progress.step, stalled_s))
        try:
            state, wres = loop(ctx, progress) if role == "local" else (loop(ctx, progress), None)
        except BaseException:  # the line that says why comes next, under the bar's last line
            ctx.outputs.close_bar()
            raise
        ctx.activity.enter(observe.EVAL, state.global_step)
        loss, acc = _evaluate(ctx, state.params)
        mine = RoleResult(state, loss, acc, _evaluate(ctx, state.ema) if state.ema is not None else (None, None))
        if wres is not None:  # local: rank 0 is also the one worker
            mine.worker = _worker_report(ctx, wres, (loss, acc))
        return mine
    if cfg.stall_warning > 0:
        ctx.watch.stall = observe.Stall(cfg.stall_warning, lambda: ctx.activity.gradients,
                                        lambda stalled_s: worker_stall_line(ctx, stalled_s))
    wres = loop(ctx)
    ctx.activity.enter(observe.EVAL)
    return RoleResult(worker=_worker_report(ctx, wres, _evaluate(ctx, wres.params)))


def nothing_to_train(ctx: Context) -> bool:
    """The run resumed from a checkpoint that has reached the budget already (a re-run of a
    finished job, a Slurm requeue or `afterany` chain, or a smaller --steps): every rank knows it
    from the start state, so none trains a step and rank 0 writes no new checkpoint."""
    return ctx.start.global_step >= ctx.global_step_budget


def already_trained(ctx: Context) -> RoleResult:
    """A run with nothing to train: each rank evaluates what it starts from, and reports as usual."""
    start = ctx.start
    if ctx.is_ps or ctx.local:
        _, state, _ = begin(ctx)
        state.ema = start.ema
        if ctx.rank != PS_RANK:
            return RoleResult(shard=shard_report(ctx, state))
        loss, acc = _evaluate(ctx, state.params)
        mine = RoleResult(state, loss, acc, _evaluate(ctx, state.ema) if state.ema is not None else (None, None))
        if ctx.local:
            mine.worker = _worker_report(ctx, idle_result(ctx), (loss, acc))
        return mine
    return RoleResult(worker=_worker_report(ctx, idle_result(ctx), _evaluate(ctx, start.params)))


def idle_result(ctx: Context) -> WorkerResult:
    """What a worker that trained no step reports: its parameters are the start state's."""
    sync = ctx.cfg.mode == "sync" or ctx.local
    return WorkerResult(0, ctx.start.params, ctx.activity.times(), contributed=0 if sync else None)


def shard_report(ctx: Context, state) -> ShardReport:
    """What a parameter server says of its shard (the summary's ps_shards)."""
    s = ctx.shard
    return ShardReport(ctx.rank, ctx.host, ctx.layout.shard_index(ctx.rank), s.stop - s.start, state.busy_fraction,
                       state.global_step, state.bytes_in, state.bytes_out, staleness_summary(state.staleness),
                       as_dict(state.diverged), stop_signal=STOP.signum)


def server_stall_line(ctx: Context, step: int, stalled_s: float) -> str:
    """Rank 0, no global step for --stall-warning seconds: what it waits for, and each worker's
    state from its heartbeats (the ones not waiting are those the others wait for)."""
    cfg = ctx.cfg
    seen = seen_workers(ctx)
    silent_after = liveness.silent_after(cfg.worker_timeout)
    what = observe.server_waits_for(cfg.mode, cfg.quorum, ctx.workers)
    if not seen:
        return observe.describe_server_stall(what, step, stalled_s, ["--worker-timeout 0: no heartbeats say "
                                                                     "what the workers do"], [])
    culprits = observe.not_arrived(seen, silent_after)
    # One line, also with many workers: those waiting are only counted past a few.
    shown = [r for r in seen if r in culprits or len(seen) <= STALL_DETAIL_WORKERS]
    peers = [observe.peer_state(r, *seen[r], silent_after, cfg.worker_timeout) for r in shown]
    if len(shown) < len(seen):
        peers.append(f"{len(seen) - len(shown)} other worker(s) waiting")
    # Sync: the chief's status is rate-limited, the workers' beats may be newer.
    step = max([step] + [int(b[BEAT_GLOBAL_STEP]) for b, _, _ in seen.values() if b is not None])
    return observe.describe_server_stall(what, step, stalled_s, peers, culprits)


def worker_stall_line(ctx: Context, stalled_s: float) -> str | None:
    """A worker without progress for --stall-warning seconds while it waits on rank 0 (in an
    Allreduce, or for a --quorum step's update, it waits on other workers: rank 0, which hears
    from all of them, says who)."""
    act, cfg = ctx.activity, ctx.cfg
    waits_on_workers = act.phase == observe.ALLREDUCE or (cfg.mode == "sync" and act.phase == observe.WAIT)
    if waits_on_workers or act.phase in (observe.COMPUTE, observe.IDLE):
        return None
    seen = ctx.watch.seen()
    silent_after = liveness.silent_after(cfg.worker_timeout)
    ps = ("--worker-timeout 0: no heartbeats say what rank 0 does" if PS_RANK not in seen
          else observe.peer_state(PS_RANK, *seen[PS_RANK], silent_after, cfg.worker_timeout))
    return (f"mpitrain: rank {ctx.rank}: no progress for {stalled_s:.0f} s (--stall-warning), in "
            f"{observe.PHASES[act.phase]} waiting on the parameter server at global step {act.step:,}; {ps}")


def _worker_report(ctx: Context, wres: WorkerResult, evaluation: tuple[float, float]) -> WorkerReport:
    """The worker's report to rank 0 (reports.py: JSON bytes on the wire, never pickled)."""
    t = wres.time
    wall = max(t["wall_s"], 1e-9)
    breakdown = {"compute": t["compute_s"] / wall, "communication_and_wait": t["wait_s"] / wall,
                 "other": max(0.0, 1 - (t["compute_s"] + t["wait_s"]) / wall)}
    return WorkerReport(ctx.rank, wres.pushed, wres.dropped, as_dict(wres.diverged), wres.contributed, evaluation[0],
                        evaluation[1], digest(wres.params), breakdown, ctx.activity.report(), stop_signal=STOP.signum)


def build_summary(ctx: Context, mine: RoleResult, reports: list, placements: list[str],
                  diverged: Diverged | None, joins: list[dict] = ()) -> Summary:
    cfg, state = ctx.cfg, mine.state
    workers = [r for r in reports if isinstance(r, WorkerReport)]
    shards = [shard_report(ctx, state)] + [r for r in reports if isinstance(r, ShardReport)]
    lost = state.lost_workers
    if cfg.mode == "sync" or ctx.local:  # gradients each worker had in the averaged updates
        local_steps = [w.contributed for w in workers]
    else:  # rank 0 counts by worker index; the summary's lists follow worker_ranks, the lost apart
        index = ctx.layout.worker_index
        local_steps = [state.local_steps[index(w.rank)] for w in workers]
        lost = [x if "local_steps" in x else {**x, "local_steps": state.local_steps[index(x["rank"])]} for x in lost]
    trained = not nothing_to_train(ctx)
    quorum = None
    if cfg.mode == "sync" and not ctx.local:
        quorum = cfg.quorum if cfg.quorum is not None else ctx.workers
    samples = (state.global_step - state.start_step) * ctx.global_batch  # this run only, when resumed
    step_times, slow = observe.attribute({w.rank: w.step_time for w in workers}, cfg.straggler_report)
    return Summary(
        mpitrain_version=__version__,
        mode="local" if ctx.local else cfg.mode,
        model=model_name(cfg.model),
        model_description=ctx.model.description,
        dataset=ctx.data.name,
        world_size=ctx.size,
        workers=ctx.workers,
        global_step=state.global_step,
        local_steps=local_steps,
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
        max_rss_mb=[{"rank": 0, "start": mine.max_rss_mb[0], "end": mine.max_rss_mb[1]}]
        + [{"rank": w.rank, "start": w.max_rss_mb[0], "end": w.max_rss_mb[1]} for w in workers
           if w.max_rss_mb],  # a local run's own worker report has none: its rank is 0, above
        dropped_gradients=sum(w.dropped for w in workers),
        dropped_gradients_per_worker=[w.dropped for w in workers],
        staleness=staleness_summary(state.staleness),
        quorum=quorum,
        lr_scaling="linear" if cfg.scaled_lr else "none",
        lr_effective=cfg.learning_rate * ctx.lr_scale,  # after the warm-up, before --lr-decay
        steps_per_second=state.global_step / max(state.train_s, 1e-9) if trained else None,
        eval_history=state.eval_history,
        param_digest=digest(state.params),
        worker_param_digests=[w.digest for w in workers],
        time_breakdown=[w.time_breakdown for w in workers],
        worker_step_seconds=step_times,
        slow_workers=slow,
        ps_busy_fraction=None if ctx.local else state.busy_fraction,
        num_ps=len(ctx.layout.server_ranks),
        ps_shards=[] if ctx.local else [r.entry() for r in shards],
        resumed_from=state.resumed_from,
        checkpoints=mine.checkpoints,
        placement=placements,
        config=as_record(cfg),
        diverged=None if diverged is None else {k: v for k, v in as_dict(diverged).items() if k != "mine"},
        stopped=stop_record(ctx, state, reports, diverged),
        write_errors=WRITES.report(),
        trained=trained,
    )


def stop_record(ctx: Context, state, reports: list, diverged: Diverged | None) -> dict | None:
    """Rank 0: whether a stop request ended the run before its budget, and by which signal (its
    own, or the one a reporting rank received). A run that reached its budget anyway is done."""
    if diverged or not STOP.requested or state.global_step >= ctx.global_step_budget:
        return None
    signum = STOP.signum or next((r.stop_signal for r in reports if r.stop_signal), 0) or int(signal.SIGTERM)
    STOP.request(signum)  # the goodbye tells the workers which one (their exit code)
    return {"signal": signal_name(signum), "global_step": state.global_step,
            "resume": resume_hint(ctx, 0) if ctx.cfg.checkpoint_dir else "no --checkpoint-dir: nothing was saved"}


def run(cfg: TrainConfig | None, comm, node: Node, err: str | None, library: bool = False) -> Outcome:
    """One training run on this rank, in phases: agree on the set-up, connect (communicators,
    start lines, heartbeats), train in this rank's role and report to rank 0, publish the summary
    (rank 0) or wait for its goodbye, then wind down. The command line ends the process with the
    code (and MPI with MPI_Finalize); the Python API (`library`) keeps MPI for the next run.
    SIGINT, SIGTERM and SIGUSR1 stop training at a step boundary meanwhile (stopping.py)."""
    restore = stopping.install()
    outputs.reset()
    carry = join.Carry()
    try:
        if err is None and cfg is not None and cfg.join:
            try:
                cfg, comm, node = joined(cfg, comm, carry)
            except UsageError as e:
                line = f"mpitrain: error: {e}"
                say(line, sys.stderr)
                return Outcome(ExitCode.USAGE, error=line)
            if comm is None:
                line = "mpitrain: the job ended before it could make room for this worker"
                say(line, sys.stderr)
                return Outcome(ExitCode.FAILED, error=line)
        while True:  # one phase, and one more each time a worker joins (join.py)
            outcome = _run(cfg, comm, node, err, library, carry)
            if outcome.grown is None:
                return outcome
            cfg, comm, node = outcome.grown
    finally:
        carry.outputs.close_bar()  # a run that ended early (a lost peer, a failure): the bar's line stays
        carry.formed()
        if carry.token is not None:
            join.withdraw_token(cfg)
        lock.release_all()
        if library:
            restore()


def joined(cfg: TrainConfig, comm, carry: join.Carry) -> tuple[TrainConfig, object, Node]:
    """--join: this process asks the running job to let it in, and waits until it has made room.
    Returns the next phase's flags, the new world (None: the job ended first) and its node."""
    if comm.Get_size() != 1:
        raise UsageError(f"--join starts one worker, but MPI started {comm.Get_size()}: run it under mpirun -np 1")
    from mpitrain.runtime import make_model
    from mpitrain.data import load_dataset

    def mine() -> dict:
        return identity_of(cfg, make_model(cfg, load_dataset(cfg), np))

    if join.spawned():  # started by the job itself (--respawn): it waits in the new world already
        world, budget = join.join_spawned(carry, mine)
    else:
        world, budget = join.join_job(cfg, mine(), carry)
    if world is None:
        return cfg, None, None
    carry.budget, carry.joiner = budget, True
    if not STOP.signum:
        STOP.reset()
    return carry.next_config(cfg), world, node_info(world)


def _run(cfg: TrainConfig | None, comm, node: Node, err: str | None, library: bool, carry: join.Carry) -> Outcome:
    ctx, line = agree_on_setup(cfg, comm, node, err)
    if ctx is None:
        return Outcome(ExitCode.USAGE, error=line)
    ctx, placements, heartbeat = connect(dataclasses.replace(ctx, outputs=carry.outputs), regrown=carry.start_step is not None)
    carry.formed()  # heartbeats run: a rank lost from here is seen as in any phase
    if carry.budget is None:
        carry.budget = ctx.global_step_budget  # the job's, whoever joins later
    lobby = open_lobby(ctx, carry)
    try:
        mine, reports = train_and_report(ctx, carry)
    except PeerLost as e:
        return peer_lost(ctx, e, library)
    except ProtocolError as e:
        say(f"mpitrain: rank {ctx.rank}: wire-format error: {e}", sys.stderr)
        lock.release_all()
        mpiimpl.abort(comm, ExitCode.PROTOCOL, ctx.worker_comm)
        return Outcome(ExitCode.PROTOCOL)
    except Exception:
        sys.stderr.write(f"mpitrain: rank {ctx.rank} failed:\n{traceback.format_exc()}")
        sys.stderr.flush()
        lock.release_all()
        mpiimpl.abort(comm, ExitCode.FAILED, ctx.worker_comm)  # peers may wait on this rank: end the job, never hang
        return Outcome(ExitCode.FAILED)
    diverged = _divergence(ctx, mine, reports)
    summary = None
    if ctx.rank == PS_RANK:
        if lobby is not None and (lobby.joiner is not None or lobby.spawn):
            why = no_room(ctx, mine, reports, diverged)
            if why is None:
                return make_room(ctx, mine, reports, heartbeat, carry, lobby)
            lobby.release(why)
        carry.into(mine.state)
        summary, peer_was_lost = publish(ctx, mine, reports, placements, diverged, carry.joins)
    else:
        try:
            bye = await_goodbye(ctx)
        except PeerLost as e:
            return peer_lost(ctx, e, library)
        if bye.flags & FLAG_REFORM:
            return grow_with_joiner(ctx, heartbeat, carry, bye)
        peer_was_lost = bool(bye.flags & FLAG_PEER_LOST)
        if not bye.flags & FLAG_STOPPED:
            STOP.reset()  # the run reached its budget anyway: done, not stopped
    outcome = verdict(ctx, mine, reports, summary, diverged)
    if carry.token is not None:  # the job ends: no worker can join it now (this rank may leave without unwinding)
        join.withdraw_token(cfg)
        carry.token = None
    if not retire_heartbeats(ctx, heartbeat) or peer_was_lost or carry.peer_lost:
        if library and not (carry.joiner or carry.with_spawned):  # the caller's process goes on (api.LostPeer)
            outcome.mpi_broken = True
            return outcome
        leave_after_a_loss(carry, outcome.code)
        finalize(ctx, outcome.code)  # a joiner: the dead were never its peers (measured: MPICH finalizes at once)
        after_the_spawned(carry)
        return outcome
    if library:  # MPI stays up for the next run; only this run's communicator goes
        free_worker_comm(ctx)
    else:
        finalize(ctx, outcome.code)
    return outcome


def open_lobby(ctx: Context, carry: join.Carry) -> join.Lobby | None:
    """Rank 0 of a job that can grow: the lobby a worker joins through, looked at with the watch."""
    if ctx.rank != PS_RANK or not join.can_grow(ctx):
        return None
    if carry.token is None:
        try:
            carry.token = join.publish_token(ctx.cfg)
        except OSError as e:  # a full or read-only folder: training goes on, without joins
            say(f"mpitrain: no worker can join this job: its token could not be written to --checkpoint-dir "
                f"{ctx.cfg.checkpoint_dir} ({e.strerror})", sys.stderr)
            return None
        carry.identity = identity(ctx)  # the job's flags as given: a joiner's are compared with these
        carry.job_cfg, carry.respawns_left = ctx.cfg, ctx.cfg.respawn
    ctx.watch.lobby = join.Lobby(ctx, carry)
    return ctx.watch.lobby


def no_room(ctx: Context, mine: RoleResult, reports: list, diverged: Diverged | None) -> str | None:
    """Rank 0: why the job ends rather than going on with the worker it let in, or None."""
    if diverged:
        return "training diverged"
    if STOP.signum or any(r.stop_signal for r in reports):
        return "the job was stopped"
    if mine.state.global_step >= ctx.global_step_budget:
        return "the job finished its budget"
    return None


def make_room(ctx: Context, mine: RoleResult, reports: list, heartbeat, carry: join.Carry,
              lobby: join.Lobby) -> Outcome:
    """Rank 0, the phase over (the checkpoint saved): tell every rank left to form a new world with
    the joiner (the one it let in, or one they start: --respawn) instead of ending, and form it."""
    state = mine.state
    lost = sorted(set(ctx.watch.lost) | {w["rank"] for w in state.lost_workers})
    if ctx.cfg.mode == "async":  # the summary's count of each lost worker's gradients, by this phase's index
        state.lost_workers = [{**x, "local_steps": state.local_steps[ctx.layout.worker_index(x["rank"])]}
                              for x in state.lost_workers]
    carry.add_phase(state)
    gen = len(carry.joins) + 1
    joiner = lobby.joiner
    how = join.SPAWNED if lobby.spawn else join.CONNECTED if join.still_there(joiner) else join.NOBODY
    peer_was_lost = say_goodbye(ctx, [r.rank for r in reports], bool(lost), False, reform=(gen, lost, how))
    carry.peer_lost |= peer_was_lost or bool(lost)
    argv = carry.spawn_argv() if lobby.spawn else []
    world = _regrow(ctx, heartbeat, carry, lost, gen, how, joiner, argv)
    workers = world.Get_size() - ctx.layout.shards
    if world.Get_size() == ctx.size - len(lost):  # nobody joined: it did not answer, or could not start
        why = "" if how == join.SPAWNED else f"the worker on {joiner.host} (pid {joiner.pid}) did not answer when " \
                                              f"the job had made room; "
        say(f"mpitrain: {why}going on with {workers} worker(s) from global step {state.global_step}")
        return Outcome(ExitCode.OK, grown=(carry.next_config(ctx.cfg), world, node_info(world)))
    host = join.welcome(world, carry) if how == join.SPAWNED else joiner.host
    who = "a worker started in place of the lost one" if how == join.SPAWNED else "the worker"
    carry.joins.append({"rank": world.Get_size() - 1, "global_step": state.global_step, "host": host,
                        "respawned": how == join.SPAWNED})
    say(f"mpitrain: {who} on {host} joined as rank {world.Get_size() - 1} at global step "
        f"{state.global_step}: {workers} worker(s) from here")
    return Outcome(ExitCode.OK, grown=(carry.next_config(ctx.cfg), world, node_info(world)))


def grow_with_joiner(ctx: Context, heartbeat, carry: join.Carry, bye: Message) -> Outcome:
    """A worker (or another server), rank 0's goodbye flagged FLAG_REFORM: into the new world."""
    lost = [int(r) for r in np.flatnonzero(bye.payload)]
    carry.peer_lost |= bool(bye.flags & FLAG_PEER_LOST)
    world = _regrow(ctx, heartbeat, carry, lost, bye.step, bye.local_step, None)
    return Outcome(ExitCode.OK, grown=(carry.next_config(ctx.cfg), world, node_info(world)))


def _regrow(ctx: Context, heartbeat, carry: join.Carry, lost: list[int], gen: int, how: int,
            joiner: join.Joiner | None, argv: list[str] = ()):
    """Every rank left: end this phase's heartbeats and communicators, then the new world (with
    the joiner, unless `how` is join.NOBODY; rank 0 holds its connection, or the spawn's argv)."""
    carry.start_forming(f"rank {ctx.rank}")
    if not retire_heartbeats(ctx, heartbeat):
        carry.peer_lost = True
    free_worker_comm(ctx)
    if not STOP.signum:  # the stop that made room; a signal of this rank's own stops the next phase
        STOP.reset()
    live = [r for r in range(ctx.size) if r not in lost]
    carry.with_spawned |= how == join.SPAWNED
    return join.grow(ctx.comm, live, gen, how, joiner, argv)


def connect(ctx: Context, regrown: bool = False) -> tuple[Context, list[str], liveness.Heartbeat | None]:
    """The last collectives over every rank (the sync workers' communicator, the start lines, the
    start state), then this rank's activity record and heartbeats. Returns the connected context, the start
    lines (rank 0) and the heartbeat thread. `regrown`: rank 0, a phase after a join (join.Carry)."""
    comm, cfg = ctx.comm, ctx.cfg
    worker_comm = None
    if cfg.mode == "sync" and not ctx.local:  # collective on COMM_WORLD: every rank calls it
        worker_comm = comm.Split(MPI.UNDEFINED if ctx.is_ps else 0, ctx.rank)
    placements = comm.gather(ctx.placement(), root=0)
    if ctx.rank == PS_RANK:
        announce(ctx, placements, regrown)
    start = broadcast_start(ctx)
    activity = observe.Activity(cfg.timeline_steps if cfg.timeline else 0)
    heartbeat, watch = liveness.start(comm, ctx.rank, ctx.layout, cfg.worker_timeout, activity)
    ctx = dataclasses.replace(ctx, worker_comm=worker_comm, watch=watch, activity=activity, start=start)
    return ctx, placements, heartbeat


def train_and_report(ctx: Context, carry: join.Carry) -> tuple[RoleResult, list]:
    """Train in this rank's role; rank 0 collects every report (returned), the others send theirs,
    a worker's counting what this process did in the job's earlier phases (a join re-forms it)."""
    rss_start = max_rss_mb()
    mine = train_role(ctx)
    ctx.activity.enter(observe.IDLE)
    ctx.watch.stall = None  # training is over: the end of the run has its own time limits
    mine.max_rss_mb = [rss_start, max_rss_mb()]  # start and end of training (benchmarks/soak.py)
    if ctx.rank == PS_RANK:
        return mine, collect_reports(ctx, mine)
    if mine.shard is not None:
        send_report(ctx, dataclasses.replace(mine.shard, timeline=timeline_events(ctx)))
    else:
        send_report(ctx, dataclasses.replace(carry.whole_job(mine.worker), max_rss_mb=mine.max_rss_mb,
                                             timeline=timeline_events(ctx)))
        Kill(ctx.rank).after_report()
    return mine, []


def publish(ctx: Context, mine: RoleResult, reports: list, placements: list[str],
            diverged: Diverged | None, joins: list[dict]) -> tuple[dict, bool]:
    """Rank 0: the summary (printed, --summary-json, the log's end), the timeline, then the
    goodbyes. Returns the summary and whether a peer turned out to be lost."""
    cfg, state = ctx.cfg, mine.state
    if cfg.timeline:
        try:
            write_timeline(ctx, reports, placements)
        except OSError as e:
            WRITES.failed("timeline", "--timeline", cfg.timeline, e, "the run goes on without it")
    summary = build_summary(ctx, mine, reports, placements, diverged, joins).to_dict()
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
    return summary, say_goodbye(ctx, [r.rank for r in reports], bool(state.lost_workers), bool(summary["stopped"]))


def verdict(ctx: Context, mine: RoleResult, reports: list, summary: dict | None, diverged: Diverged | None) -> Outcome:
    """The exit code and error line of a run that got to its end."""
    own = None if ctx.rank == PS_RANK else dataclasses.asdict(mine.report)
    outcome = Outcome(ExitCode.OK, summary, own)
    if ctx.rank == PS_RANK:
        outcome.params = np.asarray(mine.state.params, np.float32).copy()
        outcome.model = ctx.model.with_backend(np)
    if ctx.rank == PS_RANK and not ctx.local and not any(isinstance(r, WorkerReport) for r in reports):
        outcome.code = ExitCode.PEER_LOST  # every worker was lost: the budget was not finished
        outcome.error = "mpitrain: every worker was lost"
    elif ctx.rank == PS_RANK and mine.state.lost_workers:
        outcome.code = ExitCode.WORKER_LOST
        lost = ", ".join(f"rank {w['rank']}" for w in mine.state.lost_workers)
        outcome.error = f"mpitrain: the budget was finished without lost worker(s) {lost} (exit 8)"
    stopped = summary["stopped"] if ctx.rank == PS_RANK else STOP.requested
    if stopped and not diverged:
        outcome.code = interrupted(STOP.signum or int(signal.SIGTERM))
        outcome.error = (summary_stop_line(summary) if ctx.rank == PS_RANK else
                         f"mpitrain: stopped ({signal_name(STOP.signum)}); rank 0 saved the run")
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


def retire_heartbeats(ctx: Context, heartbeat) -> bool:
    """Each rank's last beat closes its peers' receive. False when a peer died meanwhile, which
    makes MPI_Finalize unsafe (it would wait for the dead)."""
    ok = True
    if heartbeat and not heartbeat.close(set(ctx.watch.lost)):  # every lost rank was declared there
        ok = False
    if not ctx.watch.close():
        ok = False
    return ok


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


def finalize(ctx: Context, code: int) -> None:
    """Free the worker communicator and call MPI_Finalize, both of which may wait for every rank:
    a peer that dies after rank 0's goodbye (measured by benchmarks/chaos.py: a worker killed
    during the end of the run) would hold them forever, and nobody is left to notice. Past
    --worker-timeout this rank says so in one line and leaves with its own exit code."""
    grace = max(ctx.cfg.worker_timeout, FINALIZE_MIN_S)
    guard = None
    if ctx.cfg.worker_timeout > 0:
        guard = threading.Timer(grace, _finalize_stuck, (ctx.rank, grace, code))
        guard.daemon = True
        guard.start()
    free_worker_comm(ctx)
    _finalize_releasing_the_gil()
    if guard is not None:
        guard.cancel()


def free_worker_comm(ctx: Context) -> None:
    if ctx.worker_comm is not None and ctx.worker_comm != MPI.COMM_NULL:
        ctx.worker_comm.Free()


def _finalize_releasing_the_gil() -> None:
    """mpi4py's MPI.Finalize holds the GIL while it waits, so no Python thread (the guard above)
    could run meanwhile (measured: the guard never fired). ctypes releases the GIL around a
    foreign call; the symbol is looked up through mpi4py's own extension module, which links the
    MPI library it was built with. mpi4py's exit hook then sees MPI finalized and does nothing."""
    import ctypes

    try:
        mpi_finalize = ctypes.CDLL(MPI.__file__).MPI_Finalize
    except (OSError, AttributeError):  # an unusual build: finalize the usual way, unguarded
        MPI.Finalize()
        return
    mpi_finalize()


def _finalize_stuck(rank: int, grace: float, code: int) -> None:
    say(f"mpitrain: rank {rank}: MPI_Finalize still waiting after {grace:g} s (a peer died after training "
        f"ended); leaving without it", sys.stderr)
    exit_without_finalize(code)


def announce(ctx: Context, placements: list[str], regrown: bool = False) -> None:
    """Rank 0, before training: where every rank runs, and what this run starts from (after a
    join: the checkpoint saved to make room, which is no resume of the user's)."""
    cfg = ctx.cfg
    for line in placements:
        say(line)
    if ctx.local:
        say("mpitrain: one process: training locally with no parameter server "
            "(mpirun -np 3 gives 1 parameter server + 2 workers)")
    lr = cfg.learning_rate
    line = f"mpitrain: {cfg.optimizer}, learning rate {lr:g} " + (
        "(--lr)" if cfg.lr is not None else f"({cfg.optimizer}'s default; --lr sets another)")
    if ctx.lr_scale > 1:
        warm = f"after a {cfg.warmup_epochs:g}-epoch warm-up" if cfg.warmup_epochs > 0 else "from the first step"
        line += (f"; sync: learning rate {lr:g} x {ctx.lr_scale} gradients per update = {lr * ctx.lr_scale:g} "
                 f"{warm} (--lr-scaling none keeps {lr:g})")
    say(line)
    for note in ctx.data.notes:  # e.g. a class that never occurs in training
        say(note, sys.stderr)
    if ctx.resume:
        path, st = ctx.resume
        WRITES.newest_checkpoint = str(path)
        say(f"mpitrain: training on from {path} (global step {st.global_step}), saved to make room" if regrown
            else f"mpitrain: resuming from {path} (global step {st.global_step}); --fresh starts over")
    elif cfg.fresh and cfg.checkpoint_dir:
        moved = checkpoint.set_aside(Path(cfg.checkpoint_dir))
        if moved:
            say(f"mpitrain: --fresh: earlier checkpoints kept in {moved}")


def send_report(ctx: Context, report: WorkerReport | ShardReport) -> None:
    """A worker's (or server's) end-of-run report to rank 0: JSON bytes, point to point, so that it
    works with a peer lost (a collective would wait for the dead); watched, like every wait."""
    data = to_bytes(report)
    Poller(END_POLL_S, ctx.watch).all([ctx.comm.Isend([data, MPI.BYTE], dest=PS_RANK, tag=TAG_REPORT)], [PS_RANK])


def collect_reports(ctx: Context, mine: RoleResult) -> list:
    """Rank 0: every live worker's WorkerReport (and its own, when local) and every other server's
    ShardReport, by rank. A worker lost before reporting, or while sending its report, is
    recorded in lost_workers and left out; so is one whose report has not come --worker-timeout
    seconds after training ended."""
    state = mine.state
    got = [mine.worker] if mine.worker is not None else []
    timeout = ctx.cfg.worker_timeout
    poller = Poller(END_POLL_S, ctx.watch)
    others = set(ctx.layout.worker_ranks) | set(ctx.layout.server_ranks)
    pending = others - {ctx.rank} - {info["rank"] for info in state.lost_workers}

    def all_in() -> bool:
        """Take the reports that have come; a lost sender is recorded, not waited for."""
        try:
            for rank in sorted(pending):
                report = _take_report(ctx, rank, poller)
                if report is not None:
                    got.append(report)
                    ctx.watch.forget(rank)
                    pending.discard(rank)
            ctx.watch.check()
        except PeerLost as e:
            for rank, why in e.lost.items():
                record_lost(state, rank, why)
                pending.discard(rank)
        return not pending

    if not poll(all_in, END_POLL_S, deadline=time.monotonic() + timeout if timeout > 0 else None):
        for rank in sorted(pending):
            ctx.watch.declare(rank, "no report")
            record_lost(state, rank, f"no report {timeout:g} s after training ended")
    return sorted(got, key=lambda r: r.rank)


def _take_report(ctx: Context, rank: int, poller: Poller) -> WorkerReport | ShardReport | None:
    """`rank`'s report if it has started to arrive (then wait for all of it), else None. Its
    size comes from the probe; a sender that dies mid-message raises PeerLost."""
    status = MPI.Status()
    try:
        if not ctx.comm.Iprobe(source=rank, tag=TAG_REPORT, status=status):
            return None
    except MPI.Exception as e:
        raise PeerLost({rank: mpi_error_reason(str(e))}) from e
    buf = bytearray(status.Get_count(MPI.BYTE))
    poller.all([ctx.comm.Irecv([buf, MPI.BYTE], source=rank, tag=TAG_REPORT)], [rank])
    return from_bytes(buf)


def say_goodbye(ctx: Context, ranks: list[int], peer_was_lost: bool, stopped: bool,
                reform: tuple[int, list[int], int] | None = None) -> bool:
    """Rank 0, after the summary: release the workers, telling them whether MPI_Finalize is safe
    and whether the run stopped on request (the header says by which signal); or, when a worker
    joins (`reform`: the join's number, the ranks lost, who joins: join.NOBODY/CONNECTED/SPAWNED), that
    they go on in a new world without the lost. True when a worker turned out to be lost meanwhile."""
    bye = Message(ctx.size)
    bye.payload[:] = 0
    flags = (FLAG_PEER_LOST if peer_was_lost else 0) | (FLAG_STOPPED if stopped else 0)
    if reform is not None:
        bye.payload[reform[1]] = 1
        flags |= FLAG_REFORM
    bye.stamp(TAG_REPORT, reform[0] if reform else 0, reform[2] if reform else 0, flags=flags)
    ranks = [r for r in ranks if r != ctx.rank]  # a local run's own report is among them
    try:
        Poller(END_POLL_S, ctx.watch).all([ctx.comm.Isend(bye.spec(), dest=r, tag=TAG_REPORT) for r in ranks], ranks)
    except PeerLost:
        return True
    return peer_was_lost


def await_goodbye(ctx: Context) -> Message:
    """A worker: wait (watching rank 0) until rank 0 is done; the goodbye (its flags: FLAG_PEER_LOST,
    FLAG_STOPPED, FLAG_REFORM)."""
    bye = Message(ctx.size)
    Poller(END_POLL_S, ctx.watch).all([ctx.comm.Irecv(bye.spec(), source=PS_RANK, tag=TAG_REPORT)], [PS_RANK])
    bye.check(TAG_REPORT, PS_RANK)
    return bye


def peer_lost(ctx: Context, e: PeerLost, library: bool = False) -> Outcome:
    """A rank this one cannot go on without is lost: say so in one line and end this rank (the
    Python API's worker: return, MPI unusable from here on). Rank 0 (sync: a collective cannot
    finish without the worker) ends the whole job."""
    who = "; ".join(f"rank {r}: {why}" for r, why in e.lost.items())
    lay = ctx.layout
    shards = [r for r in e.lost if lay.is_server(r) and r != PS_RANK]
    if ctx.rank == PS_RANK:
        if shards:
            which = "; ".join(f"{lay.shard_index(r)}/{lay.shards} (rank {r}: {e.lost[r]})" for r in shards)
            say(f"mpitrain: error: lost parameter-server shard {which}. Training cannot go on without "
                f"that part of the parameters; {resume_hint(ctx, 0)}", sys.stderr)
        else:
            gone = set(e.lost) | set(ctx.watch.lost)  # with the ones lost earlier, when the others regrouped
            left = len([r for r in ctx.layout.worker_ranks if r not in gone])
            say(f"mpitrain: error: lost worker {who}. {why_it_ends(ctx, left)}; "
                f"{resume_hint(ctx, len(gone))}", sys.stderr)
        if mpiimpl.ends_job_on_error_exit():
            # Open MPI under ULFM: MPI_Abort ended mpirun but left the workers running (measured), and
            # they all end here too (ULFM fails their collective): meet them, so each line gets out.
            mpiimpl.farewell(ctx.comm, ctx.cfg.worker_timeout)
            exit_without_finalize(ExitCode.PEER_LOST)
        # MPI_Abort makes hydra kill every rank, and its proxy may do that before it forwards this
        # line (measured: the line missing in 1 run of ~40). Give it a moment first.
        time.sleep(ABORT_FLUSH_S)
        lock.release_all()
        mpiimpl.abort(ctx.comm, ExitCode.PEER_LOST, ctx.worker_comm)  # the workers are stuck in the collective
        return Outcome(ExitCode.PEER_LOST)
    whom = "the parameter server" if all(lay.is_server(r) for r in e.lost) else "a peer"
    line = (f"mpitrain: error: rank {ctx.rank} lost {whom} ({who}); stopping. Rank 0's "
            f"newest checkpoint in --checkpoint-dir resumes the run")
    say(line, sys.stderr)
    mpiimpl.farewell(ctx.comm, ctx.cfg.worker_timeout)  # the other survivors' lines too (Open MPI)
    if not library:
        exit_without_finalize(ExitCode.PEER_LOST)
    return Outcome(ExitCode.PEER_LOST, error=line, mpi_broken=True)


def why_it_ends(ctx: Context, left: int) -> str:
    """Why a lost worker ends this job (rank 0's line), `left` workers being left."""
    quorum = ctx.cfg.quorum
    if ctx.why_no_regroup:
        return ctx.why_no_regroup
    if quorum and left < quorum:
        return f"Fewer than --quorum {quorum} workers are left"
    if left < 1:
        return "No worker is left"
    return "A second worker was lost while the others regrouped"


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


def max_rss_mb() -> float:
    """This process's peak resident memory so far (Linux reports KiB)."""
    import resource

    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def leave_after_a_loss(carry: join.Carry, code: int) -> None:
    """The end of a run that lost a peer: leave without MPI_Finalize (it would wait for the dead),
    or return to call it. A joiner calls it: its own launcher ran without the keep-going flag and
    would kill it otherwise (exit 9). With a spawned worker the MPI decides (mpiimpl.Impl)."""
    impl = mpiimpl.running()
    if carry.with_spawned:
        finalizes = impl is not None and impl.finalize_with_spawned
    else:
        finalizes = carry.joiner
    if not finalizes:
        after_the_spawned(carry)
        exit_without_finalize(code)


def after_the_spawned(carry: join.Carry) -> None:
    """The job's own ranks leave join.SPAWNED_LEAVES_FIRST_S after a spawned worker (--respawn)."""
    if carry.with_spawned and not carry.spawned:
        time.sleep(join.SPAWNED_LEAVES_FIRST_S)


def _divergence(ctx: Context, mine: RoleResult, reports: list) -> Diverged | None:
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
