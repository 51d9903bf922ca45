"""The job's phases after the first: a worker joins (--join) or one is started in place of a lost one
(--respawn). Rank 0 makes room at the end of a phase (a checkpoint saved, the goodbye flagged
FLAG_REFORM), every rank left forms the new world with the joiner (join.py), and trainer.run goes
on with the next phase; a run that lost a peer leaves without MPI_Finalize."""

from __future__ import annotations

import sys
import time

import numpy as np
from mpi4py import MPI

from mpitrain.agreement import identity, identity_of
from mpitrain.core.config import TrainConfig, UsageError
from mpitrain.core.console import say
from mpitrain.core.exitcodes import ExitCode
from mpitrain.core.guard import Diverged
from mpitrain.core.reports import Outcome, RoleResult
from mpitrain.core.stop import STOP
from mpitrain.ending import free_worker_comm, retire_heartbeats, say_goodbye
from mpitrain.exchange.protocol import FLAG_PEER_LOST, Message
from mpitrain.exchange.transport import error_text
from mpitrain.launch import faults, mpiimpl, supervise
from mpitrain.launch.lock import exit_without_finalize
from mpitrain.membership import failover, join, spares
from mpitrain.membership.join import why_not_there
from mpitrain.membership.joiner import join_job
from mpitrain.membership.lobby import Lobby
from mpitrain.membership.respawn import join_spawned, spawned, start_worker, welcome
from mpitrain.node import Node, node_info
from mpitrain.runtime import PS_RANK, Context


def joined(cfg: TrainConfig, comm, carry: join.Carry) -> tuple[TrainConfig, object, Node]:
    """--join: this process asks the running job to let it in, and waits until it has made room.
    Returns the next phase's flags, the new world (None: the job ended first) and its node."""
    if comm.Get_size() != 1:
        raise UsageError(f"--join starts one worker, but MPI started {comm.Get_size()}: run it under mpirun -np 1")
    from mpitrain.runtime import load_inputs, make_model

    def mine() -> dict:
        if spawned():
            faults.slow_setup()
        carry.data = load_inputs(cfg)  # its first phase uses it (trainer._phase)
        return identity_of(cfg, make_model(cfg, carry.data, np))

    if spawned():  # started by the job itself (--respawn): it waits in the new world already
        world, budget = join_spawned(carry, mine)
    else:
        world, budget = join_job(cfg, mine(), carry)
    if world is None:
        return cfg, None, None
    carry.budget, carry.joiner = budget, True
    STOP.room_made()  # the room rank 0 made for this process (heard in its messages)
    return carry.next_config(cfg), world, node_info(world)


def with_spares(cfg: TrainConfig, comm, node: Node, carry: join.Carry, library: bool = False):
    """--spares N (spares.py), first thing: the job's world without the spares, (cfg, comm, node) for
    the rest of the run. Rank 0 keeps the pool (carry.spares). A spare waits: (the next phase's flags,
    the world it is let into, its node), or (cfg, None, the exit code) when the job ended without it."""
    job, side = spares.split(cfg, comm, carry)
    if job is not None:
        carry.spares = side
        if side is not None:
            say(f"mpitrain: {side.describe()}; a lost worker's place goes to one of them (--spares)")
        return cfg, job, node_info(job)
    from mpitrain.runtime import load_inputs

    supervise.started()  # a spare waits from here: the job goes on without it (rank 0 drops it in one line)

    def mine() -> None:
        carry.data = load_inputs(cfg)  # its first phase uses it (trainer._phase), as a joiner's

    got = spares.stand_by(cfg, side, carry, mine, library)
    if isinstance(got, int):
        return cfg, None, got
    carry.budget, world = got
    return carry.next_config(cfg), world, node_info(world)


def open_lobby(ctx: Context, carry: join.Carry, heartbeat=None) -> Lobby | None:
    """Rank 0 of a job that can grow: the lobby a worker joins through (the phase's waits look at it)."""
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
    lobby = Lobby(ctx, carry, heartbeat)
    lobby.owe(carry.owed)
    carry.owed = 0
    return lobby


