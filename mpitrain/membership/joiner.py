"""The joiner's side of `--join` (join.py has the protocol and the job's side): ask the job
through its folder and wait to be let in (a worker the job started itself, --respawn: respawn.py)."""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

from mpi4py import MPI

from mpitrain.core.config import TrainConfig, UsageError
from mpitrain.core.console import say
from mpitrain.exchange.protocol import FLAG_ENDED
from mpitrain.launch import mpiimpl
from mpitrain.launch import faults
from mpitrain.membership.join import (ANSWER_S, GAVE_UP, GIVEN_UP_S, REQUESTS, TOKEN, TOUCH_S, Carry, answer_go,
                                      await_go, dead_here, into_job, job_folder, recv_json, remove, remove_folder,
                                      send_json, write_private)


def join_job(cfg: TrainConfig, identity: dict, carry: Carry):
    """The joiner: ask the job in --checkpoint-dir to let it in, wait until it has made room, and
    return (the new world, the job's step budget). UsageError (exit 2) when there is no job, or
    it refuses this worker."""
    folder = job_folder(cfg)
    if mpiimpl.running() is mpiimpl.OPENMPI:
        raise UsageError("--join needs MPICH: Open MPI 5 cannot connect two separately started mpiruns; "
                         "start the job with --respawn N instead (rank 0 then starts a worker in place of a lost "
                         "one), or restart it (it resumes from its newest checkpoint)")
    try:
        token = (folder / TOKEN).read_text().strip()
    except OSError:
        raise UsageError(f"--join: no running job takes workers in --checkpoint-dir {folder}; start the job first "
                         f"(with --checkpoint-dir {folder} and --worker-timeout > 0, under MPICH)") from None
    inter = _wait_to_be_let_in(folder)
    letting_in = _owner(folder)  # the rank 0 that connected (the lock's owner: a successor's pid would differ)
    send_json(inter, {"token": token, "identity": identity}, 0)
    answer = recv_json(inter, 0, ANSWER_S)
    if answer is None:
        raise UsageError("--join: the job did not answer; it may have ended")
    if not answer.get("ok"):
        raise UsageError(f"--join: the job refused this worker: {answer.get('why')}")
    faults.joiner_vanishes("vanish")
    # Rank 0 makes room within a step or two (or tells this worker the job ended instead). Should it
    # die meanwhile (on this host: its process is gone; a successor of --on-lost-server continue holds
    # the lock under another pid), this worker ends at once; elsewhere its token outlives it, so a
    # generous bound ends the wait.
    lost = lambda: letting_in not in (None, GONE) and dead_here(*letting_in)  # noqa: E731
    go = await_go(inter, time.monotonic() + max(60.0, 4 * cfg.worker_timeout), lost)
    if go is None and lost():
        _give_up(None, "the job's rank 0 was lost while it made room for this worker; start it again (with "
                       "--on-lost-server continue the job goes on, and takes workers in again)")
    if go is None:
        raise UsageError("--join: the job let this worker in but never made room for it; it may have died")
    if go.flags & FLAG_ENDED:
        return None, None
    carry.start_forming("the joining worker")
    answer_go(inter)
    world = into_job(inter)
    faults.joiner_vanishes("formed")
    return world, answer.get("budget")


def _wait_to_be_let_in(folder: Path):
    """A joiner started by hand: request to join through the job's folder, and wait in
    MPI_Comm_accept until rank 0 connects. Returns the connection (an intercommunicator)."""
    port = MPI.Open_port()
    request = folder / REQUESTS / f"{socket.gethostname()}.{os.getpid()}.json"
    waiting = threading.Event()
    try:
        request.parent.mkdir(mode=0o700, exist_ok=True)
        write_private(request, json.dumps({"port": port, "host": socket.gethostname(), "pid": os.getpid()}))
    except OSError as e:
        raise UsageError(f"--join: cannot write a request into {request.parent} ({e.strerror}); "
                         f"join as the user who runs the job") from None
    toucher = threading.Thread(target=_touch, args=(request, folder / TOKEN, waiting), daemon=True)
    toucher.start()
    say(f"mpitrain: waiting for the job in {folder} to let this worker in")
    if faults.joiner_deaf():
        faults.never_returns()  # as if stuck before accept: the toucher ends this process
    inter = MPI.COMM_SELF.Accept(port)
    waiting.set()
    remove(request)
    remove_folder(request.parent)
    MPI.Close_port(port)
    return inter


def _touch(request: Path, token: Path, waiting: threading.Event) -> None:
    """While the joiner waits in MPI_Comm_accept (which nothing interrupts): keep its request
    fresh; when the job is gone (its token removed), or gave up connecting to this worker (its
    request renamed GAVE_UP; or removed, and no connection within GIVEN_UP_S), end the process
    with one line."""
    gone_since = None
    mark = request.with_suffix(GAVE_UP)
    while not waiting.wait(TOUCH_S):
        try:
            os.utime(request)
        except OSError:  # rank 0 took it: it connects now, or gave up on it
            gone_since = gone_since or time.monotonic()
        if waiting.is_set():
            return
        if not token.exists() or _owner_gone(token.parent):
            _give_up(request, "the job ended before it let this worker in")
        if gone_since is not None and os.path.exists(mark):
            remove(mark)
            _give_up(request, "the job could not connect to this worker; start it again")
        if gone_since is not None and time.monotonic() - gone_since > GIVEN_UP_S:
            _give_up(request, f"the job took this worker's request and did not connect within {GIVEN_UP_S:g} s; "
                              f"start it again")


def _give_up(request: Path | None, why: str) -> None:
    say(f"mpitrain: error: --join: {why}", sys.stderr)
    if request is not None:
        remove(request)
        remove_folder(request.parent)
    os._exit(1)


GONE = ("", -1)  # _owner: no lock (or none readable): nobody holds the folder


def _owner(folder: Path) -> tuple[str, int] | None:
    """(host, pid) of the process that holds the folder's lock (the job's rank 0): GONE when there is
    no readable lock, None when it names no pid."""
    from mpitrain.launch import lock

    try:
        owner = json.loads((folder / lock.NAME).read_text())
    except (OSError, ValueError):
        return GONE
    if not isinstance(owner, dict) or not isinstance(owner.get("pid"), int):
        return None
    return str(owner.get("host")), owner["pid"]


def _owner_gone(folder: Path) -> bool:
    """The job that holds the folder's lock has died (killed: its token is still there)."""
    owner = _owner(folder)
    return owner == GONE or (owner is not None and dead_here(*owner))  # on another host: the token's removal tells
