"""One training run on one rank: agree on setup, train in the rank's role, evaluate, report."""

from __future__ import annotations

import dataclasses
import sys
import traceback

import numpy as np
from mpi4py import MPI

from mpitrain.agreement import agree_on_setup
from mpitrain.core.config import TrainConfig, UsageError
from mpitrain.core.console import say
from mpitrain.core.exitcodes import ExitCode
from mpitrain.core.layout import CHIEF, SERVER
from mpitrain.core.reports import Outcome, RoleResult, WorkerResult
from mpitrain.duties import observe, outputs
from mpitrain.duties.chief import begin
from mpitrain.duties.metrics import Progress
from mpitrain.duties.summary import announce, divergence, publish, shard_report, timeline_events, verdict, worker_report
from mpitrain.ending import (abort_job, await_goodbye, collect_reports, finalize, free_worker_comm, peer_lost,
                             retire_heartbeats, say_goodbye, send_report)
from mpitrain.exchange.protocol import FLAG_PEER_LOST, FLAG_REFORM, FLAG_STOPPED, ProtocolError
from mpitrain.launch import lock, supervise
from mpitrain.membership import join, liveness, spares, stopping
from mpitrain.launch.faults import Kill
from mpitrain.membership.liveness import PeerLost
from mpitrain.membership.stalls import server_stall_line, worker_stall_line
from mpitrain.phases import (after_the_spawned, grow_with_joiner, joined, leave_after_a_loss, make_room, no_room,
                             open_lobby, take_over, with_spares)
from mpitrain.node import Node
from mpitrain.runtime import PS_RANK, Context, broadcast_start, nothing_to_train


def _evaluate(ctx: Context, params_host: np.ndarray) -> tuple[float, float]:
    be = ctx.backend
    loss, acc, _ = ctx.model.evaluate(be.asarray(params_host), be.asarray(ctx.data.x_test), be.asarray(ctx.data.y_test))
    return loss, acc


def train_role(ctx: Context) -> RoleResult:
    """Run this rank's part (its mode's loop for its role, modes/); return what it reports to rank
    0 (rank 0 also keeps its state)."""
    cfg, mode = ctx.cfg, ctx.mode
    if nothing_to_train(ctx):
        return already_trained(ctx)
    role = ctx.role
    if role == SERVER:  # --num-ps: a server of one shard, reporting to rank 0
        return RoleResult(shard=shard_report(ctx, mode.run(ctx).state))
    if role == CHIEF:
        # The job's one bar: a later phase (a join, a respawn) goes on with it; closed by publish.
        progress = ctx.outputs.progress or Progress(cfg.progress, ctx.global_step_budget, ctx.global_batch)
        ctx.outputs.progress = progress
        stall = None
        if cfg.stall_warning > 0 and not ctx.single:
            stall = observe.Stall(cfg.stall_warning, lambda: progress.step,
                                  lambda stalled_s: server_stall_line(ctx, progress.step, stalled_s))
        try:
            with ctx.watch.during(stall):  # training only: the end of the run has its own time limits
                trained = mode.run(ctx, progress)
            if stall is not None:
                stall.finish()
        except BaseException:  # the line that says why comes next, under the bar's last line
            ctx.outputs.close_bar()
            raise
        state = trained.state
        ctx.activity.enter(observe.EVAL, state.global_step)
        loss, acc = _evaluate(ctx, state.params)
        mine = RoleResult(state, loss, acc, _evaluate(ctx, state.ema) if state.ema is not None else (None, None))
        if trained.worker is not None:  # local: rank 0 is also the one worker
            mine.worker = worker_report(ctx, trained.worker, (loss, acc))
        return mine
    stall = None
    if cfg.stall_warning > 0:
        stall = observe.Stall(cfg.stall_warning, lambda: ctx.activity.gradients,
                              lambda stalled_s: worker_stall_line(ctx, stalled_s))
    with ctx.watch.during(stall):
        wres = mode.run(ctx).worker
    if stall is not None:
        stall.finish()
    ctx.activity.enter(observe.EVAL)
    return RoleResult(worker=worker_report(ctx, wres, _evaluate(ctx, wres.params)), held=wres.train_state)


def already_trained(ctx: Context) -> RoleResult:
    """A run with nothing to train: each rank evaluates what it starts from, and reports as usual."""
    start = ctx.start
    if ctx.is_ps or ctx.single:
        _, state, ckpt = begin(ctx)
        state.ema = start.ema
        if ctx.handover is not None:  # rank 0 was lost before its final save: the successor makes it
            ckpt.mark(-1)  # begin marked the start step as saved
            ckpt.save(start, final=True)
        if ctx.rank != PS_RANK:
            return RoleResult(shard=shard_report(ctx, state))
        loss, acc = _evaluate(ctx, state.params)
        mine = RoleResult(state, loss, acc, _evaluate(ctx, state.ema) if state.ema is not None else (None, None))
        if ctx.single:
            mine.worker = worker_report(ctx, idle_result(ctx), (loss, acc))
        return mine
    return RoleResult(worker=worker_report(ctx, idle_result(ctx), _evaluate(ctx, start.params)))


