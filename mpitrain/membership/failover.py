"""--on-lost-server continue: the job goes on without rank 0 (issue 49).

When the workers take rank 0 for lost (its heartbeat silent past --worker-timeout, or MPI's failure
report under ULFM), each leaves its loop carrying where it was (elastic.interrupted_at: the state of
the updates it holds, and the gradients it pushed) and, instead of ending, takes part in a take-over
made by the workers alone, over the old world's point-to-point messages (TAG_FAILOVER):

1. **Here.** Each tells every other worker it is alive and how far it got, and listens for theirs,
   up to AGREE_FACTOR x --worker-timeout + 1 s (the others notice the loss within about a heartbeat
   of each other; a worker killed with rank 0 never answers and is left out).
2. **Decide.** The lowest rank one heard from (itself included) is the successor: it sends every
   worker it heard from the list it heard (its DECIDE); the others take the first DECIDE that comes
   from a lower rank. A worker left out of it, or that hears none, ends in one line, as without the
   flag. Receives are posted from each rank by name: ULFM fails a receive from any source once a
   process has died.
3. **A new world** of those ranks (mpiimpl.survivors, as elastic sync's regroup: the dead are asked
   nothing), numbered in their order, so the successor is its rank 0. The freshest state among them
   (the highest global step; sync's replicas are at most one update apart, async's copies a few)
   goes to it, and trainer.run goes on with the next phase on that world (join.Carry.handover): the
   successor as rank 0 (server, evaluation, checkpoints under the folder lock, which it takes over
   from the dead process, the summary and the exit code), the others as its workers, re-sharded.

What is lost: sync (and --quorum) nothing but the step in flight; rank 0 held no optimizer state
(the workers do) and the moving average lives on the coordinator, which keeps it unless it died
too. Async: the updates the dead server applied after the freshest reply a survivor holds (at most
the phase's gradients pushed, less that reply's global step: `updates_lost_at_most`), and the
optimizer's state and moving average, which lived on rank 0 only (they start again; plain SGD,
async's default, has none). Async's data deal, which rank 0 kept, is put together from what the survivors
were lent and told (lent_ledger): every batch not known applied is dealt again, none missed; those the copy
had applied (a block pushed and not answered: `batches_in_flight`) are trained twice, counted
(`batches_repeated`, and by epoch in the summary's `repeated`). Until the new world's heartbeats run,
join.Carry.start_forming bounds every collective: a rank killed during the take-over ends the others in one
line, never a hang.
"""

from __future__ import annotations

import dataclasses
import sys
import time

import numpy as np
from mpi4py import MPI

from mpitrain.core import ledger
from mpitrain.core.console import say
from mpitrain.core.layout import PS_RANK
from mpitrain.duties.checkpoint import TrainState, bcast_ledger, state_arrays
from mpitrain.exchange.protocol import TAG_FAILOVER
from mpitrain.exchange.waiting import poll
from mpitrain.launch import mpiimpl, samehost
from mpitrain.launch.faults import Kill
from mpitrain.membership.liveness import ENDED_GRACE_S, ENDS_THE_JOB, PeerLost

AGREE_FACTOR = 2.0  # the take-over's bound, in --worker-timeouts (+1 s): the survivors notice the loss apart
POLL_S = 0.002
STILL_RUNS_POLL_S = 0.05  # still_running looks in /proc this often
HERE, DECIDE = 1, 2  # a TAG_FAILOVER message's kind: [kind, global step, gradients pushed, one flag per rank]
NEWWORLD_TAG = 3000  # MPICH's tag of the survivors' communicator (mpiimpl.survivors)
NEWWORLD_STRINGTAG = "mpitrain.membership.failover"
KEPT: list = []  # the take-over's messages and sends, alive until the process ends


# The summary's reason for a worker of the interrupted phase that was not in the take-over; its global step
# is the take-over's: it was lost by then, and only the lost server (rank 0) knew when.
LEFT_OUT = "not in the take-over after a parameter server was lost: lost by this step, with it or before"


