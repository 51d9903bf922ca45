"""--respawn: the start of a worker in place of a lost one, both sides. The started process loads
its data, says hello to rank 0, and forms the new world with the job's ranks (join_spawned); rank 0
sends it the job's word there (welcome). See join.py for the whole protocol.

Where rank 0 spawns alone (MPICH) it starts the worker as soon as the loss is seen (`launch`, from
the Lobby), and the job trains on while the worker starts up and loads its data: only once its hello
is in does the job make room, and the worker, like a joiner let in, waits for rank 0's GO
(join.await_go) before the world re-forms (start_worker). Loading the data was most of the pause
(synthetic: 0.48 s of 0.93 s from the stop to training on; an MNIST-sized IDX set takes 1.8 s to load
on 2 cores). Open MPI spawns with every rank (mpiimpl.Impl.spawns_alone): at the phase's end."""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
import time

import numpy as np
from mpi4py import MPI

from mpitrain.core.config import UsageError
from mpitrain.core.config_io import disagreement
from mpitrain.core.console import say
from mpitrain.core.exitcodes import ExitCode
from mpitrain.exchange.protocol import FLAG_ENDED
from mpitrain.exchange.waiting import poll
from mpitrain.launch import mpiimpl
from mpitrain.launch.lock import exit_without_finalize
from mpitrain.membership.join import (ANSWER_S, FORM_LIMIT_S, SPAWNED_LEAVES_FIRST_S, Carry, Joiner, JsonReceive,
                                      answer_go, await_go, dead_here, into_job, last_line, recv_json, send_json,
                                      tell_to_leave, why_not_there, with_joiner)
from mpitrain.membership.stuck import WATCHDOG

NOT_STARTED, STARTED, FAILED = 0, 1, 2  # rank 0's word on a worker it spawned (start_worker)
# How long rank 0 waits for the started worker's hello, which follows its start-up and its data's load
# (a large dataset takes seconds), before the job goes on without it: well inside the forming limit
# that would end every rank meanwhile (join.Carry.start_forming).
HELLO_WITHIN_S = FORM_LIMIT_S / 2


# Rank 0 spawns this long after a loss is declared, not at once: a worker killed mid-message is declared
# lost within milliseconds (MPI's error), and a spawn that reached hydra's mpiexec before the killed
# rank's exit did ended the whole job (exit 9, "Killed (signal 9)": 1 in 12 tries, async np 3, MPICH
# 5.0.2). Making room at the phase's end used to put 50-130 ms there.
AFTER_LOSS_S = 0.3


@dataclasses.dataclass
class Starting:
    """Rank 0, where it spawns alone: a worker started in place of a lost one while the phase trains
    on, and its hello on the way (the Lobby looks at it: `hello_or_why`)."""

    child: object  # the intercommunicator to it
    hello: JsonReceive
    deadline: float  # HELLO_WITHIN_S after its start

    def hello_or_why(self) -> tuple[dict | None, str]:
        """(its hello, "") once it said it is ready; (None, why not) once it failed or stayed silent
        past the deadline; (None, "") while it starts up."""
        try:
            if not self.hello.arrived():
                return (None, SILENT) if time.monotonic() > self.deadline else (None, "")
        except MPI.Exception as e:
            return None, last_line(e)
        said = self.hello.value() or {"error": "its hello was not JSON"}
        return (None, f"its set-up failed: {said['error']}") if "error" in said else (said, "")

    def joiner(self, hello: dict) -> Joiner:
        """What the phase's end lets in, as a joiner that connected (join.why_not_there asks it first)."""
        return Joiner(self.child, str(hello.get("host", "?")), int(hello.get("pid", -1)))

    def settled(self) -> tuple[Joiner | None, str] | None:
        """None while it starts up; then (the joiner to let in, "") once its hello is in, or (None, why
        not) once its set-up failed or it stayed silent past the deadline: a silent one is told to
        leave, for when it speaks. The Lobby (started while the phase trains) and start_worker (at the
        phase's end) both decide by it."""
        hello, why = self.hello_or_why()
        if hello is not None:
            return self.joiner(hello), ""
        if not why:
            return None
        if why == SILENT:
            tell_to_leave(self.child)
        return None, why


