"""--ps-transport shm, pushing into the store (exchange/shm.py): SharedUpdate, the update rule over one shard
of the store's arrays under its lock, and ShmPushPull, an async worker's push and pull (exchange.base.PushPull)
with its blocks of the deal, all in one hold of the lock. Rank 0's remote workers (modes/shm_remote.py) apply
through the same SharedUpdate.
"""

from __future__ import annotations

import math

import numpy as np

from mpitrain.core.ledger import Leases
from mpitrain.core.optim import ServerUpdate, StalenessHold
from mpitrain.core.outer import OuterUpdate, PushSpans
from mpitrain.duties.checkpoint import TrainState
from mpitrain.exchange.shm import (DC_T, DIVERGED_STEP, EMA_T, HOLD_POLL_S, LOST, OPT_T, STOP, VERSION, Store,
                                   StoreKill, open_store)
from mpitrain.exchange.waiting import poll
from mpitrain.launch.faults import applied_trace


class SharedUpdate:
    """optim.ServerUpdate over one shard of the store's arrays (`part`, all of them with one server):
    this process's scratch, the store's state (its counts too, in the shard's row, which every worker
    advances). With --delay-compensation the parameters a gradient was computed on are the worker's
    own pulled copy (`then`): no backup per worker is kept at all; the gradients' mean square is the
    store's. With --local-steps a push is an outer step (outer.OuterUpdate, as on the message path):
    the store holds the outer optimizer's state, OPT_T counts the pushes (delayed-nesterov's turn) and
    `workers`, the phase's, is its W."""

    def __init__(self, cfg, store: Store, xp=np, shard: int = 0, part: slice = slice(None), workers: int = 1):
        h = self.row = store.rows[shard]
        self.active = store.active if cfg.local_steps > 1 else None  # the outer step's floor: who still pushes
        if self.active is not None:
            self.update = OuterUpdate(cfg, store.params[part], xp, int(h[EMA_T]), int(h[OPT_T]), {}, workers=workers)
        else:  # blas: SGD's and momentum's apply in one pass, under the lock every pusher waits on
            # (benchmarks/SHM_HOLD.md: a push's hold of the lock 1.5x shorter with SGD)
            self.update = ServerUpdate(cfg, store.params[part], xp, int(h[EMA_T]), int(h[OPT_T]), {}, workers=1,
                                       version=int(h[VERSION]), blas=True)
        up = self.update
        up.opt.state = {k: a[part] for k, a in store.opt.items()}  # views of the store's arrays, not copies
        if up.ema is not None:
            up.ema.avg = store.ema[part]
        if up.dc is not None:
            up.dc.mean_square = store.views["dc_mean_square"][part]

    def apply(self, grad, lr: float, staleness: int, basis: int, then) -> None:
        """Under the shard's lock: `grad` computed on `then`, the parameters of version `basis`."""
        h, up = self.row, self.update
        up.opt.t = int(h[OPT_T])
        if up.ema is not None:
            up.ema.t = int(h[EMA_T])
        if up.dc is not None:
            up.dc.t, up.dc.sent = int(h[DC_T]), [{basis: then}]
        if self.active is not None:
            up.pushing = {w for w, a in enumerate(self.active) if a > 0}
        up.apply(grad, lr, staleness, 0, basis)
        h[OPT_T] = up.opt.t
        if up.ema is not None:
            h[EMA_T] = up.ema.t
        if up.dc is not None:
            h[DC_T] = up.dc.t