@dataclasses.dataclass
class Handover:
    """What the take-over hands the next phase: the state it starts from (the successor's), and the
    record the summary and the start lines show (the same on every survivor)."""

    state: TrainState | None
    record: dict
    # each worker's gradients (inner steps) that went into updates so far, by its index in the new world:
    # the summary's worker steps go on from them (state.positions are where each new shard starts reading)
    worker_steps: list[int] | None = None


def applies(ctx, e: PeerLost) -> bool:
    """Whether this rank takes part in a take-over instead of ending: --on-lost-server continue, a
    server among the lost (rank 0, or a shard's with --num-ps 2), and the state where this rank's
    loop was (a worker's loss outside its loop, at the start, ends the job as before; a server
    with nothing to bring, sync's, still takes part)."""
    return (ctx.cfg.on_lost_server == "continue" and any(ctx.layout.is_server(r) for r in e.lost)
            and (e.state is not None or ctx.is_ps)
            and ENDS_THE_JOB not in e.lost.values())  # rank 0 ended the job on purpose (--on-lost-worker stop)


def take_over(ctx, e: PeerLost, carry) -> tuple[object, Handover] | None:
    """This worker's part of the take-over: the new world and what it starts from, or None (it was
    left out, or the successor never answered: it says so and the caller ends it as before)."""
    cfg = ctx.cfg
    # The interrupted loop's frames stay alive: a reply or a collective's part from a live peer may
    # still arrive into their buffers, which must not be freed and reused meanwhile.
    KEPT.append(e)
    why = "; ".join(f"rank {r}: {w}" for r, w in e.lost.items())
    rank0 = still_running(ctx, e)
    if rank0 is not None:  # silent, not gone: the folder's lock would refuse a successor
        say(f"mpitrain: error: rank {ctx.rank} lost the parameter server ({why}), but its process (pid "
            f"{int(rank0[0])}) still runs on this host, stopped or frozen: a take-over would make a second rank 0 "
            "beside it, so this rank ends. Rank 0's newest checkpoint in --checkpoint-dir resumes the run", sys.stderr)
        return None
    t0 = time.monotonic()
    mine = e.state or TrainState(np.zeros(ctx.model.n_params, np.float32), -1, versions=[-1] * ctx.layout.shards)
    pushed = int(e.counts[0]) if not (ctx.mode.averages or ctx.is_ps) else 0
    chosen = agree(ctx, e, mine.global_step, pushed, t0 + AGREE_FACTOR * cfg.worker_timeout + 1.0)
    left = None if isinstance(chosen, str) else len(chosen) - ctx.layout.shards
    if left is not None and cfg.quorum and left < cfg.quorum:  # the same list on every rank: all end alike
        chosen = f"{left} worker(s) would be left, fewer than --quorum {cfg.quorum}"
    if isinstance(chosen, str):
        say(f"mpitrain: error: rank {ctx.rank} lost the parameter server ({why}) and could not take part in a "
            f"take-over: {chosen}. Rank 0's newest checkpoint in --checkpoint-dir resumes the run", sys.stderr)
        return None
    carry.start_forming(f"rank {ctx.rank}", f"agreeing on a successor to the lost rank 0 (rank {chosen[0]})")
    ctx.stop.room_made()  # the room rank 0 was making when it died (as phases._regrow); a stop stays
    world = mpiimpl.survivors(ctx.comm, chosen, NEWWORLD_TAG, NEWWORLD_STRINGTAG)
    lost_shards = [k for k, r in enumerate(ctx.layout.server_ranks) if r not in chosen]
    state, lost_at_most, twice = freshest(ctx, world, mine, pushed, lost_shards)
    in_flight = [[int(a), int(n)] for a, n in state.in_flight]
    K = ctx.layout.shards
    extra = state_arrays(cfg)[1:]  # the optimizer's state and the moving average: the same on every rank of world
    # the workers of this phase not in the new world: lost before rank 0 (which alone knew when) or with it
    left_out = [r for r in ctx.layout.worker_ranks if r not in chosen]
    record = {"lost": why, "successor": chosen[0], "servers": chosen[:K], "lost_shards": lost_shards,
              "workers_left_out": left_out,
              "global_step": state.global_step, "ranks": len(chosen), "updates_lost_at_most": lost_at_most,
              "batches_in_flight": in_flight, "batches_repeated": twice,
              "state_kept": [a for a in extra if state.array(a) is not None],
              "state_restarted": [a for a in extra if state.array(a) is None],
              "seconds": round(time.monotonic() - t0, 2)}
    counts = e.counts
    if ctx.mode.averages and cfg.quorum is None and e.state is not None:
        # plain sync: a replica one update behind the freshest still gave that update its gradient (the
        # Allreduce completed for the others), so every step up to the take-over's counts
        counts = (counts[0] + state.global_step - e.state.global_step, counts[1])
    carry.interrupted(counts, ctx.mode.averages)
    so_far = world.allgather(carry.earlier[0])  # async: each worker's gradients pushed, the whole job's
    return world, Handover(state if world.Get_rank() == 0 else None, record, so_far[K:])