SILENT = f"it said nothing within {HELLO_WITHIN_S:g} s of its start (it died, or its set-up and data took longer)"


def launch(argv: list[str]) -> tuple[Starting | None, str]:
    """Rank 0, where it spawns alone, while the phase trains: start the worker (MPI_Comm_spawn returns
    once its MPI is up, ~0.3 s on 2 cores, while the heartbeats wait: stuck.WATCHDOG is paused) and
    listen for its hello. (Starting, "") or (None, why it could not be started)."""
    with WATCHDOG.paused():
        child, failure = _spawn(MPI.COMM_SELF, argv)
    if child is None:
        return None, failure
    return Starting(child, JsonReceive(child, 0), time.monotonic() + HELLO_WITHIN_S), ""


def dismiss(starting: Starting) -> None:
    """Rank 0: the job ends with a worker it started not let in: once its hello is in (what is left of
    its HELLO_WITHIN_S), tell it to leave, and wait for it to go (not for one whose process is gone),
    so that the job's own ranks leave after it (join.SPAWNED_LEAVES_FIRST_S)."""
    try:
        poll(starting.hello.arrived, 1e-3, deadline=starting.deadline)
        hello = starting.hello.value() if starting.hello.arrived() else None
    except MPI.Exception:
        return
    if hello is None or "error" in hello:
        return  # silent (its forming limit ends it), or it ended by itself
    gone = lambda: dead_here(str(hello.get("host")), int(hello.get("pid", -1)))  # noqa: E731
    if tell_to_leave(starting.child, ANSWER_S, gone):
        time.sleep(SPAWNED_LEAVES_FIRST_S)


def _spawn(comm, argv: list[str]):
    """(the intercommunicator to one new process of this job's command with `argv`, ""), or (None,
    why not: no slot left for it, say)."""
    info = MPI.Info.Create()
    info.Set("wdir", os.getcwd())  # --checkpoint-dir and --data-dir may be relative to it
    try:
        return comm.Spawn(sys.executable, ["-m", "mpitrain", *argv], 1, info, root=0), ""
    except MPI.Exception as e:
        return None, last_line(e)
    finally:
        info.Free()


def start_worker(members, argv: list[str], ready: Starting | None = None):
    """SPAWNED, every live rank: (the intercommunicator to the worker they start with `argv`, its hello
    at rank 0, False), or (None, {}, whether one was started and left behind: FAILED, its set-up failed
    (its hello says why: a data file gone since the job started, say) or it said nothing within
    HELLO_WITHIN_S; not when it could not be started at all). Where rank 0 spawns alone, it started
    the worker while the phase trained (`ready`, significant at rank 0: its hello in, its GO answered).
    The worker loads its data and says hello before any collective with the job; the ranks not in
    MPI_Comm_spawn meanwhile wait asleep on rank 0's word (a nonblocking broadcast), not in a busy
    MPI wait that takes its cores (mpiimpl.Impl.spawns_alone)."""
    alone = spawns_alone()
    root = members.Get_rank() == 0
    child, hello, failure = None, {}, ""
    word = np.array([NOT_STARTED], np.int8)
    if alone and root:  # started while the phase trained, it answered GO (phases.make_room); else now
        if ready is None:  # the phase ended before it was started (its budget, a stop): now, the others asleep
            ready, failure = launch(argv)
            failure = failure or _hello_and_go(ready)
            word[0] = FAILED if failure and ready is not None else NOT_STARTED
        if not failure:
            child, hello, word[0] = ready.child, ready.hello.value(), STARTED
    elif not alone:
        child, failure = _spawn(members, argv)
        if root and child is not None:
            hello = recv_json(child, 0, HELLO_WITHIN_S)
            word[0] = FAILED if hello is None or "error" in hello else STARTED
            failure = SILENT if hello is None else f"its set-up failed: {hello.get('error')}"
    req = members.Ibcast([word, MPI.BYTE], root=0)
    poll(req.Test, 1e-3)
    if word[0] != STARTED:
        if root:
            not_started(failure)
        return None, {}, word[0] == FAILED
    if not alone:
        return child, hello, False
    inter, pair = with_joiner(members, child if root else None)
    if root:  # MPI_Finalize waits on every dynamic communicator left (the world keeps the connection)
        pair.Free()
        child.Free()
    return inter, hello, False