def idle_result(ctx: Context) -> WorkerResult:
    """What a worker that trained no step reports: its parameters are the start state's."""
    return WorkerResult(0, ctx.start.params, ctx.activity.times(), contributed=0 if ctx.mode.averages else None)


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
        if err is None and cfg is not None and cfg.spares and not cfg.join:  # collective over COMM_WORLD, first thing
            try:
                cfg, comm, node = with_spares(cfg, comm, node, carry, library)
            except UsageError as e:
                line = f"mpitrain: error: {e}"
                say(line, sys.stderr)
                return Outcome(ExitCode.USAGE, error=line)
            if comm is None:  # a spare the job ended without (the code it leaves with); the API's result says so
                return Outcome(node, report={"rank": MPI.COMM_WORLD.Get_rank(), "spare": True, "joined": False},
                               mpi_broken=library and carry.peer_lost)
        if err is None and cfg is not None and cfg.join:
            try:
                cfg, comm, node = joined(cfg, comm, carry)
            except UsageError as e:
                line = f"mpitrain: error: {e}"
                say(line, sys.stderr)
                return Outcome(ExitCode.USAGE, error=line)
            except MPI.Exception as e:  # a rank of the world it joins died as it formed (ULFM)
                carry.failed_forming(e)
                raise
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
        spares.dismiss_all(carry.peer_lost)  # rank 0: any spare still waiting (ended before its goodbye: usage, API)
        carry.outputs.close_bar()  # a run that ended early (a lost peer, a failure): the bar's line stays
        carry.formed()
        if carry.token is not None:
            join.withdraw_token(cfg)
        lock.release_all()
        if library:
            restore()


def _run(cfg: TrainConfig | None, comm, node: Node, err: str | None, library: bool, carry: join.Carry) -> Outcome:
    try:
        return _phase(cfg, comm, node, err, library, carry)
    except MPI.Exception as e:  # a rank died in the collectives that start a phase after a join or a take-over
        carry.failed_forming(e)
        if carry.first_step is None and not library:  # ... or the job's first (Open MPI's ULFM reports it)
            lost_at_start_up(comm, e)
        raise


def lost_at_start_up(comm, error: Exception) -> None:
    """A rank died in the start-up collectives (the setup agreement, the first broadcast), before the
    heartbeats that let a job go on without it: every rank left ends in one line (it was a traceback on
    each, issue 82). Under hydra a rank killed then takes the job down through its supervisor instead
    (supervise.killed_during_start_up), since MPICH's collectives never notice it."""
    say(f"mpitrain: rank {comm.Get_rank()}: a rank was lost while the job started ({error}); ending (the same "
        f"command starts the job again)", sys.stderr)
    lock.exit_without_finalize(ExitCode.PEER_LOST)


