"""Async mode: the parameter servers' serve loop (AsyncServer: rank 0, and with --num-ps K ranks
1..K-1 too, each over its slice of the parameters); the workers' push/pull is async_worker.py's
AsyncWorker. Who runs what: AsyncMode, at the end.

A server pre-posts one Irecv per worker; whichever gradient completes is applied and answered
with fresh parameters, held back with --max-staleness while applying it would leave another
worker's gradient too stale (StalenessHold). Rank 0 also does the chief's duties (chief.py) and
gathers the other servers' slices only to evaluate or save (shards.py). A worker computes on the
parameters it has, pushes its gradient to every server and receives the next parameters, with
--overlap while it computes the next gradient.
"""

from __future__ import annotations

import math

import numpy as np

from mpitrain.core import ledger
from mpitrain.core.compress import push_words
from mpitrain.core.config import AUTO_OVERLAP_MAX_WORKERS
from mpitrain.core.guard import NON_FINITE, Diverged, LossGuard
from mpitrain.core.layout import PS_RANK
from mpitrain.core.optim import ServerUpdate, StalenessHold
from mpitrain.core.outer import OuterUpdate, PushSpans, in_pushes
from mpitrain.duties import checkpoint
from mpitrain.duties.checkpoint import TrainState
from mpitrain.duties.chief import ChiefDuties, ServerState, record_lost
from mpitrain.duties.metrics import Progress
from mpitrain.duties.observe import APPLY, PUSH, WAIT
from mpitrain.exchange.base import ServerSide
from mpitrain.exchange.mailbox import worker_exchange
from mpitrain.exchange.protocol import (
    FLAG_CKPT,
    FLAG_DIVERGED,
    FLAG_EVAL,
    FLAG_FINAL,
    FLAG_LAST,
    FLAG_LEAVING,
    TAG_GRAD,
    TAG_PARAMS,
    ProtocolError,
)
from mpitrain.exchange.serving import SERVER_SIDES
from mpitrain.exchange.shards import Gather, ShardService, assemble
from mpitrain.exchange.transport import PS_POLL_NO_OVERLAP_S, PS_POLL_S, Poller
from mpitrain.launch.faults import applied_trace, never_returns, stuck_from
from mpitrain.membership.elastic import interrupted_at
from mpitrain.membership.liveness import PeerLost
from mpitrain.membership.stuck import WATCHDOG
from mpitrain.modes.async_worker import AsyncWorker
from mpitrain.modes.base import Mode, Trained
from mpitrain.modes.gradients import start_leases
from mpitrain.runtime import Context, start_state


