"""Sync with --quorum Q below the number of workers: each update averages the first Q gradients
computed on the current parameters, and nobody waits for the slowest. The coordinator gathers
(QuorumCoordinator, its own gradients inline or on a GradientThread as CoordinatorPace decides) and sends
every update through an UpdateRing; every other worker pushes its gradient and applies every
update in order (QuorumFollower). With --local-steps H, a worker's part is a round of H inner steps
from the global model (outer.RoundSource) and an update is an outer step of H global steps; the counts
of gradients contributed and dropped are of inner steps. No collective: a collective waits for every worker. Rank 0
follows the coordinator as in plain sync (sync.follow_coordinator). Who runs what: QuorumMode, at the end.
"""

from __future__ import annotations

import sys
import time
from collections import deque

import numpy as np

from mpitrain.core.compress import Pushes, push_words
from mpitrain.core.outer import round_span
from mpitrain.core.reports import LOSS_WINDOW, WorkerResult, mean_loss
from mpitrain.duties.checkpoint import TrainState
from mpitrain.duties.observe import COMPUTE, PUSH, WAIT
from mpitrain.exchange.protocol import (FLAG_LATE, FLAG_LEAVING, FLAG_STOP_STEP, HEADER_BYTES, TAG_QGRAD, TAG_UPDATE,
                                        Message, ProtocolError)
from mpitrain.exchange.transport import NO_REQUEST, WORKER_POLL_S, Poller
from mpitrain.exchange.waiting import poll
from mpitrain.membership.elastic import interrupted_at
from mpitrain.launch.faults import Kill
from mpitrain.modes.base import Trained
from mpitrain.modes.quorum_parts import (OWED_MARGIN_S, PACE_SLACK, SWITCH_INTERVAL_S, UNHEARD_HOLDS, CoordinatorPace,
                                         ContributionSource, GradientThread, QuorumUpdate, UpdateRing, arrived,
                                         between_workers)
from mpitrain.modes.gradients import sync_deal
from mpitrain.modes.sync import SyncMode, sync_result, sync_total, work
from mpitrain.modes.sync_outer import step_for
from mpitrain.runtime import Context

# The messages between workers travel on the workers' communicator (ranks: worker indices), not
# COMM_WORLD: after a regroup (elastic.py) the receives left posted on the old one can never take
# a message meant for the new one.
COORDINATOR_INDEX = 0

# Pushes that carry no gradient: a late round's time (FLAG_LATE), a worker's last word (FLAG_LEAVING).
HEADER_ONLY = FLAG_LATE | FLAG_LEAVING


def push_bytes(msg: Message) -> int:
    """What a push of the follower's, stamped, puts on the wire: its header alone, or all of it."""
    return HEADER_BYTES if msg.flags & HEADER_ONLY else msg.buf.nbytes