def no_room(ctx: Context, mine: RoleResult, reports: list, diverged: Diverged | None) -> str | None:
    """Rank 0: why the job ends rather than going on with the worker it let in, or None."""
    if diverged:
        return "training diverged"
    if ctx.stop.requested or any(r.stop_signal for r in reports):
        return "the job was stopped"
    if ctx.budget_reached(mine.state):
        return "the job finished its budget"
    return None


def make_room(ctx: Context, mine: RoleResult, reports: list, heartbeat, carry: join.Carry,
              lobby: Lobby) -> Outcome:
    """Rank 0, the phase over (the checkpoint saved): tell every rank left to form a new world with
    the joiner (the one it let in, or one they start: --respawn) instead of ending, and form it."""
    state = mine.state
    lost = sorted(lobby.lost(state.lost_workers))
    carry.owed = lobby.unreplaced(state.lost_workers)  # the next phase starts a worker in place of each (Lobby.owe)
    if not ctx.mode.averages:  # the summary's count of each lost worker's gradients, by this phase's index
        state.lost_workers = [{**x, "worker_steps": state.worker_steps[ctx.layout.worker_index(x["rank"])]}
                              for x in state.lost_workers]
    carry.add_phase(state)
    gen = len(carry.joins) + 1
    joiner = lobby.joiner or lobby.started  # rank 0 holds its connection (a worker started while the phase trained too)
    gone = None if joiner is None else why_not_there(joiner)
    if gone and lobby.spare is not None:  # a spare that died as the job made room: the next phase replaces its loss
        carry.spares.lost_one = True  # (the next spare, or --respawn); it is in every COMM_WORLD (trainer._phase)
        carry.owed += 1
    how = join.NOBODY if gone else join.SPAWNED if lobby.spawn else join.CONNECTED
    peer_was_lost = say_goodbye(ctx, [r.rank for r in reports], bool(lost), False, reform=(gen, lost, how))
    carry.peer_lost |= peer_was_lost or bool(lost)
    argv = carry.spawn_argv() if lobby.spawn else []
    world, hello = _regrow(ctx, heartbeat, carry, lost, gen, how, joiner, argv, lobby.starting)
    workers = world.Get_size() - ctx.layout.shards
    if world.Get_size() == ctx.size - len(lost):  # nobody joined: it did not answer, or could not start
        gone = gone or "did not join as the world re-formed"
        whom = "spare" if lobby.spare is not None else "worker"
        why = "" if how == join.SPAWNED else f"the {whom} on {joiner.host} (pid {joiner.pid}) {gone}; "
        say(f"mpitrain: {why}going on with {workers} worker(s) from global step {state.global_step}")
        return Outcome(ExitCode.OK, grown=(carry.next_config(ctx.cfg), world, node_info(world)))
    if how == join.SPAWNED:
        welcome(world, carry)
    host = str(hello.get("host", "?")) if how == join.SPAWNED else joiner.host
    who = ("a worker started in place of the lost one" if how == join.SPAWNED
           else "the spare" if lobby.spare is not None else "the worker")
    carry.joins.append({"rank": world.Get_size() - 1, "global_step": state.global_step, "host": host,
                        "respawned": how == join.SPAWNED, "spare": lobby.spare is not None})
    say(f"mpitrain: {who} on {host} joined as rank {world.Get_size() - 1} at global step "
        f"{state.global_step}: {workers} worker(s) from here")
    return Outcome(ExitCode.OK, grown=(carry.next_config(ctx.cfg), world, node_info(world)))


def grow_with_joiner(ctx: Context, heartbeat, carry: join.Carry, bye: Message) -> Outcome:
    """A worker (or another server), rank 0's goodbye flagged FLAG_REFORM: into the new world."""
    lost = [int(r) for r in np.flatnonzero(bye.payload)]
    carry.peer_lost |= bool(bye.flags & FLAG_PEER_LOST)
    carry.phase_ended(ctx)
    world, _ = _regrow(ctx, heartbeat, carry, lost, bye.generation, bye.joiner, None)
    return Outcome(ExitCode.OK, grown=(carry.next_config(ctx.cfg), world, node_info(world)))