def still_running(ctx, e: PeerLost) -> tuple[float, float, float] | None:
    """The lost rank 0's process (as its heartbeats named it) if it still runs on this host, stopped or
    frozen, not gone; else None. A rank 0 frozen inside MPI (its heartbeat thread held too) ends itself within
    --worker-timeout (stuck.py), about when the workers notice its silence, and a killed process's
    connections close (MPI's report) a moment before /proc shows it exited: so it is given that long,
    and ENDED_GRACE_S more, to be gone before the answer is yes."""
    rank0 = getattr(ctx.watch, "processes", {}).get(PS_RANK) if PS_RANK in e.lost else None
    if rank0 is None:
        return None
    gone = poll(lambda: not samehost.alive(rank0), STILL_RUNS_POLL_S,
                deadline=time.monotonic() + ctx.cfg.worker_timeout + ENDED_GRACE_S)
    return None if gone else rank0


def agree(ctx, e: PeerLost, step: int, pushed: int, deadline: float) -> list[int] | str:
    """Steps 1 and 2 of the module's doc: the old ranks of the new world, the successor first; or why
    this rank is not in it."""
    comm, me, K = ctx.comm, ctx.rank, ctx.layout.shards
    gone = set(e.lost) | set(ctx.watch.lost) | set(ctx.layout.lost)
    others = [r for r in range(comm.Get_size()) if r != me and r not in gone]
    box = _message(HERE, step, pushed, comm.Get_size())
    sends = [comm.Isend([box, MPI.INT64_T], dest=r, tag=TAG_FAILOVER) for r in others]
    inbox = {r: np.zeros_like(box) for r in others}
    recvs = {r: comm.Irecv([inbox[r], MPI.INT64_T], source=r, tag=TAG_FAILOVER) for r in others}
    heard = gather_within(recvs, deadline, until_all=True)
    # Every buffer and request stays alive: a receive from a rank that died never completes, and a
    # message that comes late must not land in freed memory.
    KEPT.append((box, sends, inbox, recvs))
    view = sorted([me, *heard])
    if len(view) < K + 1:
        return (f"only {len(view)} rank(s) answered, and {K} server(s) need a worker too" if K > 1 else
                "no other worker answered, and one rank alone has no workers")
    if view[0] == me:  # the successor: its view is the new world
        decision = _message(DECIDE, step, pushed, comm.Get_size())
        decision[3:][view] = 1
        sends += [comm.Isend([decision, MPI.INT64_T], dest=r, tag=TAG_FAILOVER) for r in view[1:]]
        gather_within({i: s for i, s in enumerate(sends)}, time.monotonic() + ctx.cfg.worker_timeout, until_all=True)
        KEPT.append((decision, sends))
        Kill(me).taking_over()
        return view
    # A DECIDE comes after the same rank's HERE (MPI keeps one sender's order on a tag).
    lower = [r for r in heard if r < me]
    decides = {r: np.zeros_like(box) for r in lower}
    reqs = {r: comm.Irecv([decides[r], MPI.INT64_T], source=r, tag=TAG_FAILOVER) for r in lower}
    # The successor decides only at its own deadline when a rank never says HERE (one killed with rank
    # 0), and it noticed the loss up to --worker-timeout after this rank: wait that much past ours
    # (chaos: a worker and rank 0 killed together, the follower gave up just as the DECIDE came).
    grace = ctx.cfg.worker_timeout + 1.0
    came = gather_within(reqs, deadline + grace, until_all=False)
    KEPT.append((decides, reqs))
    if not came:
        return f"no successor answered within {AGREE_FACTOR * ctx.cfg.worker_timeout + 1 + grace:g} s (rank " \
               f"{view[0]} was the first it heard from)"
    flags = decides[came[0]][3:]
    chosen = [int(r) for r in np.flatnonzero(flags)]
    if me not in chosen:
        return f"the successor (rank {came[0]}) went on without it"
    return chosen


