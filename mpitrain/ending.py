"""How a run ends on each rank: the reports to rank 0, its goodbyes, a lost peer's one line, and
MPI_Finalize bounded (a peer that died meanwhile would hold it forever)."""

from __future__ import annotations

import sys
import threading
import time

from mpi4py import MPI

from mpitrain.core.console import say
from mpitrain.core.exitcodes import ExitCode
from mpitrain.core.reports import Outcome, RoleResult, ShardReport, WorkerReport, from_bytes, to_bytes
from mpitrain.duties.chief import record_lost
from mpitrain.duties.summary import resume_hint
from mpitrain.exchange.protocol import FLAG_PEER_LOST, FLAG_REFORM, FLAG_STOPPED, TAG_REPORT, Message
from mpitrain.exchange.transport import END_POLL_S, Poller
from mpitrain.exchange.waiting import poll
from mpitrain.launch import lock, mpiimpl
from mpitrain.launch.lock import exit_without_finalize
from mpitrain.membership.liveness import PeerLost, mpi_error_reason
from mpitrain.runtime import PS_RANK, Context


def retire_heartbeats(ctx: Context, heartbeat) -> bool:
    """Each rank's last beat closes its peers' receive. False when a peer died meanwhile, which
    makes MPI_Finalize unsafe (it would wait for the dead)."""
    ok = True
    if heartbeat and not heartbeat.close(set(ctx.watch.lost)):  # every lost rank was declared there
        ok = False
    if not ctx.watch.close():
        ok = False
    return ok


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
    bye.stamp(TAG_REPORT, flags=flags, generation=reform[0] if reform else 0, joiner=reform[2] if reform else 0)
    ranks = [r for r in ranks if r != ctx.rank]  # a single-process run's own report is among them
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
        gone = set(e.lost) | set(ctx.watch.lost)  # with the ones lost earlier, when the others regrouped
        if shards:
            which = "; ".join(f"{lay.shard_index(r)}/{lay.shards} (rank {r}: {e.lost[r]})" for r in shards)
            say(f"mpitrain: error: lost parameter-server shard {which}. Training cannot go on without "
                f"that part of the parameters; {resume_hint(ctx, 0)}", sys.stderr)
        else:
            left = len([r for r in ctx.layout.worker_ranks if r not in gone])
            say(f"mpitrain: error: lost worker {who}. {why_it_ends(ctx, left)}; "
                f"{resume_hint(ctx, len(gone))}", sys.stderr)
        if mpiimpl.ends_job_on_error_exit():
            # Open MPI under ULFM: MPI_Abort ended mpirun but left the workers running (measured), and
            # they all end here too: meet them, so each line gets out. A sync worker's collective fails;
            # an async worker waits on replies and would never know, so rank 0's last beat tells it
            # (without it rank 0 waited out farewell's 5 s, then the others said they had lost it).
            if ctx.watch.heartbeat is not None:
                ctx.watch.heartbeat.close(gone, FLAG_PEER_LOST)
            mpiimpl.farewell(ctx.comm, ctx.cfg.worker_timeout)
            exit_without_finalize(ExitCode.PEER_LOST)
        return abort_job(ctx, ExitCode.PEER_LOST)  # the workers are stuck in the collective
    whom = "the parameter server" if all(lay.is_server(r) for r in e.lost) else "a peer"
    line = (f"mpitrain: error: rank {ctx.rank} lost {whom} ({who}); stopping. Rank 0's "
            f"newest checkpoint in --checkpoint-dir resumes the run")
    say(line, sys.stderr)
    mpiimpl.farewell(ctx.comm, ctx.cfg.worker_timeout)  # the other survivors' lines too (Open MPI)
    if not library:
        exit_without_finalize(ExitCode.PEER_LOST)
    return Outcome(ExitCode.PEER_LOST, error=line, mpi_broken=True)


def abort_job(ctx: Context, code: int) -> Outcome:
    """End every rank of the job after this rank's last line (peers may wait on this rank: never a
    hang). MPI_Abort makes hydra kill every rank, and its proxy may do that before it forwards the
    line just written (measured: missing in 1 run of ~40 after a lost peer, and once in a suite run
    after a worker's exception). Give it a moment first."""
    sys.stdout.flush()
    sys.stderr.flush()
    time.sleep(ABORT_FLUSH_S)
    lock.release_all()
    mpiimpl.abort(ctx.comm, code, ctx.worker_comm)
    return Outcome(code)


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


ABORT_FLUSH_S = 0.5


FINALIZE_MIN_S = 5.0  # a healthy MPI_Finalize takes milliseconds: every rank arrives within that of the others
