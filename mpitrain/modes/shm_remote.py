"""--ps-transport shm on several hosts, rank 0's side of the workers on the other hosts.

The store lives in the memory of rank 0's host (exchange/shm.py); a worker on another host cannot
map it, so it keeps the message path unchanged (exchange/mpi.py's MPIPushPull: a gradient to rank 0,
the parameters back), and rank 0 applies its gradient into the same store, under the same lock, as
one more step in arrival order with the local workers' own applies: the same SharedUpdate, the same
hold at rank 0's duty steps, the same stop slot, the same ring entry (so the bar, the log, the
staleness counts and the guard see its steps as any other). The reply is the parameters the apply
left, copied out in the same hold of the lock, as a local worker's pull is.

A remote worker does not overlap (config.overlaps is off with shm): its next gradient is computed on
exactly the reply, so --delay-compensation's backup of it is that reply (one copy per remote worker,
kept here); --max-staleness reads its basis in the store's `bases`, which rank 0 writes for it.
"""

from __future__ import annotations

import math

import numpy as np
from mpitrain.core.layout import PS_RANK
from mpitrain.core.optim import StalenessHold
from mpitrain.core.outer import PushSpans
from mpitrain.exchange import shm
from mpitrain.exchange.base import ServerSide
from mpitrain.exchange.protocol import (FLAG_DIVERGED, FLAG_FINAL, FLAG_LAST, FLAG_LEAVING, TAG_GRAD, TAG_PARAMS,
                                        ProtocolError)
from mpitrain.exchange.serving import SERVER_SIDES
from mpitrain.exchange.shm_push import SharedUpdate
from mpitrain.exchange.transport import PS_POLL_NO_OVERLAP_S, Poller
from mpitrain.launch.faults import offhost_ranks
from mpitrain.membership.liveness import PeerLost

POLL_S = PS_POLL_NO_OVERLAP_S  # with remote workers rank 0's loop answers them: their reply is on their critical path


def off_host(ctx) -> list[int]:
    """The worker indices whose rank runs on another host than rank 0 (known on rank 0 only: its
    node's ranks); none on one host."""
    here, away = ctx.node.world_ranks, offhost_ranks()
    return [w for w, r in enumerate(ctx.layout.worker_ranks) if (here and r not in here) or r in away]


def on_store_host(ctx) -> bool:
    """Whether this rank runs on rank 0's host, where the store is (every rank knows its node's ranks)."""
    here = ctx.node.world_ranks
    return (not here or PS_RANK in here) and ctx.rank not in offhost_ranks()


