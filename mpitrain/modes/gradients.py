"""Where every training loop takes its gradients, and what every worker loop hands back.

GradientSource is the one gradient step: the next minibatch (the deal's for a sync or quorum step,
DealtBatches; a block an async worker was lent, LeasedBatches),
the model's loss and gradient into a buffer, the finite check (Divergence) and the --straggler
pause. The async worker (modes/async_worker.py), the sync step (modes/sync.py), the quorum coordinator's gradient thread
and the quorum follower (quorum.py) and the single-process run all call it.
"""

from __future__ import annotations

import math
import time
from collections import deque

import numpy as np

from mpitrain.core.ledger import Block, Deal, Leases, SyncDeal
from mpitrain.launch.faults import batch_trace, injected_step
from mpitrain.runtime import Context


class Numbered:
    """Minibatches by their number in the job's deal (core/ledger.Deal): the samples of batch g, from its
    epoch's permutation (copied to the device once an epoch), traced for tests (MPITRAIN_TRACE_BATCHES:
    the trace's step column is `label`, a sync step or an async batch number)."""

    def __init__(self, ctx: Context, deal: Deal, step0: int):
        be = ctx.backend
        self.be, self.numbering = be, deal
        self.x = be.asarray(ctx.data.x_train)
        self.y = be.asarray(ctx.data.y_train)
        self._epoch, self._perm = None, None
        self.trace = batch_trace(ctx.rank, step0)

    def batch(self, g: int, label: int):
        deal = self.numbering
        epoch, start = deal.place(g)
        if epoch != self._epoch:
            self._epoch, self._perm = epoch, self.be.asarray(deal.permutation(epoch))
        if self.trace is not None:
            self.trace.took(label, epoch, deal.permutation(epoch)[start : start + deal.batch])
        rows = self._perm[start : start + deal.batch]
        return self.x[rows], self.y[rows]


class DealtBatches(Numbered):
    """A sync worker's minibatches: the numbers the deal gives it, step after step (core/ledger.SyncDeal).
    `idle` when the deal has no batch for it in the coming step (the last of a run whose worker count does
    not divide what is left of the deal)."""

    def __init__(self, ctx: Context, deal: SyncDeal):
        super().__init__(ctx, deal.deal, deal.step0)
        self.deal = deal
        self.step = deal.step0

    @property
    def idle(self) -> bool:
        return self.deal.number(self.step) is None

    def next(self):
        self.step += 1
        return self.batch(self.deal.number(self.step - 1), self.step - 1)

    def skip(self) -> None:
        self.step += 1


def sync_deal(ctx: Context, start) -> SyncDeal:
    """This worker's share of the job's deal in a sync phase from `start` (core/ledger.SyncDeal)."""
    deal = ctx.deal(start)
    return SyncDeal(deal, start.global_step, ctx.dealt(start), ctx.workers, ctx.worker_index, ctx.deal_end(deal))


def start_leases(ctx: Context, state) -> Leases:
    """An async job's deal from `state` (the start state: the same on every rank), its first blocks dealt:
    two per worker with --overlap (the one it computes on and the next), else one. A state from before
    the ledger went on from the global step (one batch per step). --steps lends no more than the updates
    left will apply (each applies its block's batches as global steps), so a run ends with nothing out."""
    cfg, fresh = ctx.cfg, ctx.dealt(state)
    end = ctx.deal_end(ctx.deal(state))
    if cfg.steps is not None:
        by_steps = fresh + max(0, cfg.steps - state.global_step) - sum(n for _, n in state.redeal)
        end = by_steps if end is None else min(end, by_steps)
    depth = 2 if cfg.overlaps(ctx.workers) else 1
    return Leases(fresh, list(state.redeal), ctx.workers, depth, cfg.local_steps, end)


class LeasedBatches(Numbered):
    """An async worker's minibatches: the blocks of batch numbers rank 0 lends it (core/ledger.Leases), one
    block per push (--local-steps: up to H batches), in the order lent. `begin` starts the next block; the
    push names it back."""

    def __init__(self, ctx: Context):
        super().__init__(ctx, ctx.deal(ctx.start), ctx.start.global_step)
        first = start_leases(ctx, ctx.start)
        self.blocks: deque[Block] = deque(first.out[ctx.worker_index])  # lent, not begun
        self.frontier = first.fresh  # the furthest batch number this worker knows was dealt (a take-over's)
        self.block: Block | None = None  # the one being computed
        self.taken = 0  # of it

    def lend(self, block: Block) -> None:
        self.blocks.append(block)
        self.frontier = max(self.frontier, block[0] + block[1])

    @property
    def held(self) -> bool:
        """Whether a block is lent and not begun."""
        return bool(self.blocks)

    def begin(self) -> Block:
        self.block, self.taken = self.blocks.popleft(), 0
        return self.block

    def next(self):
        g = self.block[0] + self.taken
        self.taken += 1
        return self.batch(g, g)

    @property
    def idle(self) -> bool:
        return False

    @property
    def exhausted(self) -> bool:
        """The block begun is used up (--local-steps: the inner steps end there)."""
        return self.block is None or self.taken >= self.block[1]