def _regrow(ctx: Context, heartbeat, carry: join.Carry, lost: list[int], gen: int, how: int,
            joiner: join.Joiner | None, argv: list[str] = (), ready=None):
    """Every rank left: end this phase's heartbeats and communicators, then the new world (with
    the joiner, unless `how` is join.NOBODY; rank 0 holds its connection, or the spawn's argv, or the
    worker it started while the phase trained: `ready`), and a started worker's hello (rank 0)."""
    carry.start_forming(f"rank {ctx.rank}")
    if not retire_heartbeats(ctx, heartbeat):
        carry.peer_lost = True
    free_worker_comm(ctx)
    ctx.stop.room_made()  # a stop (a signal's, or a peer's word of one) stops the next phase too
    live = [r for r in range(ctx.size) if r not in lost]
    carry.with_spawned |= how == join.SPAWNED
    world, hello, left_behind = join.grow(ctx.comm, live, gen, how, joiner, lambda members: start_worker(members, argv, ready))
    carry.peer_lost |= left_behind  # a spawned worker that never spoke: MPI_Finalize would wait for it
    return world, hello


def leave_after_a_loss(carry: join.Carry, code: int) -> None:
    """The end of a run that lost a peer: leave without MPI_Finalize (it would wait for the dead),
    or return to call it. A joiner calls it: its own launcher ran without the keep-going flag and
    would kill it otherwise (exit 9). A spawned worker (--respawn) calls it where its MPI needs that
    (mpiimpl.Impl.spawned_finalizes); the job's own ranks never do once a rank died, spawned
    worker or not: their MPI_Finalize waits on a fence that counts the dead rank (Open MPI: past
    the guard's 5 s in 1 of about 10 CI runs), so they leave after the spawned one."""
    impl = mpiimpl.running()
    if carry.spawned:
        finalizes = impl is not None and impl.spawned_finalizes
    else:
        finalizes = carry.joiner and not carry.with_spawned
    if not finalizes:
        after_the_spawned(carry)
        exit_without_finalize(code)


def after_the_spawned(carry: join.Carry) -> None:
    """The job's own ranks leave join.SPAWNED_LEAVES_FIRST_S after a spawned worker (--respawn)."""
    if carry.with_spawned and not carry.spawned:
        time.sleep(join.SPAWNED_LEAVES_FIRST_S)


def take_over(ctx: Context, e, heartbeat, carry: join.Carry, library: bool) -> Outcome | None:
    """A worker that lost rank 0, with --on-lost-server continue: take part in the take-over
    (failover.py) and go on with the next phase on the survivors' world; None where it does not
    apply (the caller ends this rank as before)."""
    if not failover.applies(ctx, e):
        return None
    carry.peer_lost = True  # MPI_Finalize would wait for the dead
    for rank, why in e.lost.items():  # an MPI error (ULFM) names it before the watch does: nothing waits for it
        ctx.watch.declare(rank, why)
    retire_heartbeats(ctx, heartbeat)
    try:
        got = failover.take_over(ctx, e, carry)
    except MPI.Exception as err:  # ULFM: a rank of the new world died in its collectives
        say(f"mpitrain: error: rank {ctx.rank}: the take-over from the lost rank 0 failed: another rank was lost "
            f"meanwhile ({error_text(err.Get_error_code())}). Rank 0's newest checkpoint in --checkpoint-dir "
            "resumes the run",
            sys.stderr)
        got = None
    if got is None:
        if library:
            return Outcome(ExitCode.PEER_LOST, error="the take-over of the lost rank 0 failed", mpi_broken=True)
        exit_without_finalize(ExitCode.PEER_LOST)
    world, handover = got
    carry.handover = handover
    carry.phase_ended(ctx)
    if handover.state is not None:
        carry.succeed()
    carry.owed = int(handover.state is not None)  # the successor: --respawn starts a rank in place of the lost one
    carry.failovers.append(handover.record)
    if handover.state is not None:  # the successor: the summary's lost workers go on from rank 0's (Carry.share_record)
        carry.lost_workers += [{"rank": r, "global_step": handover.record["global_step"], "reason": failover.LEFT_OUT,
                                "worker_steps": None} for r in handover.record["workers_left_out"]]
    # The spares still waiting follow the successor (spares.adopt). Every survivor takes part, whatever
    # its flags: a worker started by --respawn runs with --spares 0.
    among = spares.members(world, carry)
    if handover.state is not None and ctx.cfg.spares:
        spares.adopt(ctx.cfg, carry, among)
    return Outcome(ExitCode.OK, grown=(carry.next_config(ctx.cfg), world, node_info(world)))