class RemoteWorkers:
    """Rank 0: a receive posted per remote worker; what arrives is applied into the store when the
    store's rules allow it (not past rank 0's hold, --max-staleness), and answered."""

    def __init__(self, ctx, store: shm.Store, workers: list[int], start_params: np.ndarray, leases):
        self.ctx, self.store, self.leases = ctx, store, leases  # the store's deal: rank 0 lends for them
        n = ctx.model.n_params
        self.workers = workers
        self.ranks = [ctx.layout.worker_ranks[w] for w in workers]
        self.poller = Poller(POLL_S, ctx.watch)
        self.links: ServerSide = SERVER_SIDES["mpi"](ctx, n, self.ranks, self.poller)  # messages: no store there
        # --compress: a push not in float32 is widened or decoded first
        self.widened = np.empty(n, np.float32) if np.dtype(self.links.pushes.dtype) != np.float32 else None
        self.shared = SharedUpdate(ctx.cfg, store, np, workers=ctx.workers)
        dc = ctx.cfg.delay_compensation is not None
        self.then = [np.array(start_params, np.float32) for _ in workers] if dc else None
        self.hold = StalenessHold(ctx.cfg.max_staleness, ctx.cfg.local_steps)
        self.spans = PushSpans(ctx.cfg.local_steps, len(workers))  # --local-steps: a push's inner steps
        self.held: list[int] = []  # arrived, not yet applied (rank 0's hold, --max-staleness)
        self.bytes_in = self.bytes_out = 0

    def serve(self) -> bool:
        """One look, without waiting: take what arrived, apply and answer what may be. True when
        anything moved. A gradient from a worker that died sending it raises PeerLost (never applied)."""
        done = self.links.next(wait=False)
        moved = bool(done)
        inbox = self.links.inbox
        for i in done.arrived:  # first: Testsome freed their requests with the failed one's
            rank = self.ranks[i]
            self.ctx.watch.heard(rank)
            if inbox[i].flags & FLAG_LEAVING:  # nothing (left) to train: a header-only goodbye
                inbox[i].check(TAG_GRAD, rank, count=0)
                self.store.active[self.workers[i]] = 0
                continue
            inbox[i].check(TAG_GRAD, rank)
            self.bytes_in += self.links.over_mpi(i)
            self.held.append(i)
        for i in sorted(self.held, key=lambda i: inbox[i].step):  # the oldest first, as the message path
            answered = self._apply(i)
            if answered is not None:
                self.held.remove(i)
                self._reply(i, *answered)
                moved = True
        if done.failed:
            raise PeerLost({self.ranks[i]: why for i, why in done.failed.items()})
        return moved

    def _apply(self, i: int) -> tuple[int, int, tuple | None] | None:
        """Under the store's lock, as a local worker's push (ShmPushPull._apply): apply, stop, or hold
        (None). Returns the reply's version, flags and block lent; its parameters are copied out in the same hold."""
        s = self.store
        with s.locked():
            answer = self._decide(i)
            if answer is not None:
                self.links.reply_to(i).payload[:] = s.params  # the pull (narrowed with --compress)
            return answer

    def _decide(self, i: int) -> tuple[int, int] | None:
        s, msg, w = self.store, self.links.inbox[i], self.workers[i]
        h = s.header
        if h[shm.STOP]:
            return int(h[shm.VERSION]), FLAG_FINAL | (FLAG_DIVERGED if h[shm.DIVERGED_STEP] >= 0 else 0), None
        v = int(h[shm.VERSION])
        if not s.may_step(v, w, self.hold):
            return None
        if not math.isfinite(msg.loss):  # never applied; rank 0 stops the run
            s.diverged(self.ranks[i], v, msg.loss)
            return v, FLAG_FINAL | FLAG_DIVERGED, None
        grad = msg.payload
        if self.widened is not None:
            self.links.pushes.read(grad, self.widened)
            grad = self.widened
        basis, span = msg.step, self.spans.span(i, msg.pushed)
        self.shared.apply(grad, self.ctx.lr_at(v), v - basis, basis, None if self.then is None else self.then[i])
        s.stepped(v, msg.loss, basis, w, span)
        s.ledger_begin(w)
        if msg.lease is not None and not self.leases.applied(w, msg.lease):
            raise ProtocolError(f"worker rank {self.ranks[i]} pushed block {msg.lease}, which the store's ledger "
                                f"did not lend it")
        block = self.leases.grant(w)  # none left now: it stops (a block lost later goes to the store's workers)
        s.ledger_end()
        return v + span, FLAG_FINAL if msg.flags & FLAG_LAST or block is None else 0, block

    def _reply(self, i: int, version: int, flags: int, block=None) -> None:
        reply, msg = self.links.outbox[i], self.links.inbox[i]
        if self.then is not None and not flags & FLAG_FINAL:
            self.then[i][:] = reply.payload  # what the worker computes its next gradient on
        reply.stamp(TAG_PARAMS, version, msg.pushed, flags, lease=block)
        self.links.send(i, more=not flags & FLAG_FINAL)
        self.bytes_out += self.links.over_mpi(i, reply=True)
        if flags & FLAG_FINAL:
            self.store.active[self.workers[i]] = 0  # after its last step: rank 0's final state holds it

    def forget(self, w: int) -> None:
        """A lost worker: its requests never complete (dropped, never waited on)."""
        if w in self.workers:
            i = self.workers.index(w)
            self.links.drop(i)
            if i in self.held:
                self.held.remove(i)

    def drain(self) -> None:
        """The last replies, before the job's end (a lost worker's raise PeerLost: the caller forgets it)."""
        self.links.drain()