def _phase(cfg: TrainConfig | None, comm, node: Node, err: str | None, library: bool, carry: join.Carry) -> Outcome:
    ctx, line = agree_on_setup(cfg, comm, node, err, quiet=library, data=carry.data)
    if ctx is None:
        if carry.peer_lost and not library:  # a phase after a take-over refused (a lock held): MPI_Finalize would wait
            leave_after_a_loss(carry, ExitCode.USAGE)
        return Outcome(ExitCode.USAGE, error=line)
    carry.data = ctx.data
    if carry.handover is not None:  # the phase after a take-over: rank 0 starts from the survivors' state
        if ctx.rank == PS_RANK:
            ctx = dataclasses.replace(ctx, resume=None, handover=carry.handover)
        carry.handover = None
    try:
        ctx, placements, heartbeat = connect(dataclasses.replace(ctx, outputs=carry.outputs), carry)
    except MPI.Exception as e:
        liveness.end_if_aborted(str(e))  # the rank that failed here aborted the job; else a rank died (_run)
        raise
    except Exception:  # its collectives: the others would wait in them for good (a --seed NumPy refused did)
        return failed(ctx)
    carry.formed()  # heartbeats run: a rank lost from here is seen as in any phase
    supervise.started()  # ... and under hydra its supervisor no longer ends the job for it
    if carry.first_step is None:
        carry.first_step = ctx.start.global_step
    if carry.budget is None:
        carry.budget = ctx.global_step_budget  # the job's, whoever joins later
    lobby = open_lobby(ctx, carry, heartbeat)
    try:
        with ctx.watch.during(lobby):  # rank 0: a worker asking to join is looked at in every wait until the reports are in
            mine, reports = train_and_report(ctx, carry)
    except PeerLost as e:
        return take_over(ctx, e, heartbeat, carry, library) or peer_lost(ctx, e, library)
    except ProtocolError as e:
        say(f"mpitrain: rank {ctx.rank}: wire-format error: {e}", sys.stderr)
        return abort_job(ctx, ExitCode.PROTOCOL)
    except Exception:
        return failed(ctx)
    diverged = divergence(ctx, mine, reports)
    summary = None
    if ctx.rank == PS_RANK:
        if lobby is not None and lobby.pending(mine.state.lost_workers):
            why = no_room(ctx, mine, reports, diverged)
            if why is None:
                lobby.settle()
            if why is None and (lobby.joiner is not None or lobby.spawn):
                return make_room(ctx, mine, reports, heartbeat, carry, lobby)
            lobby.release(why or "the worker was lost as training ended", mine.state.lost_workers)
        carry.into(mine.state)
        lost_a_spare = carry.spares is not None and carry.spares.lost_one  # in every COMM_WORLD: MPI_Finalize waits
        carry.peer_lost |= lost_a_spare
        summary = publish(ctx, mine, reports, placements, diverged, carry.joins, carry.failovers)
        peer_was_lost = say_goodbye(ctx, [r.rank for r in reports], bool(mine.state.lost_workers) or lost_a_spare,
                                    bool(summary["stopped"]))
        spares.dismiss_all(peer_was_lost or carry.peer_lost)  # --spares: the job ends; they leave as its ranks do
    else:
        try:
            bye = await_goodbye(ctx)
        except PeerLost as e:
            held_at_the_end(e, mine)
            return take_over(ctx, e, heartbeat, carry, library) or peer_lost(ctx, e, library)
        if bye.flags & FLAG_REFORM:
            return grow_with_joiner(ctx, heartbeat, carry, bye)
        peer_was_lost = bool(bye.flags & FLAG_PEER_LOST)
        if not bye.flags & FLAG_STOPPED:
            ctx.stop.reset()  # the run reached its budget anyway: done, not stopped
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


def failed(ctx: Context) -> Outcome:
    """An unexpected exception on this rank (a bug): its traceback, then every rank ends (MPI_Abort)."""
    sys.stderr.write(f"mpitrain: rank {ctx.rank} failed:\n{traceback.format_exc()}")
    return abort_job(ctx, ExitCode.FAILED)


def connect(ctx: Context, carry: join.Carry) -> tuple[Context, list[str], liveness.Heartbeat | None]:
    """The last collectives over every rank (the sync workers' communicator, the start lines, the
    start state, rank 0's record of the earlier phases), then this rank's activity record and
    heartbeats. Returns the connected context, the start lines (rank 0) and the heartbeat thread."""
    regrown = carry.start_step is not None  # rank 0: a phase after a join or a take-over
    comm, cfg = ctx.comm, ctx.cfg
    worker_comm = None
    if ctx.mode.worker_comm:  # collective on COMM_WORLD: every rank calls it
        worker_comm = comm.Split(MPI.UNDEFINED if ctx.is_ps else 0, ctx.rank)
    placements = comm.gather(ctx.placement(), root=0)
    if ctx.rank == PS_RANK:
        announce(ctx, placements, regrown)
    Kill(ctx.rank).connecting()
    start = broadcast_start(ctx)
    carry.share_record(comm, ctx.rank == PS_RANK)
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
    mine.max_rss_mb = [rss_start, max_rss_mb()]  # start and end of training (benchmarks/soak.py)
    if ctx.rank == PS_RANK:
        return mine, collect_reports(ctx, mine)
    if mine.shard is not None:
        send_report(ctx, dataclasses.replace(mine.shard, timeline=timeline_events(ctx)))
        return mine, []
    try:
        send_report(ctx, dataclasses.replace(carry.whole_job(mine.worker), max_rss_mb=mine.max_rss_mb,
                                             timeline=timeline_events(ctx)))
    except PeerLost as e:
        held_at_the_end(e, mine)
        raise
    Kill(ctx.rank).after_report()
    return mine, []


def held_at_the_end(e: PeerLost, mine: RoleResult) -> None:
    """Rank 0 lost after this worker's training: a take-over (failover.py) starts from its final state."""
    if e.state is None and mine.held is not None:
        w = mine.worker  # (the pushes' gradients, in global steps: --local-steps pushes carry H each)
        e.state, e.counts = mine.held, (w.pushed if w.counted is None else w.counted, w.dropped)


def max_rss_mb() -> float:
    """This process's peak resident memory so far (Linux reports KiB)."""
    import resource

    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
