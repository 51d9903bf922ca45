"""Async with --ps-transport shm (SHM_ASYNC, the async mode over another transport): the workers
apply their own gradients in the node-shared store (exchange/shm.py); rank 0 follows the version
counter and does only what it alone does. Each step the workers applied is read back from the
store's ring, in order, into the same ChiefDuties.advance that the message loop calls (the bar,
the log, the staleness counts, the loss guard); evaluations and checkpoints fall on steps where rank 0 holds the workers
(`hold_at`), so they see the state of exactly that step, as on the message path; the budget, a
stop request or a divergence sets the store's stop slot. With --num-ps K the other servers have
nothing to apply (the workers apply every shard themselves, each under its own lock): each maps the
store and waits for the end (keep_store). Workers on other hosts than rank 0's keep the message path,
and rank 0 applies their gradients into the same store (modes/shm_remote.py).
"""

from __future__ import annotations

import time

from mpitrain.core import ledger
from mpitrain.core.compress import push_words
from mpitrain.core.console import say
from mpitrain.core.guard import NON_FINITE, Diverged, LossGuard
from mpitrain.core.outer import in_pushes
from mpitrain.duties.checkpoint import TrainState
from mpitrain.duties.chief import ChiefDuties, Clock, ServerState, begin, record_lost
from mpitrain.duties.metrics import Progress
from mpitrain.duties.observe import WAIT
from mpitrain.exchange import shm
from mpitrain.exchange.shm_push import ShmPushPull
from mpitrain.membership.liveness import PeerLost
from mpitrain.modes.async_ import AsyncMode
from mpitrain.modes.async_worker import AsyncWorker
from mpitrain.modes.base import Trained
from mpitrain.modes.gradients import start_leases
from mpitrain.modes.shm_remote import POLL_S as REMOTE_POLL_S
from mpitrain.modes.shm_remote import RemoteWorkers, off_host, on_store_host
from mpitrain.runtime import Context, start_state

SERVE_POLL_S = 2e-3  # rank 0 looks at the version this often: off the hot path, a sleeping process