class Divergence:
    """A gradient is only usable when its loss and all its entries are finite. One BLAS dot
    product checks the entries (~1% of a step): NaN or inf anywhere makes it non-finite, and so do
    entries beyond ~1e19, which only a diverging run produces. A non-finite result is reported as
    a NaN loss, which stops training on every rank. MPITRAIN_INJECT_NAN (faults.py) makes a
    worker report NaN at a given local step."""

    def __init__(self, ctx: Context):
        self.xp = ctx.backend.xp
        self.inject_at = injected_step("MPITRAIN_INJECT_NAN", ctx.rank)
        self.steps = 0

    def check(self, loss: float, grad, squared_norm: float | None = None) -> float:
        """`loss` if usable, else NaN; `squared_norm` when the caller has already read it with the loss."""
        self.steps += 1
        if squared_norm is None:
            squared_norm = float(self.xp.dot(grad, grad))
        if self.steps == self.inject_at or not math.isfinite(loss) or not math.isfinite(squared_norm):
            return float("nan")
        return loss


class GradientSource:
    """This worker's gradients, one minibatch each: its next batch of the deal, the model's loss
    and gradient into `grad`, the finite check and the --straggler pause. `seconds` is how long the
    last one took (the pause included: what a straggler's peers see)."""

    ONE_READ_FROM = 1_000_000  # parameters: from here a GPU step reads its loss and finite check at once

    def __init__(self, ctx: Context, batches: DealtBatches | LeasedBatches):
        self.model = ctx.model
        self.batches = batches
        self.divergence = Divergence(ctx)
        self.straggler = Straggler(ctx)
        self.seconds = 0.0
        # On a GPU, the loss and the gradient's squared norm come back to the host in one copy instead of
        # two when the model is large: each read drains the GPU's queue, which costs a large step (784-4096-
        # 4096-10, batch 4096: 1.04x samples/s, medians of 3 interleaved), while stacking the two values costs a
        # small one more than it saves (784-100-10, batch 100: 0.84x); benchmarks/GPU.md. Only for the built-in
        # MLP without L2 (its L2 term would read each layer again); NumPy as before.
        self.one_read = (ctx.backend.xp is not np and self.model.n_params >= self.ONE_READ_FROM
                         and not getattr(self.model, "l2", 1)
                         and all(hasattr(self.model, m) for m in ("log_likelihood_and_grad", "mean_loss")))

    def compute(self, params, grad, step: int = 0) -> float:
        """The next minibatch's gradient on `params` into `grad`; its loss (NaN: not usable). `step`,
        the global step of `params`, is for outer.RoundSource, which stands in for this class."""
        x, y = self.batches.next()
        t0 = time.perf_counter()
        if self.one_read:
            xp = self.divergence.xp
            total = self.model.log_likelihood_and_grad(params, x, y, grad)
            ll, squared_norm = (float(v) for v in xp.stack((total, xp.dot(grad, grad))).get())
            loss = self.divergence.check(self.model.mean_loss(ll, x.shape[0], params), grad, squared_norm)
        else:
            loss = self.divergence.check(self.model.loss_and_grad(params, x, y, grad), grad)
        self.straggler.pause(time.perf_counter() - t0)
        self.seconds = time.perf_counter() - t0
        return loss

    @property
    def exhausted(self) -> bool:
        return self.batches.exhausted


class Straggler:
    """--straggler RANK:SECONDS / RANK:xFACTOR for this rank: sleep after each gradient."""

    def __init__(self, ctx: Context):
        specs = [(kind, value) for rank, kind, value in ctx.cfg.stragglers if rank == ctx.rank and not ctx.single]
        self.delay = sum(v for k, v in specs if k == "delay")
        self.factor = 1.0
        for k, v in specs:
            if k == "factor":
                self.factor *= v

    def pause(self, compute_s: float) -> None:
        extra = self.delay + (self.factor - 1.0) * compute_s
        if extra > 0:
            time.sleep(extra)