class ShmPushPull:
    """An async worker's side on the store (exchange.base.PushPull): a push applies the gradient, marks its
    block of the deal applied, takes the next (Store.leases) and copies the new parameters out, all under
    one hold of the lock (--num-ps K: one hold of each shard's, then shard 0's again to mark the block), so
    `pull` only says whether the worker was stopped (or, with no block left to take, waits for one a lost
    worker gives back, or for the end). With nothing to wait for there is no overlap: each gradient is
    computed on the parameters of the worker's own last push."""

    def __init__(self, ctx, start: TrainState, deal: Leases | None = None):
        self.ctx, self.be = ctx, ctx.backend
        self.store = open_store(ctx, start)
        # the job's deal in the store (`deal`: as the start left it, the same on every rank): this worker
        # takes its next block with each push, under the lock it applies under
        self.leases = self.store.leases(deal.span, deal.end) if deal is not None else None
        self.parts = ctx.layout.shard_slices(ctx.model.n_params)  # one with one server
        self.shared = [SharedUpdate(ctx.cfg, self.store, np, k, p, ctx.workers) for k, p in enumerate(self.parts)]
        self.worker = ctx.worker_index
        self.host_params = np.array(start.params, np.float32)  # the pulled parameters (a copy: the store moves on)
        self.params = self.be.asarray(self.host_params)  # NumPy: the same array
        self.grads = [self.be.xp.empty(ctx.model.n_params, self.be.xp.float32) for _ in range(2)]
        self.versions = [start.global_step] * len(self.parts)
        self.diverged_at: int | None = None
        self.lent = None  # the block this worker took with its last push (None: none, or no deal)
        self.mark = (0, 0)  # (unused: the store keeps the deal, and a take-over reads it there)
        self.in_flight = False
        self.stopped = False
        self.count = 0  # this worker's pushes so far, the one in hand included (the fault injection's step)
        self.spans = PushSpans(ctx.cfg.local_steps, 1)  # the global steps each push makes (--local-steps: H)
        self.hold = StalenessHold(ctx.cfg.max_staleness, ctx.cfg.local_steps)
        self.kill = StoreKill(ctx.rank)
        self.trace = applied_trace() if self.leases is not None else None  # MPITRAIN_TRACE_BATCHES: its applies

    def gradient(self, slot: int):
        return self.grads[slot]

    def progress(self) -> None:
        pass  # nothing to move: a push is applied when it is made

    def push(self, slot: int, loss: float, versions: list[int], count: int, last: bool, lease=None) -> None:
        """`count`: the worker's gradients so far, this one's included (--local-steps: its inner steps)."""
        self.count += 1
        self.lent = None
        span = self.spans.span(0, count)
        self.ctx.watch.check()  # rank 0 is not in the loop: its loss is noticed here (PeerLost)
        grad = self.be.to_host(self.grads[slot])
        while True:
            with self.store.locked():
                done = self._apply(grad, loss, versions[0], span, lease)
            if done is not None:
                break
            h = self.store.header  # rank 0 holds this step (evaluating, saving): wait outside the lock
            poll(lambda: h[STOP] or self.store.may_step(int(h[VERSION]), self.worker, self.hold), HOLD_POLL_S,
                 self.ctx.watch)
        if not done and len(self.parts) > 1:  # shard 0 applied: the others, in order, each under its own lock
            for k in range(1, len(self.parts)):
                with self.store.locked(k):
                    self._apply_shard(k, grad, versions[k], span)
            # Its block is marked applied once every shard holds it (one more hold of shard 0's lock): a worker
            # lost between two shards is one killed inside its apply, its block dealt again and counted
            self.store.applying[self.worker] = abs(int(self.store.applying[self.worker]))
            self._injected("stepped")
            with self.store.locked():
                if self.store.active[self.worker] == LOST:  # given up meanwhile (silent past the timeout): rank 0
                    done = True  # dealt its block again and counted it (Store.settle); it stops here
                else:
                    self._mark(lease)
        if not done and last:
            self.store.active[self.worker] = 0  # after its last shard: rank 0's final state holds it all
        self.stopped = done or last
        self.in_flight = True
        self.be.upload(self.params, self.host_params)  # NumPy: the same array, nothing to do

    def _apply(self, grad, loss: float, basis: int, span: int, lease=None) -> bool | None:
        """Under shard 0's lock: apply and pull its part (False), stop without applying (True), or held (None);
        `span`: the global steps the push makes; `lease`: the block of the deal it was computed on."""
        s, h = self.store, self.store.header
        self._injected("locked")
        if h[STOP]:
            return self._stop()
        if s.active[self.worker] == LOST:  # rank 0 gave it up, and its block to the others: it stops here
            return True
        v = int(h[VERSION])
        if not s.may_step(v, self.worker, self.hold):
            return None
        if not math.isfinite(loss):  # never applied; rank 0 stops the run (a diverged run saves nothing more)
            s.diverged(self.ctx.rank, v, loss)
            return self._stop()
        part, first = self.parts[0], -1 if lease is None else lease[0]
        s.applying[self.worker] = -(first + 1)  # killed from here to the step's count: dealt again, counted twice
        self.shared[0].apply(grad[part], self.ctx.lr_at(v), v - basis, basis, self.host_params[part])
        if self.trace is not None and lease is not None:
            self.trace.applied(lease, v + span)
        self._injected("applying")
        s.stepped(v, loss, basis, self.worker, span)
        if len(self.parts) == 1:  # ... else it is in part until the last shard: push() marks it then
            s.applying[self.worker] = first + 1  # ... from here to its mark: rank 0 marks it (Store.settle)
            self._injected("stepped")
            self._mark(lease)
        self.host_params[part] = s.params[part]
        self.versions[0] = v + span
        return False

    def _mark(self, lease) -> None:
        """Under shard 0's lock, the push applied to every shard: its block marked applied, the next one taken."""
        s = self.store
        if self.leases is not None:
            s.ledger_begin(self.worker)
            if lease is not None and not self.leases.applied(self.worker, lease):
                raise RuntimeError(f"the store's ledger holds no block {lease} of worker {self.worker}")
            self.lent = self.leases.grant(self.worker)
            s.ledger_end()
        s.applying[self.worker] = 0

    def _await_block(self) -> bool:
        """Nothing left to take when it pushed: wait for a block to deal again (a worker lost with one) or for
        the end (the stop, or no block out anywhere: the deal is done); True when it stops."""
        h, leases = self.store.header, self.leases
        while True:
            poll(lambda: h[STOP] or leases.redeal or not leases.anyone_holds(), HOLD_POLL_S, self.ctx.watch)
            with self.store.locked():
                if not h[STOP]:
                    self.store.ledger_begin(self.worker)
                    self.lent = leases.grant(self.worker)
                    self.store.ledger_end()
                if self.lent is not None:
                    return False
                if h[STOP] or not leases.anyone_holds():
                    return self._stop()

    def _apply_shard(self, k: int, grad, basis: int, span: int) -> None:
        """Under shard k's lock (k > 0): its part of the push, at its own count, and its part of the pull."""
        row, part = self.store.rows[k], self.parts[k]
        v = int(row[VERSION])
        self.shared[k].apply(grad[part], self.ctx.lr_at(v), v - basis, basis, self.host_params[part])
        self._injected("sharded")
        row[VERSION] = v + span
        self.host_params[part] = self.store.params[part]
        self.versions[k] = v + span

    def _injected(self, point: str) -> None:
        self.kill.at(self.count, point)

    def _stop(self) -> bool:
        h = self.store.header
        if h[DIVERGED_STEP] >= 0:
            self.diverged_at = int(h[DIVERGED_STEP])
        self.store.active[self.worker] = 0
        return True

    def pull(self, count: int) -> bool:
        self.in_flight = False
        if not self.stopped and self.leases is not None and self.lent is None:
            self.stopped = self._await_block()
        return self.stopped

    def held(self) -> TrainState:
        """What a take-over starts from (rank 0 lost, failover.py): not this worker's copy but the
        store itself, the newest state any worker applied, optimizer state and moving average too
        (rank 0 only reads the store: its death leaves it whole, and the kernel releases any lock it held)."""
        state, _ = self.store.snapshot([])
        state.versions = [int(row[VERSION]) for row in self.store.rows]
        return state

    def leave(self, count: int) -> None:
        with self.store.locked():
            self.store.active[self.worker] = 0

    def close(self) -> None:
        self.store.close()