class QuorumCoordinator:
    """Sync with --quorum Q < workers, on the coordinator (worker 0). Each step takes the first Q
    gradients computed on the current parameters, in the order it sees them: its own or another
    worker's, pushed to it. It averages them, sends the average to every other worker
    (UpdateRing: it never waits for a worker that is still computing) and applies it. It computes
    its own gradients on its main thread unless it is the slow one (CoordinatorPace); then on its
    gradient thread, while the main thread gathers, so a slow gradient of its own never holds a
    step up: it is dropped like any late one. Rank 0 is not in the loop: it follows the coordinator's
    status, as in plain sync, and ends the run if a worker is lost."""

    def __init__(self, ctx: Context, start: TrainState, on_step=None):
        be, n = ctx.backend, ctx.model.n_params
        self.ctx, self.start, self.on_step, self.n, self.Q = ctx, start, on_step, n, ctx.cfg.quorum
        self.params = be.asarray(start.params)
        self.step_fn = step_for(ctx, self.params, start)
        self.step_fn.deal = sync_deal(ctx, start)
        self.total = sync_total(ctx, self.step_fn.deal)
        self.h = ctx.cfg.local_steps  # global steps per update (round_span)
        source = ContributionSource(ctx, self.step_fn.deal, lambda: self.total)
        self.helper = GradientThread(ctx, source)
        self.others = list(ctx.layout.worker_ranks[1:])
        wire = ctx.cfg.wire_dtype
        self.narrow = np.dtype(wire) != np.float32
        self.pushes = Pushes(ctx.cfg, n, be)  # the followers' contributions: read() widens or decodes them
        self.inbox = [Message(self.pushes.count, be.host_alloc, self.pushes.dtype) for _ in self.others]
        # float32 on the device; NumPy float32: the payload itself
        self.landing = [self.pushes.gradient(m.payload) for m in self.inbox]
        self.recv = [self._post(m, r) for m, r in zip(self.inbox, self.others)]
        self.updates = UpdateRing(ctx, self.others, Poller(WORKER_POLL_S, ctx.watch))
        self.kill = Kill(ctx.rank)
        self.pace = CoordinatorPace(len(self.others), self.Q)
        self.chosen: list[int] = []  # worker indices whose gradients are in the current step's sum
        self.own_for: int | None = None  # the step of its last own gradient: one per step at most
        self.own_loss = 0.0
        self.dropped = self.contributed = self.stopped = 0
        self.taken = [0] * ctx.workers  # gradients each worker has in the updates (its fair share: owed_until)
        self.held: tuple | None = None  # its own gradient for this step, held for a worker owed a turn
        self.unheard: list[int] = []  # the workers never heard from that the held gradient waits for
        self.unheard_holds = [0] * len(self.others)  # holds each such worker let expire (owed_until)
        self.sent_at = time.perf_counter()  # when the last update went out

    def run(self) -> WorkerResult:
        ctx, step_fn = self.ctx, self.step_fn
        # The main thread polls MPI between short sleeps; by default CPython lets the compute
        # thread keep the GIL for 5 ms before handing it back, which would make every step wait.
        switch = sys.getswitchinterval()
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        recent = deque([float("nan")], maxlen=LOSS_WINDOW)
        diverged, loss = None, float("nan")
        applied = step = self.start.global_step  # updates applied: where a regroup takes this worker's state from
        updates = 0
        with interrupted_at(lambda: step_fn.train_state(applied), lambda: (self.contributed, self.dropped)):
            try:
                while step < self.total:  # an update: one step, or with --local-steps a round (round_span)
                    updates += 1
                    self.kill.at(updates)
                    self.chosen = []
                    ctx.activity.enter(WAIT, step)
                    poll(lambda: self._gathered(step), WORKER_POLL_S, ctx.watch)
                    last = ctx.stop.due  # a stop, or room to make: this update is the last, and says so
                    loss = self._update(step, FLAG_STOP_STEP if last else 0)
                    if step_fn.why:
                        diverged = step
                        break
                    applied = step = step + round_span(step, self.total, self.h)
                    recent.append(loss)
                    if self.on_step is not None:
                        self.on_step(step, loss, step_fn)
                    if last:
                        self.total = step
                        break
            finally:
                self.helper.close()
                sys.setswitchinterval(switch)
            ctx.activity.enter(WAIT)
            poll(self._closed, WORKER_POLL_S, ctx.watch)
        timing = ctx.activity.times()
        if diverged is not None:
            return sync_result(step_fn, diverged, loss, timing, self.contributed, self.dropped)
        return sync_result(step_fn, max(self.total, self.start.global_step), mean_loss(recent), timing,
                            self.contributed, self.dropped)

    def _gathered(self, step: int) -> bool:
        """Take in what is ready for `step`; compute its own gradient, or start it on the thread,
        if the step still needs one. True once Q are in."""
        helper = self.helper
        if helper.finished:
            self.pace.computed(helper.seconds)
            if helper.version == step:
                self._offer_own(step, helper.grad, helper.loss)
            else:
                self.dropped += round_span(helper.version, self.total, self.h)  # on parameters of a closed step
            helper.discard()
        self._take_pushes(step)
        if self.held is not None and len(self.chosen) < self.Q and time.perf_counter() >= self.held[2]:
            self._add(0, *self.held[:2])  # nobody owed came in time
            self.held = None
            for i in self.unheard:
                self.unheard_holds[i] += 1
        if len(self.chosen) >= self.Q:
            return True
        if helper.idle and self.own_for != step:
            self.own_for = step
            if self.pace.inline:
                return self._compute_inline(step)
            helper.start(self.params, step)
        return False

    def _take_pushes(self, step: int) -> None:
        # Pushes that are in together: the worker with the fewest gradients counted first.
        for i in sorted(range(len(self.others)), key=lambda i: self.taken[i + 1]):
            rank = self.others[i]
            if len(self.chosen) < self.Q and self.recv[i] and arrived(self.ctx, self.recv[i], rank):
                self._receive(i, step)

    def _offer_own(self, step: int, grad, loss: float) -> None:
        """Its own gradient for `step` is ready: in at once, unless a worker with fewer gradients
        counted can still push one for this step in time (`owed_until`): then held until it does
        (the push goes in, its own is dropped if that makes Q) or until then (its own goes in).
        Without this the coordinator's own gradient, computed while the others still receive the last
        update, always came first: --quorum 1 of 2 counted [2994, 6] (issue #33)."""
        until = self.owed_until()
        if until is None:
            self._add(0, grad, loss)
        else:
            self.held = (grad, loss, until)

    def owed_until(self) -> float | None:
        """When the earliest push of a worker owed a turn is due: one with fewer gradients counted
        than the coordinator, not in this step yet, and not a straggler (its gradients take at most
        PACE_SLACK times the coordinator's). None when nobody is owed, or that time has passed. A
        worker's push is due PACE_SLACK times its (lower median) compute time after the last
        update went out, plus OWED_MARGIN_S for the messages.

        A worker never heard from is taken to be as fast as the coordinator, for UNHEARD_HOLDS holds:
        a worker whose contribution is always finished just after the coordinator's own (--local-steps
        8, 15% slower) was never waited for: --quorum 1 of 2 counted [350, 0] in 2 runs of 6. A
        straggler that lets them expire costs UNHEARD_HOLDS waits. Every contribution finished too
        late is reported all the same (FLAG_LATE, its time only): while late ones were dropped unsent,
        a worker whose first rounds were slow (start-up, a busy core) stayed a straggler for good, its
        pace never heard again: [1500, 0] in CI, [1492, 8] after a 1 s pause in its second round."""
        own, mine = self.taken[0], max(self.helper.seconds, 1e-9)
        due, self.unheard = [], []
        for i, times in enumerate(self.pace.others):
            if i + 1 in self.chosen or self.taken[i + 1] >= own:
                continue
            if times:
                t = sorted(times)[(len(times) - 1) // 2]
            elif self.unheard_holds[i] < UNHEARD_HOLDS:
                t = mine
                self.unheard.append(i)
            else:
                continue
            if t <= PACE_SLACK * mine:
                due.append(self.sent_at + PACE_SLACK * t + OWED_MARGIN_S)
        if not due or min(due) <= time.perf_counter():
            return None
        return min(due)

    def _compute_inline(self, step: int) -> bool:
        """Its own gradient for `step`, on the main thread (in the gradient thread's buffer: the
        thread is idle). The pushes that came meanwhile were first. True once Q are in."""
        helper, act = self.helper, self.ctx.activity
        act.enter(COMPUTE, step)
        loss, _ = helper.compute(self.params, step)
        act.stepped()
        act.enter(WAIT, step)
        self._take_pushes(step)
        self.pace.computed(helper.seconds)  # against what the pushes just taken say too
        if len(self.chosen) < self.Q:
            self._offer_own(step, helper.grad, loss)
        else:
            self.dropped += round_span(step, self.total, self.h)  # in time, but after Q others
        return len(self.chosen) >= self.Q

    def _receive(self, i: int, step: int | None) -> None:
        """Worker i's message, while step `step` is being gathered (None: after the last one)."""
        msg, rank = self.inbox[i], self.others[i]
        msg.check(TAG_QGRAD, rank)
        self.ctx.activity.moved(received=push_bytes(msg))
        if msg.flags & FLAG_LEAVING:
            self.stopped += 1  # that worker sends nothing more: its receive is not posted again
            return
        if step is not None and msg.step > step:
            raise ProtocolError(f"worker rank {rank} sent a gradient for step {msg.step} "
                                f"while the coordinator is at step {step}")
        self.pace.heard(i, msg.seconds)  # a late one's too: a worker that is always late is never waited for else
        if msg.step == step and not msg.flags & FLAG_LATE and len(self.chosen) < self.Q:
            self.pushes.read(msg.payload, self.landing[i])
            self._add(i + 1, self.landing[i], msg.loss)
        # else late: its worker learns from the update that it was left out, and counts it
        self.recv[i] = self._post(msg, rank)

    def _post(self, msg: Message, rank: int):
        return msg.listen(self.ctx.worker_comm, self.ctx.layout.worker_index(rank), TAG_QGRAD)

    def _add(self, w: int, grad, loss: float) -> None:
        buf, n = self.step_fn.buf, self.n
        if w == 0:
            self.own_loss = loss
        if self.chosen:
            buf[:n] += grad
            buf[n] += loss
        else:
            buf[:n] = grad
            buf[n] = loss
        self.chosen.append(w)

    def _update(self, step: int, flags: int = 0) -> float:
        """Average the step's gradients, send the average to every other worker, apply it."""
        ctx, be, buf, n = self.ctx, self.ctx.backend, self.step_fn.buf, self.n
        ctx.activity.enter(PUSH)
        buf[: n + 1] *= be.xp.float32(1.0 / len(self.chosen))
        update = self.updates.take()
        be.download(buf[:n], update.gradient)
        if self.narrow:
            be.upload(buf[:n], update.gradient)  # apply what the others will: the wire's rounding included
        update.weigh(self.chosen)
        update.msg.stamp(TAG_UPDATE, step, len(self.chosen), flags, float(buf[n]))
        self.updates.send(update)
        self.sent_at = time.perf_counter()
        for w in self.chosen:
            self.taken[w] += 1
        span = round_span(step, self.total, self.h)  # counted in gradients: --local-steps' rounds are H each
        if self.held is not None:  # held for a worker owed a turn, which came: Q without it
            self.dropped += span
            self.held = None
        own = 0 in self.chosen
        self.contributed += own * span
        self.step_fn.own_loss = self.own_loss if own else 0.0
        loss = self.step_fn.apply(step)
        if not self.step_fn.why:
            self.step_fn.leave_out(step, span, self.chosen)
        return loss

    def _closed(self) -> bool:
        """After the last step: every update delivered, and every other worker's last message
        (STOP) in, so that no receive is left posted."""
        for i, rank in enumerate(self.others):
            while self.recv[i] and arrived(self.ctx, self.recv[i], rank):
                self._receive(i, None)
        return self.stopped == len(self.others) and self.updates.delivered()


class QuorumFollower:
    """Sync with --quorum, on every worker but the coordinator: compute a gradient on the current
    parameters, push it to the coordinator (its time only, if the step already closed), and apply
    every update the coordinator sends, in order. One thread is enough: no collective waits for this
    worker, and the updates that come while it computes queue up until it takes them."""

    def __init__(self, ctx: Context, start: TrainState):
        be, n = ctx.backend, ctx.model.n_params
        self.ctx, self.start, self.n = ctx, start, n
        self.params = be.asarray(start.params)
        self.step_fn = step_for(ctx, self.params, start)
        self.coordinator = ctx.layout.worker_rank(0)
        # Two push buffers, alternating: a push the coordinator did not need may still be in flight when
        # the next gradient is computed. NumPy float32: computed straight into the message.
        self.pushes = Pushes(ctx.cfg, n, be)  # a scheme's part with --compress int8|int4 / --sparsify
        self.outs = [Message(self.pushes.count, be.host_alloc, self.pushes.dtype) for _ in range(2)]
        self.grads = [self.pushes.gradient(m.payload) for m in self.outs]
        self.sends = [NO_REQUEST] * 2
        self.update = QuorumUpdate(ctx)
        self.step_fn.deal = sync_deal(ctx, start)
        self.total = sync_total(ctx, self.step_fn.deal)
        self.source = ContributionSource(ctx, self.step_fn.deal, lambda: self.total)
        self.kill = Kill(ctx.rank)
        self.poller = Poller(WORKER_POLL_S, ctx.watch)
        self.h = ctx.cfg.local_steps  # global steps per update (outer.round_span)
        self.step = start.global_step  # updates applied: the parameters are those of this step
        self.pending = NO_REQUEST
        self.mine: int | None = None  # the step of the gradient pushed and not yet answered
        self.my_loss = 0.0
        self.computed = self.contributed = self.dropped = 0
        self.recent = deque([float("nan")], maxlen=LOSS_WINDOW)
        self.loss = float("nan")

    def run(self) -> WorkerResult:
        # self.step: the updates applied, in order
        with interrupted_at(lambda: self.step_fn.train_state(self.step), lambda: (self.contributed, self.dropped)):
            return self._run()

    def _run(self) -> WorkerResult:
        ctx, act, step_fn = self.ctx, self.ctx.activity, self.step_fn
        self._post()
        while self.step < self.total and not step_fn.why:
            step, slot = self.step, self.computed % 2
            act.enter(COMPUTE, step)
            self.kill.at(self.computed + 1)
            self._sent(slot)  # two pushes ago: long gone
            loss = self.source.compute(self.params, self.grads[slot], step)
            took = self.source.seconds
            act.stepped()
            self.computed += 1
            self._take_updates()
            if self.step != step or step_fn.why:
                self.dropped += round_span(step, self.total, self.h)  # the step closed while it was computed
                if not step_fn.why:
                    self._push(slot, step, FLAG_LATE, loss, took)  # its time still tells the coordinator its pace
                continue
            self._push(slot, step, 0, loss, took)
            self.mine, self.my_loss = step, loss
            act.enter(WAIT)
            poll(lambda: self._take_updates() and (self.step != step or step_fn.why), WORKER_POLL_S, ctx.watch)
        act.enter(WAIT)
        self._sent(0)
        self._push(0, self.step, FLAG_LEAVING, 0.0)  # no more from this worker
        between_workers(ctx, lambda: self.poller.all(self.sends, [self.coordinator] * 2))
        timing = act.times()
        if step_fn.why:
            return sync_result(step_fn, self.step, self.loss, timing, self.contributed, self.dropped)
        return sync_result(step_fn, max(self.total, self.start.global_step), mean_loss(self.recent), timing,
                            self.contributed, self.dropped)

    def _sent(self, slot: int) -> None:
        between_workers(self.ctx, lambda: self.poller.all([self.sends[slot]], [self.coordinator]))

    def _push(self, slot: int, step: int, flags: int, loss: float, seconds: float = 0.0) -> None:
        """A contribution for `step`; flagged FLAG_LATE or FLAG_LEAVING, its header only (the
        coordinator's receive, posted for a whole one, takes a shorter message)."""
        self.ctx.activity.enter(PUSH)
        out = self.outs[slot]
        out.stamp(TAG_QGRAD, step, self.computed, flags, loss, seconds)
        nbytes = push_bytes(out)
        if nbytes == out.buf.nbytes:  # (a header alone sends nothing of the gradient: no feedback taken)
            self.pushes.write(self.grads[slot], out.payload)
        self.sends[slot] = out.send(self.ctx.worker_comm, COORDINATOR_INDEX, TAG_QGRAD, nbytes)
        self.ctx.activity.moved(sent=nbytes)

    def _post(self) -> None:
        if self.step < self.total:
            self.pending = self.update.msg.listen(self.ctx.worker_comm, COORDINATOR_INDEX, TAG_UPDATE)

    def _take_updates(self) -> bool:
        """Apply every update that came, in order; True if any did."""
        took = False
        while self.pending and arrived(self.ctx, self.pending, self.coordinator):
            took = True
            self._apply()
            if not self.step_fn.why:
                self._post()
        return took

    def _apply(self) -> None:
        u, step_fn, n = self.update, self.step_fn, self.n
        u.msg.check(TAG_UPDATE, self.coordinator, count=n + self.ctx.workers)
        self.ctx.activity.moved(received=u.msg.buf.nbytes)
        if u.msg.step != self.step:
            raise ProtocolError(f"the coordinator sent the update of step {u.msg.step} "
                                f"while this worker is at step {self.step}")
        step_fn.own_loss = 0.0
        if self.mine == self.step:
            if u.chose(self.ctx.worker_index):
                self.contributed += round_span(self.step, self.total, self.h)
                step_fn.own_loss = self.my_loss
            else:
                self.dropped += round_span(self.step, self.total, self.h)  # in time, but after Q others
            self.mine = None
        self.ctx.backend.upload(step_fn.buf[:n], u.gradient)
        step_fn.buf[n] = u.msg.loss
        self.loss = step_fn.apply(self.step)
        if not step_fn.why:
            self.recent.append(self.loss)
            span = round_span(self.step, self.total, self.h)
            step_fn.leave_out(self.step, span, [w for w in range(self.ctx.workers) if u.chose(w)])
            self.step += span
            if u.msg.flags & FLAG_STOP_STEP:
                self.total = self.step  # the coordinator's last update: a stop was requested


def train(ctx: Context, start: TrainState, on_step=None) -> WorkerResult:
    """The --quorum loop of a sync worker: the coordinator's or a follower's (sync.work calls it)."""
    if ctx.worker_index == 0:
        return QuorumCoordinator(ctx, start, on_step).run()
    return QuorumFollower(ctx, start).run()


class QuorumMode(SyncMode):
    """Sync --quorum Q below the number of workers: each step averages the first Q gradients; the
    coordinator (worker 0) decides which, rank 0 and the servers follow as in plain sync."""

    name = "sync"  # the summary's mode: sync, with its quorum
    short_last_step = False  # (sync_total) a worker without a batch would have nothing to push; the few batches
    # left below the worker count are not dealt, and the last epoch says so (not complete)
    leaves_out = True

    def worker_arrays(self, cfg) -> tuple[str, ...]:
        return ()  # its pushes' residuals and inner optimizers stay on each worker (Mode.worker_arrays)

    def worker(self, ctx: Context, progress=None) -> Trained:
        return Trained(worker=work(ctx, train))

    def exchange_words(self, cfg, n: int, workers: int) -> str | None:
        return push_words(cfg, n, "quorum's pushes to the coordinator", "it sends each step's average")

    def waits_for(self, cfg, workers: int) -> str:
        return f"waiting for the workers' --quorum steps ({cfg.quorum} of {workers} gradients each)"

    def averaging(self, cfg, workers: int) -> str:
        return (f"the first {cfg.quorum} of the {workers} workers to finish their steps average their models "
                f"(one message each way instead of {cfg.local_steps})")


QUORUM = QuorumMode()
