"""A worker joins a running job (`--join`): the job grows by one worker at a step boundary.

The joiner is the same command with `--join`, started while the job runs, e.g. to replace a worker
lost to `kill -9` or to add one more than the job started with:

    mpirun -np 1 python -m mpitrain [the job's flags] --join

How (MPICH; Open MPI 5 cannot connect two separately started mpiruns without a DVM: measured,
both sides hang):

1. Rank 0 of a job that can grow (--checkpoint-dir, --worker-timeout > 0) writes a random token
   into its checkpoint folder (TOKEN, the user's permissions only) and removes it at its end.
2. The joiner checks its flags, opens an MPI port, and writes a request (its port, host and pid)
   into REQUESTS there, which it touches while it waits in MPI_Comm_accept. It is the joiner that
   listens and the job that connects: MPICH's MPI_Comm_accept cannot be left or interrupted (a
   thread in it stalls every other MPI call of the process: measured), so rank 0 must never wait
   in one. Rank 0 connects only to a request touched within FRESH_S (a dead joiner's port crashes
   MPICH's UCX on connect: measured), with a timeout of half --worker-timeout at most (its
   heartbeats wait meanwhile), once: a connect that failed marks the request GAVE_UP, and the joiner
   ends (a second connect to the port of a connect that timed out crashed both processes in MPICH:
   measured). Rank 0's side while it trains is lobby.py.
3. Over that connection the joiner proves it belongs to the job: it sends the token and its
   identity (version, protocol, model and every agreed flag: agreement.identity). A wrong token or
   another set of flags is refused in one line on both sides, and nothing in the job changes.
4. Rank 0 makes room (core/stop.StopRequest.make_room, not a stop): every mode ends the current step as
   it does for Ctrl-C, and rank 0 saves the checkpoint. Rank 0's goodbye says FLAG_REFORM instead
   of the end (once the joiner has answered rank 0's GO: one that died meanwhile is not waited
   for, and the ranks left go on without it): every rank left, and the joiner, form one new
   communicator (MPI_Intercomm_create over the live ranks and the joiner, then merged: the joiner
   is the last rank), and the run goes on from that checkpoint on it (trainer.run's next phase:
   the data re-sharded over the workers, the sync learning rate scaled to their number, the step
   budget the job started with).
5. Until that phase's heartbeats run, every rank is in a collective that a dead rank never
   completes: Carry.start_forming ends each in one line past FORM_LIMIT_S instead (exit 5).

--respawn N (MPICH and Open MPI): instead of a joiner started by hand, rank 0's lobby sees a worker
lost in this phase (the watch's) and a replacement is started (MPI_Comm_spawn of this job's command
with --join, its flags written back out by config_io.as_argv), which loads its data, says hello to
rank 0, and forms the new world with the ranks left (grow, SPAWNED; respawn.py). MPICH: rank 0
spawns it alone at once, the job training on, and requests the stop once its hello is in; the
started worker then waits for GO as a joiner let in does (await_go). Open MPI: the lobby requests
the stop at once and every rank spawns it at the phase's end, the others asleep (spawned by rank 0
alone and merged in, Open MPI 5.0.11 hung in the first collective: measured); mpiimpl.Impl.spawns_alone.

The summary lists the joins (`joined_workers`) with the lost workers of every phase. The ranks are
numbered anew at each join: the live ranks in their order, then the joiner.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from mpi4py import MPI

from mpitrain.core import atomic
from mpitrain.core.config import TrainConfig, can_take_joiners
from mpitrain.core.config_io import as_argv
from mpitrain.core.console import say
from mpitrain.duties.metrics import JobOutputs, json_safe
from mpitrain.exchange.protocol import FLAG_ENDED, TAG_JOIN, Message
from mpitrain.exchange.waiting import poll
from mpitrain.launch import mpiimpl

TOKEN = ".mpitrain.join-token"  # in --checkpoint-dir: who may join (the user's permissions only)
REQUESTS = ".mpitrain.joins"  # in --checkpoint-dir: one file per joiner waiting ("HOST.PID.json")
TOUCH_S = 0.25  # a waiting joiner touches its request this often
FRESH_S = 2.0  # rank 0 connects only to a request touched this recently (a dead joiner's is stale)
SCAN_EVERY_S = 0.5  # rank 0 looks for requests this often (one listdir)
CONNECT_TIMEOUT_S = 5  # MPI_Comm_connect's own bound at most ("timeout" info key, MPICH: whole seconds)
# A waiting joiner whose request rank 0 removed, and which is still not let in this long after, was
# given up on (its connects failed): it ends in one line instead of waiting in accept for the job's end.
GIVEN_UP_S = CONNECT_TIMEOUT_S + 5.0
# Rank 0 renames the request of a joiner it gave up on to this suffix: the joiner, touching it every
# TOUCH_S, ends at once with rank 0's reason instead of GIVEN_UP_S later (10 s more of a user's wait).
GAVE_UP = ".gave-up"
HELLO_BYTES = 1 << 16  # the joiner's hello and rank 0's answer: JSON, never pickle
ANSWER_S = 10.0  # how long either side waits for the other's word on the connection
GROW_TAG = 77  # MPI_Intercomm_create's tag between rank 0 and the joiner
JOIN_TAG = 2000  # the live ranks' communicator before the join's (mpiimpl.survivors): JOIN_TAG + join number
# Each launcher tracks a spawned worker (--respawn) as another job, and both misreported the end
# when the job's own ranks left at the same moment as it: hydra's mpiexec signals the other launch's
# proxy at each rank's exit, and died of SIGPIPE when that proxy had just gone (exit 141, 2 of 6
# jobs); prterun printed "PRTE ERROR: Not found" (1 of 7). So the job's ranks leave this long after.
SPAWNED_LEAVES_FIRST_S = 1.0
# The new world and its phase's start take a second or two; past this a rank died meanwhile. The
# tests that kill a rank in that window set MPITRAIN_FORM_LIMIT_S lower, to wait less for the verdict.
FORM_LIMIT_S = float(os.environ.get("MPITRAIN_FORM_LIMIT_S", "30"))


@dataclasses.dataclass
class Carry:
    """What one phase of a job hands the next when a worker joins: the step budget the job
    started with, and (rank 0) what the summary says of earlier phases."""

    budget: int | None = None
    joins: list[dict] = dataclasses.field(default_factory=list)  # {"rank", "global_step", "host"}
    lost_workers: list[dict] = dataclasses.field(default_factory=list)  # earlier phases' (their ranks then)
    train_s: float = 0.0
    start_step: int | None = None  # rank 0: the job's first step, and its checkpoint if it was resumed
    resumed_from: str | None = None
    peer_lost: bool = False  # a rank died in an earlier phase: MPI_Finalize would wait for it
    joiner: bool = False  # this process came in with --join
    spawned: bool = False  # ... started by the job's ranks (--respawn), under their launcher
    with_spawned: bool = False  # this rank's world has a process the job's ranks started (--respawn)
    token: str | None = None  # rank 0: the job's join token (written once, removed at its end)
    identity: dict | None = None  # rank 0: the job's flags as given, which a joiner's must match
    job_cfg: TrainConfig | None = None  # rank 0: the flags as given (--respawn starts a worker with them)
    respawns_left: int = 0  # rank 0: how many more lost workers --respawn may replace
    forming: threading.Timer | None = None  # from making room until the next phase's heartbeats run
    earlier: tuple = (0, 0, 0, 0, (0, 0))  # earlier phases: gradients pushed, dropped, contributed; exchanges, bytes
    outputs: JobOutputs = dataclasses.field(default_factory=JobOutputs)  # rank 0: one bar and one log for all phases
    spares: object = None  # rank 0: spares.Pool, the spares still waiting (--spares)
    roster: list | None = None  # a worker, --spares with --on-lost-server continue: its spares.Spare connections
    # A worker's own account of the job, which its summary starts from should it take over from a lost rank 0
    # (failover.py): the global step its first phase started at, and its phases' training seconds so far.
    first_step: int | None = None
    worker_s: float = 0.0
    handover: object = None  # failover.Handover: rank 0 was lost, the next phase starts from the survivors' state
    failovers: list[dict] = dataclasses.field(default_factory=list)  # every take-over of the job (the summary's)
    owed: int = 0  # rank 0: lost ranks --respawn has yet to start a worker in place of (Lobby.owe)
    # The dataset this process loaded, for the next phase: the job's flags do not change between phases
    # (next_config), so neither do its data, and loading them again held up every respawn and join
    # (each rank's and the joiner's load is on the path: ~0.5 s of ~2.2 s per respawn, synthetic, 2 cores).
    data: object = None

    def start_forming(self, who: str, why: str = "making room for a worker") -> None:
        """From the moment a world starts to re-form until the next phase's heartbeats run (formed),
        every step is a collective that blocks, and no heartbeat tells of a rank that died in it
        (a joiner killed in that second or two: measured, the job hung). Past FORM_LIMIT_S this
        process ends itself, in one line, instead of hanging."""
        self.formed()
        self.forming = threading.Timer(FORM_LIMIT_S, _forming_stuck, (who, why))
        self.forming.daemon = True
        self.forming.start()

    def failed_forming(self, error: Exception) -> None:
        """An MPI error in one of those collectives (Open MPI's ULFM reports a rank of the forming world
        that died, where MPICH's never returns): the same one line at once, instead of a traceback.
        Returns when no world is forming (the caller raises the error on)."""
        if self.forming is not None:
            who, why = self.forming.args
            self.formed()
            _forming_stuck(who, why, f"a rank died meanwhile: {error}")

    def formed(self) -> None:
        if self.forming is not None:
            self.forming.cancel()
            self.forming = None

    def add_phase(self, state) -> None:
        """Rank 0: a phase that ended in a join (its ServerState), for the summary at the end."""
        self.train_s += state.train_s
        if self.start_step is None:  # the first phase: the later ones resume from a join's checkpoint
            self.start_step, self.resumed_from = state.start_step, state.resumed_from
        self.lost_workers += state.lost_workers
        state.lost_workers = []

    def into(self, state) -> None:
        """Rank 0, the last phase: the earlier ones into its state (the whole job's summary)."""
        if self.start_step is None:
            return
        state.train_s += self.train_s
        state.start_step, state.resumed_from = self.start_step, self.resumed_from
        state.lost_workers[:0] = self.lost_workers

    def share_record(self, comm, is_rank_0: bool) -> None:
        """Every rank, as a phase starts: rank 0's record of the earlier phases (the workers lost, the
        joins) on every rank, so that a worker which takes over from a lost rank 0 (failover.py)
        writes the whole job's summary, not its own phases' only (each rank 0 used to keep its own).
        JSON, not pickle: about 150 bytes for each worker lost or joined so far."""
        data = json.dumps(json_safe({"lost": self.lost_workers, "joins": self.joins})).encode() if is_rank_0 else b""
        size = np.array([len(data)], np.int64)
        comm.Bcast([size, MPI.INT64_T], root=0)
        buf = np.frombuffer(data, np.uint8).copy() if is_rank_0 else np.empty(int(size[0]), np.uint8)
        comm.Bcast([buf, MPI.BYTE], root=0)
        if not is_rank_0:
            record = json.loads(buf.tobytes().decode())
            self.lost_workers, self.joins = record["lost"], record["joins"]

    def whole_job(self, report):
        """A worker's report (reports.WorkerReport) of this phase, counting this process's earlier
        phases too; kept for the next. A phase's counts start at zero, and rank 0 keeps only the last
        phase's reports."""
        pushed, dropped, contributed, exchanges, moved = self.earlier
        together = None if report.contributed is None else report.contributed + contributed
        both = None if report.bytes_moved is None else [a + b for a, b in zip(report.bytes_moved, moved)]
        report = dataclasses.replace(report, pushed=report.pushed + pushed, dropped=report.dropped + dropped,
                                     contributed=together, exchanges=report.exchanges + exchanges, bytes_moved=both)
        self.earlier = (report.pushed, report.dropped, report.contributed or 0, report.exchanges,
                        tuple(report.bytes_moved or (0, 0)))
        return report

    def interrupted(self, counts: tuple[int, int], averages: bool) -> None:
        """A phase that ended in a take-over, of which no report was made: what its loop had counted
        (elastic.interrupted_at; async: the gradients its pushes carried, and those dropped; sync: those
        it contributed, and dropped) joins the earlier phases', as a report's would (whole_job). Its
        exchanges and bytes are not known there, and are not counted."""
        done, dropped = counts
        pushed, dropped_before, contributed, exchanges, moved = self.earlier
        self.earlier = (pushed + done + (dropped if averages else 0), dropped_before + dropped,
                        contributed + (done if averages else 0), exchanges, moved)

    def phase_ended(self, ctx) -> None:
        """A worker's (or a server's) phase ended in a join or a take-over: its training seconds count."""
        self.worker_s += ctx.activity.times()["wall_s"]

    def succeed(self) -> None:
        """This worker takes over from a lost rank 0: the summary it writes covers the whole job, from the
        step its first phase started at and with the seconds its phases trained (as rank 0's would)."""
        if self.start_step is None:
            self.start_step = self.first_step
        self.train_s += self.worker_s
        self.worker_s = 0.0

    def next_config(self, cfg: TrainConfig) -> TrainConfig:
        """The next phase's flags: the same, resumed, with the budget the job started with."""
        return dataclasses.replace(cfg, steps=self.budget, epochs=None, fresh=False, join=False)

    def spawn_argv(self) -> list[str]:
        """Rank 0, --respawn: the flags of the worker the job starts, the job's as given, with --join."""
        return as_argv(dataclasses.replace(self.job_cfg, join=True, fresh=False, respawn=0, spares=0))


def can_grow(ctx) -> bool:
    """Whether workers can join this job: it has a parameter server and --checkpoint-dir (where a
    joiner finds it), heartbeats (they tell the workers to make room), and either runs on MPICH or
    starts its joiners itself (--respawn: Open MPI 5 cannot connect two separately started mpiruns,
    but spawns within one) or holds them (--spares: ranks of its own launch)."""
    return (not ctx.single and can_take_joiners(ctx.cfg)
            and (ctx.cfg.respawn > 0 or ctx.cfg.spares > 0 or mpiimpl.running() is not mpiimpl.OPENMPI))


def job_folder(cfg: TrainConfig) -> Path:
    return Path(cfg.checkpoint_dir).expanduser()


def publish_token(cfg: TrainConfig) -> str:
    """Rank 0: the token a joiner must show, written whole, readable by this user only."""
    token = secrets.token_hex(16)
    write_private(job_folder(cfg) / TOKEN, token)  # OSError: a full or read-only folder (phases.open_lobby)
    return token


def write_private(path: Path, text: str) -> None:
    """Written whole (temporary file, then os.replace), readable by this user only."""
    def write(f) -> None:
        os.fchmod(f.fileno(), 0o600)
        f.write(text)

    atomic.write_atomic(path, write)


def withdraw_token(cfg: TrainConfig) -> None:
    """Rank 0, at the end of the job: a joiner started from now on is told no job is running (one
    still waiting sees the token gone and ends; so the marks for joiners that died unread go too)."""
    remove(job_folder(cfg) / TOKEN)
    for mark in (job_folder(cfg) / REQUESTS).glob("*" + GAVE_UP):
        remove(mark)
    remove_folder(job_folder(cfg) / REQUESTS)


def gave_up(request: Path) -> None:
    """Rank 0 could not connect to this request's joiner: the joiner reads that in the folder (GAVE_UP),
    and the scans no longer see a request. Never a second try: MPICH 5.0.2 segfaulted in both processes
    when a connect to a port whose first connect had timed out met the joiner's accept (measured)."""
    try:
        os.replace(request, request.with_suffix(GAVE_UP))
    except OSError:
        remove(request)  # the joiner then ends GIVEN_UP_S after it finds its request gone


def remove_folder(path: Path) -> None:
    """The requests' folder, once empty (a joiner still waiting removes its request, then this)."""
    try:
        path.rmdir()
    except OSError:
        pass


def send_json(comm, obj: dict, dest: int) -> None:
    data = np.frombuffer(json.dumps(obj).encode(), np.uint8)
    if data.size > HELLO_BYTES:
        raise ValueError("join message too large")
    comm.Send([data, MPI.BYTE], dest=dest, tag=TAG_JOIN)


class JsonReceive:
    """A peer's JSON message (send_json) on its way: `arrived` tests it (MPI.Exception if the
    connection failed), `value` is it, parsed (None if it was not JSON)."""

    def __init__(self, comm, source: int):
        self.buf, self.status, self.done = bytearray(HELLO_BYTES), MPI.Status(), False
        self.req = comm.Irecv([self.buf, MPI.BYTE], source=source, tag=TAG_JOIN)

    def arrived(self) -> bool:
        self.done = self.done or self.req.Test(self.status)  # a completed request is not tested again
        return self.done

    def value(self) -> dict | None:
        try:
            return json.loads(bytes(self.buf[: self.status.Get_count(MPI.BYTE)]).decode())
        except ValueError:
            return None

    def cancel(self) -> None:
        if not self.done:
            self.req.Cancel()


def recv_json(comm, source: int, timeout_s: float) -> dict | None:
    """The peer's JSON message, or None if it did not come in time or was not JSON."""
    try:
        message = JsonReceive(comm, source)
        if not poll(message.arrived, 1e-3, deadline=time.monotonic() + timeout_s):
            message.cancel()
            return None
        return message.value()
    except MPI.Exception:
        return None


def await_go(inter, deadline: float, lost: Callable[[], bool] = lambda: False) -> Message | None:
    """A worker that rank 0 let in (a joiner, or a worker the job started while it trained): rank 0's
    GO once the job has made room, or its word that the job ended instead (FLAG_ENDED); None if none
    came by `deadline`, or `lost()` first (rank 0 died)."""
    go = Message(0)
    req = inter.Irecv(go.spec(), source=0, tag=TAG_JOIN)
    if not poll(lambda: req.Test() or lost(), 1e-3, deadline=deadline) or (lost() and not req.Test()):
        return None
    go.check(TAG_JOIN, 0)
    return go


def tell_to_leave(inter, answer_within_s: float = 0.0, gone: Callable[[], bool] = lambda: False, flags: int = 0) -> bool:
    """Rank 0, the job ending instead of letting in a worker it let in: FLAG_ENDED (await_go's other
    word), and its answer within `answer_within_s` if asked for (a worker the job started: it leaves
    then), not waited for once `gone()`; `flags` besides (a spare: PEER_LOST). Whether it was sent, and
    answered if asked."""
    end, ack = Message(0), Message(0)
    end.stamp(TAG_JOIN, 0, flags=FLAG_ENDED | flags)
    try:
        reqs = [inter.Isend(end.spec(), dest=0, tag=TAG_JOIN)]
        if answer_within_s:
            reqs.append(inter.Irecv(ack.spec(), source=0, tag=TAG_JOIN))
        done = lambda: MPI.Request.Testall(reqs)  # noqa: E731
        poll(lambda: done() or gone(), 1e-3, deadline=time.monotonic() + (answer_within_s or ANSWER_S))
        return done()
    except MPI.Exception:
        return False


def answer_go(inter) -> None:
    """The worker's answer to GO: it forms the new world now (why_not_there waits for it)."""
    ack = Message(0)
    ack.stamp(TAG_JOIN, 0)
    inter.Send(ack.spec(), dest=0, tag=TAG_JOIN)


@dataclasses.dataclass
class Joiner:
    """A joiner rank 0 has let in: its connection (an intercommunicator) and where it runs."""

    inter: object
    host: str
    pid: int


def last_line(e: Exception) -> str:
    return str(e).strip().splitlines()[-1]


def dead_here(host: str, pid: int) -> bool:
    """A process of this host that no longer exists (of another host nothing here can tell)."""
    if host != socket.gethostname():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        pass
    return False


def remove(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


NOBODY, CONNECTED, SPAWNED = 0, 1, 2  # who joins as the world re-forms (rank 0's goodbye says which)


def grow(comm, live: list[int], gen: int, how: int, joiner: Joiner | None = None, start=None):
    """Every live rank of `comm`: (the new world, the live ranks in order, then the joiner: the one
    that CONNECTED (rank 0 holds its connection, `joiner`), or one they start (SPAWNED:
    `start(members)`, respawn.start_worker); the started worker's hello at rank 0, else {};
    whether a started worker was left behind, silent). NOBODY (the joiner did not answer GO), or a
    worker that could not be started: the same ranks go on in a world of their own. Its
    collectives block (Carry.start_forming guards them)."""
    if len(live) == comm.Get_size():
        members = comm if how != NOBODY else comm.Dup()
    else:  # without the dead: made by the live ranks alone
        members = mpiimpl.survivors(comm, live, JOIN_TAG + gen, f"mpitrain.membership.join.{gen}")
    if how == NOBODY:
        return members, {}, False
    hello = {}
    if how == SPAWNED:
        inter, hello, left_behind = start(members)
        if inter is None:
            return members, {}, left_behind
    else:
        inter, _ = with_joiner(members, joiner.inter if joiner is not None else None)
    world = inter.Merge(high=False)
    inter.Free()
    return world, hello, False


def with_joiner(members, connection):
    """Every rank of `members`: the intercommunicator to a joiner that rank 0 alone is connected to
    (`connection`, significant at rank 0: a worker that connected, or one rank 0 spawned alone), and
    rank 0's two-process communicator with it (COMM_SELF elsewhere)."""
    pair = connection.Merge(high=False) if connection is not None else MPI.COMM_SELF
    return members.Create_intercomm(0, pair, 1, GROW_TAG), pair


def into_job(connection):
    """The joiner's side of with_joiner (a worker that connected, or one rank 0 spawned alone): the
    new world, from its connection to rank 0. The two communicators on the way are freed (MPI_Finalize
    waits on every dynamic communicator left); the connection is the caller's."""
    pair = connection.Merge(high=True)
    inter = MPI.COMM_SELF.Create_intercomm(0, pair, 0, GROW_TAG)
    world = inter.Merge(high=True)
    inter.Free()
    pair.Free()
    return world


def _forming_stuck(who: str, why: str, detail: str = "a rank died meanwhile") -> None:
    from mpitrain.core.exitcodes import ExitCode
    from mpitrain.launch.lock import exit_without_finalize

    say(f"mpitrain: error: {who}: the job did not go on within {FORM_LIMIT_S:g} s of {why} "
        f"({detail}); ending. The newest checkpoint in --checkpoint-dir resumes the run", sys.stderr)
    exit_without_finalize(ExitCode.PEER_LOST)


def why_not_there(joiner: Joiner) -> str | None:
    """Rank 0, once the job has made room, before it tells the others: GO to the joiner, and its
    answer within ANSWER_S (None), else why not. A joiner that died while the job made room must
    not be waited for in the grow's collectives (they would hang): the job then goes on without it,
    at once when the joiner ran on this host (its process is gone: every rank of the job used to wait
    out ANSWER_S for it)."""
    go, ack = Message(0), Message(0)
    go.stamp(TAG_JOIN, 0)
    silent = "did not answer when the job had made room"
    try:
        reqs = [joiner.inter.Irecv(ack.spec(), source=0, tag=TAG_JOIN), joiner.inter.Isend(go.spec(), dest=0, tag=TAG_JOIN)]
        answered = lambda: MPI.Request.Testall(reqs)  # noqa: E731
        dead = lambda: dead_here(joiner.host, joiner.pid)  # noqa: E731
        poll(lambda: answered() or dead(), 1e-3, deadline=time.monotonic() + ANSWER_S)
        return None if answered() else "died when the job had made room" if dead() else silent
    except MPI.Exception:
        return silent
