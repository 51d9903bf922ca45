"""Sync mode, rank 0's side: follow the coordinator's status and states (follow_coordinator: the bar,
evaluations, checkpoints, the regroup arbiter) and, with --num-ps, the other servers' loop (keep_shard).
The workers' side is modes/sync.py."""

from __future__ import annotations

import numpy as np

from mpitrain.core.guard import Diverged
from mpitrain.core.layout import PS_RANK
from mpitrain.duties import checkpoint
from mpitrain.duties.checkpoint import TrainState
from mpitrain.duties.chief import ChiefDuties, Clock, ServerState, begin, record_lost
from mpitrain.duties.metrics import Progress
from mpitrain.duties.observe import WAIT
from mpitrain.exchange.mpi import ABANDONED
from mpitrain.exchange.protocol import (FLAG_CKPT, FLAG_DIVERGED, FLAG_EVAL, FLAG_FINAL, FLAG_REGROUPED, TAG_LEFT_OUT,
                                        TAG_PER_WORKER, TAG_SHARD, TAG_STATUS, Message, ProtocolError)
from mpitrain.exchange.shards import Gather, assemble
from mpitrain.exchange.transport import CHIEF_POLL_S, NO_REQUEST, Poller, receive_table
from mpitrain.membership import elastic
from mpitrain.membership.liveness import PeerLost
from mpitrain.runtime import Context


def follow_coordinator(ctx: Context, progress: Progress) -> ServerState:
    """Follow the coordinator: header-only status messages for the bar, full ones (FLAG_EVAL)
    to evaluate, and the last one (FLAG_FINAL) with the final parameters; one tag, so MPI's
    ordering delivers the final one last. (--quorum steps are decided by the coordinator.)"""
    cfg = ctx.cfg
    W = ctx.workers
    duties = ChiefDuties(ctx, progress)
    state = duties.state
    coordinator = ctx.layout.worker_rank(0)
    names = checkpoint.state_arrays(cfg)  # [params, optimizer state..., ema]
    full_count = (ctx.shard.stop - ctx.shard.start) * len(names)  # rank 0's slice (all of it with one server)
    box = Message(full_count)
    poller = Poller(CHIEF_POLL_S, ctx.watch)  # PeerLost ends the job (trainer.py)
    gather = Gather(ctx, poller)  # --num-ps: the other servers forward their slices of the same step
    status = box.listen(ctx.comm, coordinator, TAG_STATUS)
    arbiter = elastic.Arbiter(ctx) if ctx.regroups else None  # else a lost worker ends the job (trainer.py)
    layout = ctx.layout
    final_seen = False
    per_worker: dict = {}  # Mode.worker_arrays: the workers' own arrays sent with the state that arrived
    while not final_seen:
        ctx.activity.enter(WAIT, state.global_step)
        try:
            ready_ranks, ready = arbiter.requests() if arbiter is not None else ([], [])
            done = poller.some([status] + ready)  # the coordinator's next message, or a worker READY to regroup
            if done.failed:  # the coordinator (or a worker) died while sending
                i, why = next(iter(done.failed.items()))
                rank = ready_ranks[i - 1] if i else coordinator
                ctx.watch.declare(rank, why)
                raise PeerLost({rank: why})
            for i in done.arrived:
                if i:
                    arbiter.ready(ready_ranks[i - 1])
            if 0 in done.arrived and box.flags & (FLAG_CKPT | FLAG_FINAL):  # each sent just before the state
                if ctx.mode.leaves_out:
                    left_out = receive_left_out(ctx, coordinator)
                per_worker = receive_per_worker(ctx, coordinator, ctx.mode.worker_arrays(cfg))
        except PeerLost as e:
            if arbiter is None:
                raise
            layout = arbiter.lost(e, layout)  # or PeerLost again: the job cannot go on
            for rank, why in e.lost.items():
                record_lost(state, rank, why, f"; regrouping: continuing with {layout.workers} worker(s)")
            W = layout.workers
            if coordinator != layout.worker_rank(0):  # the old coordinator's receive is left behind with it
                # ...and its buffer: MPICH may still complete it with what the dead one half sent
                # (`torn`), which must not land in the new coordinator's messages.
                ABANDONED.append((status, box))
                coordinator, box = layout.worker_rank(0), Message(full_count)
                status = box.listen(ctx.comm, coordinator, TAG_STATUS)
            continue
        if 0 not in done.arrived:
            continue
        if arbiter is not None and arbiter.awaiting:
            # sent before the coordinator regrouped: superseded (the workers redo it from the agreed step)
            if box.flags & FLAG_REGROUPED and arbiter.regrouped(box.generation, box.step, W):
                box.check(TAG_STATUS, coordinator, count=0)
            status = box.listen(ctx.comm, coordinator, TAG_STATUS)
            continue
        final, full = bool(box.flags & FLAG_FINAL), bool(box.flags & (FLAG_FINAL | FLAG_EVAL | FLAG_CKPT))
        box.check(TAG_STATUS, coordinator, count=full_count if full else 0)
        duties.stepped(box.step, box.loss, force_log=True,  # the coordinator already rate-limits
                       staleness=0, worker_steps=[box.step] * W)
        state.global_step = box.step  # where a lost worker's line says it was lost
        if ctx.mode.deals:
            state.dealt = box.pushed
        if ctx.mode.leaves_out and box.flags & (FLAG_CKPT | FLAG_FINAL):
            state.left_out = left_out
        received = _received(ctx, gather, box, names) if full else None
        if received is not None:
            received.dealt, received.deal_shards = state.dealt, state.deal_shards
            received.left_out = dict(state.left_out)
            if box.flags & (FLAG_CKPT | FLAG_FINAL):
                received.per_worker = per_worker
        state.bytes_in += box.buf.nbytes if full else 0
        if final and box.flags & FLAG_DIVERGED:  # the why and the loss come in the coordinator's report
            state.diverged = Diverged(box.step)  # before the save: a diverged state is never saved
        if box.flags & FLAG_EVAL:
            duties.evaluate(received, box.step)
        if box.flags & (FLAG_CKPT | FLAG_FINAL):
            duties.save(received, final=final, at_once=True)
        if final:  # its loss is the coordinator's mean over the last LOSS_WINDOW steps
            state.global_step = box.step
            state.recent_losses.append(box.loss)
            state.params[:] = received.params
            state.ema = received.ema
            final_seen = True
            status = NO_REQUEST
        else:
            status = box.listen(ctx.comm, coordinator, TAG_STATUS)
    if arbiter is not None:
        arbiter.done(layout)
    state.worker_steps = [state.global_step] * W
    return duties.finish()