def _message(kind: int, step: int, pushed: int, size: int) -> np.ndarray:
    box = np.zeros(3 + size, np.int64)
    box[:3] = kind, step, pushed
    return box


def gather_within(reqs: dict, deadline: float, until_all: bool) -> list:
    """The keys whose request completed by `deadline` (all of them, or the first: `until_all`). A
    request MPI fails (its peer died: ULFM) is left out, never raised."""
    done = []
    while True:
        for key, req in list(reqs.items()):
            try:
                ok = req.Test()
            except MPI.Exception:
                ok = False
                reqs.pop(key)
            if ok:
                done.append(key)
                reqs.pop(key)
        if not reqs or (done and not until_all) or time.monotonic() > deadline:
            return done
        time.sleep(POLL_S)


def freshest(ctx, world, mine: TrainState, pushed: int, lost_shards: list[int]) -> tuple[TrainState, int, int]:
    """Step 3, shard by shard (one with a single server): the slice of the survivor holding the
    newest version of it (the lowest such rank: a surviving server before a worker's copy, since
    servers come first), with its optimizer state where it has one (a worker's async copy has none:
    zeros), on every rank of `world`; the updates a lost async server may have applied that its
    slice now lacks (at most: the survivors' pushes in this phase, less the version kept); and the batches
    an async take-over deals again that the copy had applied (lent_ledger)."""
    n, K = ctx.model.n_params, ctx.layout.shards
    versions = np.array(mine.versions if mine.versions is not None else [mine.global_step] * K, np.int64)
    top = versions.copy()
    world.Allreduce(MPI.IN_PLACE, top, op=MPI.MAX)
    roots = np.where(versions == top, world.Get_rank(), world.Get_size()).astype(np.int64)
    world.Allreduce(MPI.IN_PLACE, roots, op=MPI.MIN)
    total_pushed = np.array([pushed], np.int64)
    world.Allreduce(MPI.IN_PLACE, total_pushed, op=MPI.SUM)
    names = state_arrays(ctx.cfg)  # params, the optimizer's arrays, the moving average
    state, twice = TrainState(np.zeros(n, np.float32), int(top[0])), 0
    if ctx.mode.leases and ctx.cfg.ps_transport != "shm" and 0 in lost_shards:  # (the store keeps its own)
        twice = lent_ledger(world, mine, state, ctx.deal)
    else:  # sync: the freshest's deal; async: rank 0's, where it is left (a shard was lost)
        bcast_ledger(world, mine, state, int(roots[0]))
    for k, part in enumerate(ctx.layout.shard_slices(n)):
        root = int(roots[k])
        meta = np.array([mine.opt_t, *(mine.array(a) is not None for a in names)], np.int64)
        world.Bcast([meta, MPI.INT64_T], root=root)
        state.opt_t = max(state.opt_t, int(meta[0]))
        for name, present in zip(names, meta[1:]):
            if not present:
                continue
            held = mine.array(name) if world.Get_rank() == root else None
            size = part.stop - part.start
            piece = np.ascontiguousarray(held[part] if held is not None else np.empty(size, np.float32))
            world.Bcast([piece, MPI.FLOAT], root=root)
            if state.array(name) is None:
                state.set_array(name, np.zeros(n, np.float32))
            state.array(name)[part] = piece
    state.positions = [state.global_step] * (world.Get_size() - K)  # each worker's new shard, from this step
    lost = 0 if ctx.mode.averages else max(
        [0, *(ctx.start.global_step + int(total_pushed[0]) - int(top[k]) for k in lost_shards)])
    return state, lost, twice