def _hello_and_go(starting: Starting) -> str:
    """Rank 0, a worker started at the phase's end: "" once it said hello and answered GO, else why not."""
    while (settled := starting.settled()) is None:  # bounded: HELLO_WITHIN_S after its start
        time.sleep(1e-3)
    joiner, why = settled
    if joiner is None:
        return why
    gone = why_not_there(joiner)
    return f"it {gone}" if gone else ""


def not_started(why: str) -> None:
    say(f"mpitrain: could not start a worker in place of the lost one: {why}")


def spawns_alone() -> bool:
    """Whether rank 0 starts the worker alone (MPICH) or every rank left does (Open MPI); both sides ask."""
    return (mpiimpl.running() or mpiimpl.MPICH).spawns_alone


def welcome(world, carry: Carry) -> None:
    """Rank 0, in the world a SPAWNED worker formed with the others: the job's flags and step budget
    for it (its hello came before: start_worker)."""
    send_json(world, {"budget": carry.budget, "identity": carry.identity}, world.Get_size() - 1)


def spawned() -> bool:
    """Whether this process was started by a job's ranks (--respawn): MPI_Comm_get_parent."""
    return MPI.Comm.Get_parent() != MPI.COMM_NULL


def join_spawned(carry: Carry, identity_of) -> tuple[object, int | None]:
    """The worker a job started (--respawn): its data and flags (`identity_of()`) first, while the
    job's ranks wait asleep, then its hello to rank 0, the world it forms with them (start_worker),
    and rank 0's word: the job's step budget, and its flags, which this process's must match."""
    carry.start_forming("the worker started in place of a lost one")
    carry.spawned = carry.with_spawned = True
    parent = MPI.Comm.Get_parent()
    try:
        mine = identity_of()
    except UsageError as e:  # rank 0 says why no worker joins, and the job goes on without it
        send_json(parent, {"error": str(e)}, 0)
        raise
    send_json(parent, {"host": socket.gethostname(), "pid": os.getpid()}, 0)
    if spawns_alone():  # spawned by rank 0 alone, the job training on: let in as a joiner is (joiner.join_job)
        go = await_go(parent, time.monotonic() + FORM_LIMIT_S)  # the forming limit ends a wait for a dead job
        if go is None:
            raise UsageError("--respawn: the job that started this worker never let it in; it may have ended")
        if go.flags & FLAG_ENDED:
            answer_go(parent)  # it leaves now: rank 0 waits for this before the job's ranks leave
            say("mpitrain: the worker started in place of a lost one leaves: the job ended before it could join")
            exit_without_finalize(ExitCode.OK)  # MPI_Finalize would wait on the job it never joined
        answer_go(parent)
        world = into_job(parent)
    else:
        world = parent.Merge(high=True)
    parent.Free()  # as the job's ranks free theirs (grow): MPI_Finalize waits on every dynamic communicator left
    word = recv_json(world, 0, ANSWER_S)
    if word is None:
        raise UsageError("--respawn: the job that started this worker did not answer; it may have ended")
    detail = disagreement(word.get("identity") or {}, mine)
    if detail:
        raise UsageError(f"--respawn: this worker's flags differ from the job's ({detail})")
    return world, word.get("budget")