def receive_left_out(ctx: Context, coordinator: int) -> dict[int, int]:
    """--quorum: the coordinator's count of the batches its updates left out, by epoch (TAG_LEFT_OUT), sent
    just before the state that arrived: for the checkpoint and the summary."""
    return {int(e): int(n) for e, n in receive_table(ctx.comm, coordinator, TAG_LEFT_OUT, np.int64, 2, ctx.watch)}


def receive_per_worker(ctx: Context, coordinator: int, names: tuple[str, ...]) -> dict[str, np.ndarray]:
    """Mode.worker_arrays: every worker's own arrays at the step of the state that arrived (TAG_PER_WORKER,
    sent just before it), by name, for the checkpoint; none where there are none or the coordinator had none."""
    if not names:
        return {}
    n = ctx.model.n_params
    rows = receive_table(ctx.comm, coordinator, TAG_PER_WORKER, np.float32, n * len(names), ctx.watch)
    return checkpoint.split_rows(rows, names, n) if len(rows) else {}


def _received(ctx: Context, gather: Gather, box: Message, names: list[str]) -> TrainState:
    """The whole state the coordinator sent at box.step: rank 0's slice, and the other
    servers' slices of the same step, which they forward (keep_shard)."""
    pieces = [(ctx.shard, box.payload)]
    if gather:
        pieces += gather.wait(gather.post(), gather.ranks)
        behind = [(r, step) for r, step in zip(gather.ranks, gather.steps()) if step != box.step]
        if behind:
            raise ProtocolError(f"server rank {behind[0][0]} forwarded step {behind[0][1]} while the coordinator "
                                f"sent step {box.step}")
    return assemble(pieces, names, ctx.model.n_params, box.step, box.step, [box.step] * ctx.workers)


def keep_shard(ctx: Context) -> ServerState:
    """A server k > 0 in sync mode: the workers average among themselves, so it only keeps its
    slice of the state, which the coordinator sends it at eval, checkpoint and end, and
    forwards each to rank 0 for the whole state (one message, the same header, tag TAG_SHARD)."""
    _, state, _ = begin(ctx)
    clock = Clock(ctx)
    names, s = checkpoint.state_arrays(ctx.cfg), ctx.shard
    m, coordinator = s.stop - s.start, ctx.layout.worker_rank(0)
    box = Message(m * len(names))
    poller = Poller(CHIEF_POLL_S, ctx.watch)
    while True:
        ctx.activity.enter(WAIT, state.global_step)
        poller.all([box.listen(ctx.comm, coordinator, TAG_STATUS)], [coordinator])
        box.check(TAG_STATUS, coordinator)
        state.global_step = box.step
        state.params[s] = box.payload[:m]
        state.bytes_in += box.buf.nbytes
        box.stamp(TAG_SHARD, box.step, box.pushed, box.flags, box.loss, generation=box.generation)
        poller.all([box.send(ctx.comm, PS_RANK, TAG_SHARD)], [PS_RANK])
        state.bytes_out += box.buf.nbytes
        if box.flags & FLAG_FINAL:
            if box.flags & FLAG_DIVERGED:  # rank 0 and the workers say why
                state.diverged = Diverged(box.step)
            break
    clock.stop(state)
    return state