def lent_ledger(world, mine: TrainState, state: TrainState, deal_of) -> int:
    """Async's deal into `state` when rank 0, which kept it (core/ledger.Leases), is lost (issue 81): what each
    survivor knew of it (AsyncWorker._held: the blocks it was lent, pushed and answered, and the mark of rank 0's
    last answer) gathered and put together (core/ledger.put_together): every batch not known applied is dealt
    again, none missed. Returns how many of them the copy had applied (trained twice), also added to the
    summary's `repeated` by epoch (`deal_of(state)`: the epochs' size)."""
    words = np.array([-1 if mine.dealt is None else mine.dealt, mine.deal_shards], np.int64)
    world.Allreduce(MPI.IN_PLACE, words, op=MPI.MAX)  # (a server's offer knows nothing: -1, 0)
    state.dealt, state.deal_shards = (None if words[0] < 0 else int(words[0])), int(words[1])
    held = allgather_pairs(world, mine.redeal)
    state.in_flight = sorted(allgather_pairs(world, mine.in_flight))
    earlier = allgather_pairs(world, sorted(mine.repeated.items()))  # a take-over before this one's, by epoch
    state.repeated = {e: max(n for e2, n in earlier if e2 == e) for e, _ in earlier}
    version = (mine.versions or [mine.global_step])[0]  # of rank 0's slice (-1: a server's offer holds none)
    marks = allgather_pairs(world, [(version, *mine.mark)] if mine.mark is not None else [], width=3)
    if state.dealt is None or not marks:
        return 0
    _, low, applied = max(marks)  # the freshest copy's: same version, same mark
    state.dealt = max(state.dealt, low)  # (the survivors held nothing: rank 0 had lent further, and it was applied)
    state.redeal, twice, by_epoch = ledger.put_together(state.dealt, low, applied, allgather_pairs(world, mine.answered),
                                                        held, state.in_flight, deal_of(state).per_epoch)
    if twice is None:  # (never seen: a bug, said rather than made a crash of a take-over that can go on)
        say(f"mpitrain: warning: rank 0's last answer said {applied} batches applied, every one below {low}, but the "
            "survivors were answered more: the summary's count of batches trained twice is not exact", sys.stderr)
        return 0
    for e, n in by_epoch.items():
        state.repeated[e] = state.repeated.get(e, 0) + n
    return twice


def allgather_pairs(comm, pairs, width: int = 2) -> list[tuple[int, ...]]:
    """Every rank's (int, int) pairs (tuples of `width`), on every rank of `comm`, in rank order (no pickle)."""
    mine = np.array(pairs, np.int64).reshape(-1)
    counts = np.zeros(comm.Get_size(), np.int64)
    comm.Allgather([np.array([mine.size], np.int64), MPI.INT64_T], [counts, MPI.INT64_T])
    out = np.zeros(int(counts.sum()), np.int64)
    displs = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    comm.Allgatherv([mine, MPI.INT64_T], [out, (counts.tolist(), displs.tolist()), MPI.INT64_T])
    return [tuple(int(v) for v in row) for row in out.reshape(-1, width)]
