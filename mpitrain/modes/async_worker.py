"""Async mode, a worker's side (AsyncWorker): compute on the parameters it has, on the block of batches
rank 0 lent it (core/ledger.Leases), push, pull the next parameters and block; with --overlap the next
gradient is computed while the answer travels. The servers' side is async_.py's AsyncServer."""

from __future__ import annotations

from collections import deque

from mpitrain.core.guard import Diverged
from mpitrain.core.outer import steps_for
from mpitrain.core.reports import WorkerResult
from mpitrain.duties.checkpoint import TrainState
from mpitrain.duties.observe import COMPUTE, PULL, PUSH
from mpitrain.exchange.base import PushPull
from mpitrain.exchange.mpi import MPIPushPull
from mpitrain.exchange.protocol import ProtocolError
from mpitrain.launch.faults import Kill
from mpitrain.membership.elastic import interrupted_at
from mpitrain.modes.gradients import GradientSource, LeasedBatches
from mpitrain.runtime import Context, start_state

# Blocks answered that a worker remembers for a take-over (failover.lent_ledger): the others answered while its
# oldest block was out, which tells a block applied from one lent in an answer that never came.
ANSWERED = 1024


class AsyncWorker:
    """Pull/compute/push through the exchange (exchange.base.PushPull; MPI's by default). With
    --overlap (the default up to config.AUTO_OVERLAP_MAX_WORKERS workers) the answer to push k is
    received while the gradient of step k+1 is computed, so a worker never idles on the round trip;
    each gradient is then computed on parameters one exchange older. --no-overlap waits for every
    answer. With --num-ps K the servers count their own versions, and a worker stops when any
    server stops it."""

    def __init__(self, ctx: Context, exchange: PushPull | None = None):
        start = start_state(ctx)
        self.ctx, self.be, self.act = ctx, ctx.backend, ctx.activity
        self.overlap = ctx.cfg.overlaps(ctx.workers)
        self.exchange = exchange or MPIPushPull(ctx, start)
        self.batches = LeasedBatches(ctx)  # the blocks of the data it is lent (core/ledger.Leases), with every pull
        self.source = GradientSource(ctx, batches=self.batches)
        self.kill = Kill(ctx.rank)
        n, xp = ctx.model.n_params, self.be.xp
        # one gradient a push, or --local-steps H (--overlap: each run goes on from its own model while it travels)
        self.inner = steps_for(ctx.cfg, n, xp, own=self.overlap)
        self.pushed = 0
        self.begun = None  # the block computed on and not pushed yet
        self.unanswered = None  # the block pushed whose answer has not come (rank 0 may have applied it)
        self.answered: deque = deque(maxlen=ANSWERED)  # the last blocks whose push was answered: applied
        self.counted = 0  # its gradients in the pushes so far: pushes, or (--local-steps) the inner steps they carried
        self.diverged: Diverged | None = None  # set when a server stops the run because a loss diverged

    def run(self) -> WorkerResult:
        # Rank 0 lost (--on-lost-server continue): the take-over starts from the freshest copy.
        # (What a server may have applied: the pushes, not inner steps not pushed yet, which no store or server has.)
        with interrupted_at(self._held, lambda: (self.counted, 0)):
            return self._train()

    def _held(self) -> TrainState:
        """What a take-over starts from (rank 0 lost, failover.py): the exchange's copy and, where it holds no
        ledger (the message path: rank 0 kept it), what this worker knows of the deal (failover.lent_ledger): the
        furthest batch number lent to it and its blocks not known applied, the one pushed and not answered first,
        the last blocks answered, and (in the copy: exchange.mark) what rank 0's answer said of its deal."""
        held = self.exchange.held()
        if held.dealt is None:
            b = self.batches
            held.dealt, held.deal_shards = b.frontier, self.ctx.deal(self.ctx.start).shards
            held.in_flight = [self.unanswered] if self.unanswered else []
            held.redeal = held.in_flight + ([self.begun] if self.begun else []) + list(b.blocks)
            held.answered = list(self.answered)
            held.repeated = dict(self.ctx.start.repeated)  # a take-over before this one's, as the phase began
        return held

    def _train(self) -> WorkerResult:
        ex = self.exchange
        # Nothing lent to it at the start (the deal's end is near), or resumed with its own epochs done:
        # a gradient now would train past the budget, so it leaves at once.
        running = self._more()
        if not running:
            ex.leave(self.pushed)
        while running:
            if ex.in_flight and (not self.overlap or not self._more()):
                if self._pull():
                    break
                if not self._more():
                    raise ProtocolError("the parameter server neither lent this worker more data nor stopped it")
            slot = self.pushed % 2
            lease = self.begun = self.batches.begin()
            loss, used_versions = self._compute(slot)
            if ex.in_flight and self._pull(unsent=slot):
                break  # the gradient just computed is not pushed: training is over
            self._push(slot, loss, used_versions, lease)
        held = self.exchange.held()  # what a take-over would start from, should rank 0 be lost after this
        ex.close()
        return WorkerResult(self.pushed, held.params, self.act.times(), diverged=self.diverged, train_state=held,
                            counted=self.counted)

    def _compute(self, slot: int) -> tuple[float, list[int]]:
        """The next minibatch's gradient into the exchange's `slot`; its loss and the versions it used."""
        ex = self.exchange
        self.act.enter(COMPUTE, ex.versions[0])
        used_versions = ex.versions
        # (--local-steps: H steps of its own, and how far they moved into the push)
        loss = self.inner.run(ex.params, ex.gradient(slot), self._step, lambda: self.source.exhausted,
                              self.ctx.lr_at, ex.versions[0])
        return loss, used_versions

    def _step(self, params, grad) -> float:
        loss = self.source.compute(params, grad)
        self.act.stepped()
        if self.inner.own and self.exchange.in_flight:
            self.exchange.progress()  # the push in flight moves on while the inner steps compute
        return loss

    def _more(self) -> bool:
        """Whether it has a next gradient to compute without a word from rank 0: a block lent and not begun."""
        return self.batches.held

    def _push(self, slot: int, loss: float, used_versions: list[int], lease) -> None:
        self.kill.at(self.pushed + 1)
        self.act.enter(PUSH)
        count = self.inner.count  # its gradients: pushes, or (--local-steps) inner steps
        self.exchange.push(slot, loss, used_versions, count, False, lease)  # never its last: the ledger says when
        self.unanswered, self.begun = lease, None
        self.pushed += 1
        self.counted = count

    def _pull(self, unsent: int | None = None) -> bool:
        """The answer to the push in flight becomes the parameters (--local-steps with --overlap: the worker's
        model, plus the run in `unsent`'s slot, computed since that push). True when told to stop."""
        self.act.enter(PULL)
        ex = self.exchange
        stopped = ex.pull(self.pushed)
        if self.unanswered is not None:
            self.answered.append(self.unanswered)
            self.unanswered = None
        if not stopped and self.inner.own:
            self.inner.rebase(ex.params, None if unsent is None else ex.gradient(unsent))
        if not stopped and ex.lent:
            self.batches.lend(ex.lent)
        if ex.diverged_at is not None:
            self.diverged = Diverged(ex.diverged_at)
        return stopped