class ShmServer:
    """Rank 0 over the store: follows the workers' steps, holds them for its duties, stops them."""

    def __init__(self, ctx: Context, progress: Progress):
        self.ctx, self.cfg = ctx, ctx.cfg
        self.duties = ChiefDuties(ctx, progress)
        self.state: ServerState = self.duties.state
        self.seen = self.state.global_step  # the last step read back from the ring
        self.budget = ctx.global_step_budget
        lost_at_start: dict[int, str] = {}
        deal = start_leases(ctx, self.duties.start)  # the data ledger, kept in the store (core/ledger.py)
        self.store = shm.open_store(ctx, self.duties.start, self._next_hold(), lost=lost_at_start, deal=deal)
        self.leases, self.shards = self.store.leases(deal.span, deal.end), ctx.deal(self.duties.start).shards
        self.guard = LossGuard(self.cfg.divergence_factor)
        self.lost: set[int] = set()  # worker indices
        self.twice: list[tuple[dict, ledger.Block]] = []  # (lost worker's record, its block dealt again though applied)
        remote = off_host(ctx)  # workers on other hosts: their gradients come as messages, applied here
        self.remote = RemoteWorkers(ctx, self.store, remote, self.duties.start.params, self.leases) if remote else None
        self.poll_s = REMOTE_POLL_S if remote else SERVE_POLL_S
        if remote:
            ranks = ", ".join(str(ctx.layout.worker_ranks[w]) for w in remote)
            say(f"mpitrain: --ps-transport shm: worker rank(s) {ranks} run on another host than rank 0: their "
                f"gradients come to rank 0 as messages, and it applies them into the store")
        if lost_at_start:  # killed before it had mapped the store: lost as in training (--respawn replaces it)
            self._lose(lost_at_start)

    def run(self) -> ServerState:
        try:
            while self._workers_left():
                try:
                    self.ctx.activity.enter(WAIT)
                    self.ctx.watch.check()
                    self._follow()
                    if not (self.remote and self.remote.serve()):
                        time.sleep(self.poll_s)
                except PeerLost as e:
                    self._lose(e.lost)
            self._drain()
            self._follow()
            self.duties.finish()
            final = self._whole()
            self._not_retrained(final.redeal)
            final.repeated = dict(self.state.repeated)
            self.state.params, self.state.ema = final.params, final.ema
            self.state.dealt, self.state.redeal = final.dealt, final.redeal
            self.duties.save(final, final=True)
        finally:
            self.store.close()
        return self.state

    def _drain(self) -> None:
        """The remote workers' last replies."""
        while self.remote:
            try:
                self.remote.drain()
                self.state.bytes_in, self.state.bytes_out = self.remote.bytes_in, self.remote.bytes_out
                return
            except PeerLost as e:
                self._lose(e.lost)

    def _workers_left(self) -> bool:
        return any(self.store.active[w] > 0 for w in range(self.ctx.workers) if w not in self.lost)

    def _follow(self) -> None:
        """Read back the steps applied since the last look, then decide the next hold and the stop."""
        h = self.store.header
        version = int(h[shm.VERSION])
        while self.seen < version:
            self.seen = self._stepped(self.seen + 1)
        if h[shm.DIVERGED_STEP] >= 0 and self.state.diverged is None:
            self.state.diverged = Diverged(int(h[shm.DIVERGED_STEP]), [int(h[shm.DIVERGED_RANK])],
                                           float(self.store.views["diverged_loss"][0]), NON_FINITE)
        budget_done = self.cfg.steps is not None and version >= self.cfg.steps
        if self.ctx.stop.due or budget_done or self.state.diverged is not None:
            h[shm.STOP] = 1
        else:
            h[shm.HOLD_AT] = self._next_hold()

    def _stepped(self, first: int) -> int:
        """The apply that made global step `first` (and, --local-steps, the rest of its push's inner
        steps), as the worker that applied it left it in the ring; returns the last step it made.
        Counted as the message path counts it (AsyncServer._apply): staleness in pushes."""
        v, i, state = self.store.views, first % shm.RING, self.state
        loss, basis, w = float(v["ring_loss"][i]), int(v["ring_basis"][i]), int(v["ring_worker"][i])
        span = int(v["ring_span"][i])
        step = first - 1 + span
        staleness = in_pushes(first - 1 - basis, self.cfg.local_steps)
        state.global_step = step
        state.worker_steps[w] += span
        state.staleness[staleness] += 1
        state.recent_losses.append(loss)
        why = self.guard.exploded(loss)
        if why and state.diverged is None:  # steps applied since are the explosion's: nothing more is saved
            state.diverged = Diverged(step, [self.ctx.layout.worker_ranks[w]], loss, why)
        self.duties.advance(step, loss, lambda evaluate, save: self._whole(), basis=basis, span=span,
                            staleness=staleness, worker_steps=list(state.worker_steps))
        return step

    def _next_hold(self) -> int:
        """The next step at which rank 0 has a duty (an evaluation, a checkpoint by steps, the
        budget), and never further than the ring reaches past what rank 0 has read."""
        limit = min(self.seen + shm.RING - 1, self.budget)
        every = [e for e in (self.cfg.eval_every, self.cfg.checkpoint_every_steps if self.duties.ckpt.enabled else None)
                 if e]
        due = [(self.seen // e + 1) * e for e in every]
        return min([limit] + due)

    def _whole(self) -> TrainState:
        whole, in_part = self.store.snapshot(self.state.worker_steps, self.leases, self.shards)
        whole.repeated, whole.partial = dict(self.state.repeated), dict(self.state.partial)  # (not in the store)
        for block in in_part:  # a resume from this state deals it again: trained twice on the shards that had it
            ledger.count_by_epoch(whole.partial, block, self.ctx.deal(self.state).per_epoch)
        return whole

    def _not_retrained(self, unapplied: list[ledger.Block]) -> None:
        """At the end: a block counted twice when its worker was lost (Store.settle) that nobody took again
        before the run ended is in the parameters once: not repeated, but missed (a resume deals it again)."""
        per_epoch = self.ctx.deal(self.state).per_epoch
        for record, block in self.twice:
            for part in ledger.within(block, unapplied):
                ledger.count_by_epoch(self.state.repeated, part, per_epoch, -1)
                record["batches_repeated"] -= part[1]
                if not record["batches_repeated"]:
                    del record["batches_repeated"]

    def _lose(self, lost: dict[int, str]) -> None:
        """Carry on without these workers (their half-applied step, if any, stays: a partial step)."""
        layout = self.ctx.layout
        if any(layout.is_server(r) for r in lost) or self.cfg.on_lost_worker == "stop":
            raise PeerLost(lost)
        for rank, why in lost.items():
            w = layout.worker_index(rank)
            self.ctx.watch.declare(rank, why)
            if w in self.lost:
                continue
            self.lost.add(w)
            if self.remote:
                self.remote.forget(w)
            self.store.active[w] = shm.LOST  # its basis no longer holds the others back (--max-staleness)
            with self.store.locked():  # its block is dealt again, first in line, to whoever pushes next
                self.store.ledger_begin(w)  # (first undoing what it was half-way through, if it died so)
                twice = self.store.settle(w, self.leases)  # what of its last push is in the parameters
                self.leases.lose(w)
                self.store.ledger_end()
            if twice is not None:
                ledger.count_by_epoch(self.state.repeated, twice, self.ctx.deal(self.state).per_epoch)
            left = self.ctx.workers - len(self.lost)
            record_lost(self.state, rank, why, f"; continuing with {left} worker(s)" if left else "",
                        repeated=0 if twice is None else twice[1])
            if twice is not None:
                self.twice.append((self.state.lost_workers[-1], twice))


def keep_store(ctx: Context) -> ServerState:
    """A server k > 0 of --num-ps K on the store: the workers apply its shard themselves, so it maps
    the store (open_store: every rank takes part) and waits until no worker is left training, watching the
    others' heartbeats as every server does; a lost worker is rank 0's to report, a lost server ends it."""
    start, state, _ = begin(ctx)
    clock = Clock(ctx)
    store = shm.open_store(ctx, start)
    lost: set[int] = set()

    def lose(rank: int, why: str) -> None:  # as a message-path server records it: quietly, rank 0 says it
        ctx.watch.declare(rank, why)
        lost.add(ctx.layout.worker_index(rank))
        record_lost(state, rank, why, "", loud=False)

    try:
        while any(store.active[w] > 0 for w in range(ctx.workers) if w not in lost):
            try:
                ctx.activity.enter(WAIT)
                ctx.watch.check()
                time.sleep(SERVE_POLL_S)
            except PeerLost as e:
                if any(ctx.layout.is_server(r) for r in e.lost):
                    raise
                for rank, why in e.lost.items():
                    lose(rank, why)
        for w in range(ctx.workers):  # lost to rank 0 before this server's own watch saw it
            if store.active[w] == shm.LOST and w not in lost:
                lose(ctx.layout.worker_rank(w), "lost (rank 0 declared it)")
        state.global_step = int(store.rows[ctx.layout.shard_index(ctx.rank)][shm.VERSION])
    finally:
        store.close()
    clock.stop(state)
    return state


class ShmAsyncMode(AsyncMode):
    """Async as the flags ask it, over the store instead of messages (modes.of picks it for --ps-transport shm):
    the same worker loop and start line, other roles on rank 0 and the other servers."""

    leases = True  # the deal's blocks as on the message path, the ledger in the store: each worker takes its own

    def overlap_words(self, cfg, workers: int) -> str:
        return "no overlap (--ps-transport shm: a pull waits for nothing)"

    def update_words(self, cfg, workers: int) -> str:
        return (super().update_words(cfg, workers) +
                "; the parameters in shared memory, each worker applying its own gradients (--ps-transport shm)")

    def exchange_words(self, cfg, n: int, workers: int) -> str | None:
        return push_words(cfg, n, "pushes from workers on other hosts than the store's")

    def chief(self, ctx: Context, progress: Progress) -> Trained:
        return Trained(state=ShmServer(ctx, progress).run())

    def server(self, ctx: Context, progress=None) -> Trained:
        return Trained(state=keep_store(ctx))  # the workers apply its shard in the store themselves

    def worker(self, ctx: Context, progress=None) -> Trained:
        start = start_state(ctx)
        if on_store_host(ctx):
            return Trained(worker=AsyncWorker(ctx, ShmPushPull(ctx, start, start_leases(ctx, start))).run())
        # Another host than the store's: the message path, rank 0 applying into the store (and lending).
        shm.open_store(ctx, start, here=False)
        return Trained(worker=AsyncWorker(ctx).run())


SHM_ASYNC = ShmAsyncMode()