class AsyncServer:
    """The async serve loop and its bookkeeping, one method per decision. With --num-ps K each
    server runs one for its slice of the parameters (`self.params`); rank 0, the chief, also
    evaluates and saves, with the other slices gathered for it. All array work goes through the
    server's backend (ctx.backend, chosen by --ps-device): on NumPy `self.params` is a view of
    `state.params` and a float32 gradient is applied straight from its receive buffer; on a GPU
    they live on the device, and messages are staged as a worker's are."""

    def __init__(self, ctx: Context, progress: Progress):
        cfg = ctx.cfg
        self.ctx, self.cfg, self.comm, self.progress = ctx, cfg, ctx.comm, progress
        self.chief = ctx.rank == PS_RANK
        shard, W = ctx.shard, ctx.workers
        n = shard.stop - shard.start
        self.duties = ChiefDuties(ctx, progress)  # rank 0's; another server keeps only its state
        start, self.state, self.ckpt = self.duties.start, self.duties.state, self.duties.ckpt
        self.hold = StalenessHold(cfg.max_staleness, cfg.local_steps)
        be = self.be = ctx.backend
        self.params = be.asarray(self.state.params[shard])  # this server's slice (NumPy: a view, updated in place)
        rule = OuterUpdate if cfg.local_steps > 1 else ServerUpdate  # --local-steps: a push is an outer step
        self.update = rule(cfg, self.params, be.xp, start.global_step, start.opt_t,
                           {k: a[shard] for k, a in start.opt_state.items()},
                           None if start.ema is None else start.ema[shard], W, self.state.global_step)
        self.guard = LossGuard(cfg.divergence_factor)
        self.worker_ranks = list(ctx.layout.worker_ranks)  # worker w is MPI rank worker_ranks[w]
        # With --overlap a reply is not awaited until the worker's next gradient is computed, so
        # rank 0 can sleep longer between polls and leave the cores to the workers.
        self.poller = Poller(PS_POLL_S if cfg.overlaps(ctx.workers) else PS_POLL_NO_OVERLAP_S, ctx.watch)
        self.links: ServerSide = SERVER_SIDES[cfg.ps_transport](ctx, n, self.worker_ranks, self.poller)
        for w in range(W):  # with --compress-replies a reply is the change since what the worker holds: this start
            self.links.replies.start(w, self.params)
        # NumPy + float32: a gradient is applied from its receive buffer. Otherwise it is staged
        # (widened from float16 / bfloat16, or copied to the GPU) into one float32 buffer first.
        inbox = self.links.inbox
        self.zero_copy = bool(W) and be.mirror(inbox[0].payload) is inbox[0].payload
        self.grad = None if self.zero_copy else be.xp.empty(n, be.xp.float32)
        self.gather = Gather(ctx, self.poller) if self.chief else None  # the other servers' slices
        self.service = None if self.chief else ShardService(ctx, n)  # rank 0's requests for this slice
        self.active = set(range(W))  # workers not yet told to stop
        self.held: list[int] = []  # gradients received, not yet applied (--max-staleness)
        self.basis = [self.state.global_step] * W  # version each worker's next gradient is computed on
        self.spans = PushSpans(cfg.local_steps, W)  # --local-steps: each worker's inner steps, as its last push said
        self.stopping = False
        self.stuck_at = stuck_from(ctx.rank)  # MPITRAIN_INJECT_STUCK
        # Rank 0 lends the data (core/ledger.Leases): a block with each reply, marked applied when its push is.
        # A worker it has nothing for while another still holds blocks waits, parked, for what a loss returns.
        self.leases = start_leases(ctx, ctx.start) if self.chief else None
        # MPITRAIN_TRACE_BATCHES: the blocks rank 0 applies (and another server's slice holds: --num-ps)
        self.trace = applied_trace() if self.leases is not None else (
            None if self.chief else applied_trace(f"server{ctx.rank}-applied"))
        self.last_block = [-1] * W  # the first batch number of the last block applied from each worker
        # each worker's steps as this phase began: a server that took a lost one's place counts from its own start
        self.began = list(self.state.worker_steps)
        self.parked: list[int] = []
        if self.leases is not None:
            self.state.deal_shards = ctx.deal(ctx.start).shards
        if self.chief and not self.gather:  # the whole state is here: a stuck MPI saves it first (stuck.py)
            WATCHDOG.last_words = self._last_words

    def run(self) -> ServerState:
        with interrupted_at(self._offer):  # a server lost (--on-lost-server continue): what this one keeps
            return self._run()

    def _offer(self) -> TrainState:
        """A take-over's (failover.py): this server's slice of the state, in arrays of the whole
        model's size, and its version; rank 0's, the deal too (a shard lost, rank 0 left: its ledger goes on)."""
        own, part, n = self._own_state(), self.ctx.shard, self.ctx.model.n_params
        versions = [-1] * self.ctx.layout.shards
        versions[self.ctx.layout.shard_index(self.ctx.rank)] = own.global_step

        def whole(a):
            if a is None:
                return None
            out = np.zeros(n, np.float32)
            out[part] = a
            return out

        return TrainState(whole(own.params), own.global_step, own.opt_t, {k: whole(a) for k, a in own.opt_state.items()},
                          ema=whole(own.ema), versions=versions, dealt=own.dealt, deal_shards=own.deal_shards,
                          redeal=list(own.redeal))

    def _run(self) -> ServerState:
        while self.active:
            try:
                self._serve_once()
            except PeerLost as e:  # silent past --worker-timeout, or its message failed in MPI
                self._lose(e.lost)
        WATCHDOG.last_words = None
        self._drain_sends()
        self.links.close()
        self.duties.finish()
        if self.chief:
            final = self._full_state(FLAG_FINAL)
            if self.gather:
                self._count_partial(self.gather.tallies())
                final.partial = dict(self.state.partial)
            self.state.params, self.state.ema = final.params, final.ema
            self.state.dealt, self.state.redeal = final.dealt, final.redeal
            self.duties.save(final, final=True)  # the final checkpoint
        else:
            self.service.finish(self._own_state(), self.poller, self._tally())
            self.state.ema = self._ema_avg
        return self.state

    def _serve_once(self) -> None:
        """Apply what may be applied, then wait for the next gradients (and, on a server other
        than rank 0, for rank 0's request for this slice). A stop request (a signal here, or in
        a message's header) stops every worker at its next gradient, as --steps does."""
        self.stopping = self.stopping or self.ctx.stop.due
        self._apply_held()
        self._settle_parked()
        if not self.active:  # the last worker was just stopped: nothing more comes (a mailbox's wait would not end)
            return
        if self.held and not any(self.links.awaits(w) for w in self.active):
            self._apply(self._oldest_held())  # never reached with S >= W-1; no hang regardless
            return
        self.ctx.activity.enter(WAIT)
        if self.stuck_at is not None and self.state.global_step >= self.stuck_at:
            self.poller.testsome = never_returns
        W = len(self.worker_ranks)
        done = self.links.next(None if self.chief else [self.service.req])
        if done.failed:  # a gradient from a process that died while sending it: never applied
            self._lose({(self.worker_ranks[w] if w < W else PS_RANK): why for w, why in done.failed.items()})
        for w in done.arrived:
            if w == W:
                self.service.handle(self._own_state(), self.poller)
                continue
            self.ctx.watch.heard(self.worker_ranks[w])
            msg = self.links.inbox[w]
            if msg.flags & FLAG_LEAVING:  # the worker leaves: another server stopped it
                msg.check(TAG_GRAD, self.worker_ranks[w], count=0)
                self.active.discard(w)
                if self.leases is not None:  # what it was lent goes to the others
                    self.leases.lose(w)
                continue
            msg.check(TAG_GRAD, self.worker_ranks[w])
            self.state.bytes_in += self.links.over_mpi(w)  # the summary's "through MPI"
            self.held.append(w)

    def _lose(self, lost: dict[int, str]) -> None:
        """Carry on without these workers: their gradients in flight are dropped, nothing is sent
        to them again, and the budget is finished by the others. A lost server cannot be done
        without (its slice of the parameters is gone), nor any worker with --on-lost-worker stop: PeerLost
        ends the job (trainer.py)."""
        servers = {r: why for r, why in lost.items() if self.ctx.layout.is_server(r)}
        if servers:
            raise PeerLost(servers)
        if self.ctx.cfg.on_lost_worker == "stop":
            raise PeerLost(lost)
        for rank, why in lost.items():
            w = self.ctx.layout.worker_index(rank)
            self.ctx.watch.declare(rank, why)
            if any(info["rank"] == rank for info in self.state.lost_workers):
                continue
            self.active.discard(w)
            self.update.forget(w)
            if w in self.held:
                self.held.remove(w)
            if w in self.parked:
                self.parked.remove(w)
            if self.leases is not None:  # its blocks go to whoever asks next (a parked worker first)
                self.leases.lose(w)
            self.links.drop(w)
            record_lost(self.state, rank, why, f"; continuing with {len(self.active)} worker(s)" if self.active else "",
                        loud=self.chief)

    def _last_words(self) -> str | None:
        """Rank 0's MPI is stuck for good (stuck.py), in a test between updates: save what it holds."""
        if not self.duties.ckpt.enabled:
            return None
        self.duties.save(self._own_state(), final=True)
        saved = self.duties.ckpt.saved
        return f"saved global step {self.state.global_step} to {saved[-1]}" if saved else None

    def _drain_sends(self) -> None:
        """Wait for the last replies, giving up on any worker lost meanwhile."""
        while True:
            try:
                self.links.drain(self.poller)
                return
            except PeerLost as e:
                self._lose(e.lost)

    @property
    def _ema_avg(self) -> np.ndarray | None:
        ema = self.update.ema
        return self.be.to_host(ema.avg) if ema else None

    def _own_state(self) -> TrainState:
        """This server's slice of the training state (the whole of it with one server), on the
        host (NumPy: the arrays themselves, no copy)."""
        st, host = self.state, self.be.to_host
        opt = self.update.opt
        own = TrainState(host(self.params), st.global_step, opt.t, {k: host(a) for k, a in opt.state.items()},
                         list(st.worker_steps), self._ema_avg)
        if self.leases is not None:  # the blocks out are not applied in this state: a resume deals them again
            own.dealt, own.deal_shards, own.redeal = self.leases.fresh, st.deal_shards, self.leases.unapplied()
            own.repeated, own.partial = dict(st.repeated), dict(st.partial)
        return own

    def _full_state(self, flags: int) -> TrainState:
        """Rank 0: the whole training state, the other servers' slices asked for (`flags` say
        why: FLAG_EVAL, FLAG_CKPT, FLAG_FINAL). With one server, its own state as it is."""
        own = self._own_state()
        if not self.gather:
            return own
        pieces = self.gather.ask_all(own.global_step, flags)
        names, n = self.gather.names, self.ctx.model.n_params
        mine = (self.ctx.shard, checkpoint.to_flat(own, names))
        whole = assemble([mine] + pieces, names, n, own.global_step, own.opt_t, own.positions)
        whole.dealt, whole.deal_shards, whole.redeal = own.dealt, own.deal_shards, own.redeal
        whole.repeated, whole.partial = own.repeated, own.partial
        return whole

    def _oldest_held(self) -> int:
        inbox = self.links.inbox
        return min(self.held, key=lambda w: inbox[w].step)

    def _may_apply(self, w: int) -> bool:
        """--max-staleness: whether w's gradient may be applied now (StalenessHold). With --num-ps
        each server holds its own count."""
        return self.hold.allows(self.state.global_step,
                                [self.basis[u] for u in self.active if u != w and u not in self.parked])

    def _apply_held(self) -> None:
        progressed = True
        while self.held and progressed:
            progressed = False
            if self.stopping:
                for w in list(self.held):
                    self.held.remove(w)
                    self._reply(w, stop=True)
                return
            w = self._oldest_held()
            if self._may_apply(w):
                self._apply(w)
                progressed = True

    def _apply(self, w: int) -> None:
        cfg, state, msg = self.cfg, self.state, self.links.inbox[w]
        self.held.remove(w)
        why = NON_FINITE if not math.isfinite(msg.loss) else self.guard.exploded(msg.loss)
        if why:  # diverged: never applied, and every worker is stopped
            state.diverged = Diverged(state.global_step, [self.worker_ranks[w]], msg.loss, why)
            self.stopping = True
            self._reply(w, stop=True)
            return
        # read before the reply: its buffer takes the worker's next push once the reply is sent
        loss, basis, last, lease = msg.loss, msg.step, bool(msg.flags & FLAG_LAST), msg.lease
        staleness = state.global_step - basis
        if self.leases is not None and not self.leases.applied(w, lease):
            raise ProtocolError(f"rank {self.worker_ranks[w]} pushed a gradient of batches {lease}, where rank 0 "
                                f"had lent it {list(self.leases.out[w])}")
        self.ctx.activity.enter(APPLY, state.global_step)
        grad = msg.payload
        if not self.zero_copy:  # widened, decoded (--compress), or staged to the server's GPU
            self.links.pushes.read(grad, self.grad)
            grad = self.grad
        inner, outer_staleness = self._inner_steps(w, msg.pushed, staleness)
        self.update.apply(grad, self.ctx.lr_at(state.global_step), staleness, w, basis)
        state.global_step += inner
        state.worker_steps[w] += inner
        if lease is not None:
            self.last_block[w] = lease[0]
            if self.trace is not None:
                self.trace.applied(lease, state.global_step)
        state.staleness[outer_staleness] += 1  # --local-steps: in outer steps, as --max-staleness counts
        state.recent_losses.append(loss)
        # --steps counts rank 0's updates, the run's global step. Another server's count can run ahead
        # of it (a worker that died half-way through a push delivered that server's part only:
        # measured by chaos, the run then ended at 999 of 1000), so only rank 0 stops at the budget;
        # the workers it stops leave the other servers.
        self.stopping = self.ctx.stop.due or (self.chief and cfg.steps is not None and state.global_step >= cfg.steps)
        # The reply first, the bookkeeping after: the worker waits for it (benchmarks/SERVER.md).
        self._reply(w, stop=self.stopping or last)
        if self.chief:  # the bar, the log, --eval-every and checkpoints at this global step
            self.duties.advance(state.global_step, loss, self._whole_state, basis=basis, span=inner,
                                staleness=outer_staleness, worker_steps=list(state.worker_steps))

    def _tally(self) -> np.ndarray:
        """This server's account, at the end: (worker, global steps applied from it in this phase, first batch
        number of its last block applied), a row per worker (another server's goes to rank 0: ledger.count_partial)."""
        W, steps = len(self.worker_ranks), self.state.worker_steps
        return np.array([(w, steps[w] - self.began[w], self.last_block[w]) for w in range(W)], np.int64).reshape(W, 3)

    def _count_partial(self, tallies: list[np.ndarray]) -> None:
        """Rank 0 at the end, --num-ps: a push that some servers applied and others not (its worker lost between
        its messages, or held by rank 0 as it stopped the run while another server applied it) is in part of the
        parameters. Each worker's count on another server against rank 0's says by how many batches; they are
        counted (the summary's `partial`) in the epoch of the last block the server ahead applied."""
        if self.leases is not None:
            ledger.count_partial(self.state.partial, self._tally(), tallies, self.ctx.deal(self.state).per_epoch)

    def _settle_parked(self) -> None:
        """Answer the parked workers once there is something to say: blocks a loss returned, the last
        block applied (nobody holds any: they stop), or a stop."""
        if self.parked and (self.stopping or self.leases.redeal or not self.leases.anyone_holds()):
            for w in list(self.parked):
                self.parked.remove(w)
                self._reply(w, stop=self.stopping)

    def _inner_steps(self, w: int, count: int, staleness: int) -> tuple[int, int]:
        """The global steps one push makes (the worker batches behind it) and its staleness as the
        summary and --max-staleness count it. --local-steps H: the inner steps since the worker's last
        push (its count says, H or fewer at its data's end) and the staleness in outer steps, about H
        global steps each (the outer step's damping, OuterUpdate, counts global steps)."""
        return self.spans.span(w, count), in_pushes(staleness, self.cfg.local_steps)

    def _whole_state(self, evaluate: bool, save: bool) -> TrainState:
        """For rank 0's duties: the whole state, with the other servers' slices (asked for why)."""
        return self._full_state((FLAG_CKPT if save else 0) | (FLAG_EVAL if evaluate else 0))

    def _reply(self, w: int, stop: bool) -> None:
        state = self.state
        lease = None
        if self.leases is not None and not stop:  # the next block; none left for it: stopped, or parked
            lease = self.leases.grant(w)
            if lease is None and not self.leases.holds(w):
                if self.leases.anyone_holds():  # a loss may yet return another worker's blocks
                    self.parked.append(w)
                    return
                stop = True
        self.ctx.activity.enter(PUSH)
        reply = self.links.reply_to(w)
        self.links.replies.write(w, self.params, reply.payload)  # a copy (narrowed, or compressed): params change
        flags = (FLAG_FINAL | (FLAG_DIVERGED if state.diverged else 0)) if stop else 0
        reply.stamp(TAG_PARAMS, state.global_step, state.worker_steps[w], flags, lease=lease,
                    mark=self.leases.mark() if self.leases is not None else (0, 0))
        self.links.send(w, more=not stop)
        state.bytes_out += self.links.over_mpi(w, reply=True)
        self.basis[w] = state.global_step
        if stop:
            self.active.discard(w)
            self.update.forget(w)
        else:
            self.update.was_sent(w, state.global_step)


