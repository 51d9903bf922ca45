"""--respawn: the start of a worker in place of a lost one, both sides. The job's ranks start it
(start_worker, from join.grow) and rank 0 sends it the job's word (welcome); the started process
loads its data, says hello to rank 0, and forms the new world with them (join_spawned). See join.py
for the whole protocol."""

from __future__ import annotations

import os
import socket
import sys

import numpy as np
from mpi4py import MPI

from mpitrain import mpiimpl
from mpitrain.config import UsageError
from mpitrain.config_io import disagreement
from mpitrain.console import say
from mpitrain.join import ANSWER_S, FORM_LIMIT_S, Carry, into_job, last_line, recv_json, send_json, with_joiner
from mpitrain.waiting import poll

NOT_STARTED, STARTED, FAILED = 0, 1, 2  # rank 0's word on a worker it spawned (start_worker)
# How long rank 0 waits for the started worker's hello, which follows its start-up and its data's load
# (a large dataset takes seconds), before the job goes on without it: well inside the forming limit
# that would end every rank meanwhile (join.Carry.start_forming).
HELLO_WITHIN_S = FORM_LIMIT_S / 2


def start_worker(local, argv: list[str]):
    """SPAWNED, every live rank: (the intercommunicator to the worker they start with `argv`, its hello
    at rank 0, False), or (None, {}, whether one was started and left behind: FAILED, its set-up failed
    (its hello says why: a data file gone since the job started, say) or it said nothing within
    HELLO_WITHIN_S; not when it could not be started at all).
    The worker loads its data and says hello before any collective with the job; the ranks not in
    MPI_Comm_spawn meanwhile wait asleep on rank 0's word (a nonblocking broadcast), not in a busy
    MPI wait that takes its cores (mpiimpl.Impl.spawns_alone)."""
    alone = _alone()
    root = local.Get_rank() == 0
    child, hello, failure = None, {}, ""
    if root or not alone:
        info = MPI.Info.Create()
        info.Set("wdir", os.getcwd())  # --checkpoint-dir and --data-dir may be relative to it
        try:
            child = (MPI.COMM_SELF if alone else local).Spawn(sys.executable, ["-m", "mpitrain", *argv], 1, info,
                                                              root=0)
        except MPI.Exception as e:  # no slot left for it, say: the job goes on without it
            failure = last_line(e)
        finally:
            info.Free()
    word = np.array([NOT_STARTED], np.int8)
    if root and child is not None:
        hello = recv_json(child, 0, HELLO_WITHIN_S)
        word[0] = FAILED if hello is None or "error" in hello else STARTED
        failure = (f"it said nothing within {HELLO_WITHIN_S:g} s of its start (it died, or its set-up and "
                   f"data took longer)" if hello is None
                   else f"its set-up failed: {hello.get('error')}")
    req = local.Ibcast([word, MPI.BYTE], root=0)
    poll(req.Test, 1e-3)
    if word[0] != STARTED:
        if root:
            say(f"mpitrain: could not start a worker in place of the lost one: {failure}")
        return None, {}, word[0] == FAILED
    if not alone:
        return child, hello, False
    inter, pair = with_joiner(local, child if root else None)
    if root:  # MPI_Finalize waits on every dynamic communicator left (the world keeps the connection)
        pair.Free()
        child.Free()
    return inter, hello, False


def _alone() -> bool:
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
    if _alone():  # spawned by rank 0 alone: into the world as a worker that connected (joiner.join_job)
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