class AsyncMode(Mode):
    """Async: every gradient a worker pushes is one global step, applied by rank 0 (and each
    server of --num-ps) as it arrives; a worker pulls the parameters back."""

    name = "async"
    leases = True

    def start_words(self, cfg, workers: int) -> str:
        """The defaults that follow the worker count (config.DEFAULT_STALENESS_TOLERANCE), as decided."""
        return f"async, {workers} worker{'s' if workers != 1 else ''}: {self.overlap_words(cfg, workers)}; " + \
            self.update_words(cfg, workers)

    def overlap_words(self, cfg, workers: int) -> str:
        """Whether a worker's next steps overlap its push and pull, and which flag decided it."""
        if cfg.max_staleness is not None:
            return "no overlap (--max-staleness)"
        if cfg.local_steps > 1 and cfg.overlaps(workers):
            return "overlap (--overlap: a worker's next H steps go on from its own model while its push travels)"
        if cfg.local_steps > 1:
            return "no overlap (--local-steps: a worker's next steps start from the reply; --overlap turns it on)"
        if cfg.overlap is not None:
            return "overlap (--overlap)" if cfg.overlap else "no overlap (--no-overlap)"
        if cfg.overlaps(workers):
            return f"overlap (up to {AUTO_OVERLAP_MAX_WORKERS} workers; --no-overlap turns it off)"
        return f"no overlap (above {AUTO_OVERLAP_MAX_WORKERS} workers; --overlap turns it on)"

    def update_words(self, cfg, workers: int) -> str:
        """How a pushed gradient is applied: its damping for staleness, delay compensation, an outer step."""
        k = cfg.staleness_tolerance
        given = "--staleness-lr" if cfg.staleness_lr is not None else "--staleness-lr K sets another, 0 none"
        if k is None and cfg.staleness_lr is None:  # delayed-nesterov's default (config.DEFAULT_OUTER_OPTIMIZER)
            words = "every push undamped (--staleness-lr K damps the stale ones)"
        elif k is None:
            words = "every gradient at the full learning rate (--staleness-lr 0)"
        elif k == 1:
            words = f"each gradient at learning rate / staleness ({given})"
        else:
            words = f"a gradient more than {k:g} updates stale at learning rate x {k:g} / staleness ({given})"
        if cfg.delay_compensation is not None:
            words += f"; delay compensation, lambda {cfg.delay_compensation:g}"
        if cfg.local_steps > 1:
            words += (f"; local steps: each worker takes {cfg.local_steps} steps on its own, then pushes how far it "
                      f"moved, which the server applies as an outer {cfg.outer_rule} step (lr {cfg.outer_learning_rate:g}")
            delayed = cfg.outer_rule == "delayed-nesterov"
            words += (f", momentum {cfg.outer_beta:g} once every {workers} pushes{cfg.outer_beta_why()})" if delayed
                      else ")")
        return words

    def exchange_words(self, cfg, n: int, workers: int) -> str | None:
        return push_words(cfg, n)

    def chief(self, ctx: Context, progress: Progress) -> Trained:
        return Trained(state=AsyncServer(ctx, progress).run())

    def server(self, ctx: Context, progress=None) -> Trained:
        # Another server of --num-ps: the same loop over its slice, with no bar.
        return Trained(state=AsyncServer(ctx, Progress(False, None, ctx.global_batch)).run())

    def worker(self, ctx: Context, progress=None) -> Trained:
        exchange = worker_exchange(ctx, start_state(ctx))  # a mailbox on rank 0's host (another launch's worker)
        return Trained(worker=AsyncWorker(ctx, exchange).run())


ASYNC = AsyncMode()
