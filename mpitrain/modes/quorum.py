"""Sync with --quorum Q below the number of workers: each update averages the first Q gradients
computed on the current parameters, and nobody waits for the slowest. The chief worker gathers
(QuorumChief, its own gradients inline or on a GradientThread as ChiefPace decides) and sends
every update through an UpdateRing; every other worker pushes its gradient and applies every
update in order (QuorumFollower). No collective: a collective waits for every worker. Rank 0
follows the chief as in plain sync (sync.follow_chief). Who runs what: QuorumMode, at the end.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import deque

import numpy as np
from mpi4py import MPI

from mpitrain.checkpoint import TrainState
from mpitrain.codec import encode
from mpitrain.elastic import Regroup
from mpitrain.faults import Kill
from mpitrain.gradients import LOSS_WINDOW, GradientSource, WorkerResult, mean_loss
from mpitrain.layout import PS_RANK
from mpitrain.liveness import PeerLost
from mpitrain.observe import COMPUTE, PUSH, WAIT
from mpitrain.protocol import FLAG_STOP, FLAG_STOP_STEP, TAG_QGRAD, TAG_UPDATE, Message, ProtocolError
from mpitrain.runtime import Context
from mpitrain.stopping import STOP
from mpitrain.modes.base import Trained
from mpitrain.modes.sync import SyncMode, SyncStep, await_verdict, sync_result, work
from mpitrain.transport import WORKER_POLL_S, Poller, tested
from mpitrain.waiting import poll

# The messages between workers travel on the workers' communicator (ranks: worker indices), not
# COMM_WORLD: after a regroup (elastic.py) the receives left posted on the old one can never take
# a message meant for the new one.
CHIEF_INDEX = 0
SWITCH_INTERVAL_S = 1e-4  # --quorum: GIL hand-over between the MPI thread and the compute thread
# --quorum: updates the chief keeps for a worker still computing before it waits for it, and the
# memory they may take (a worker that far behind is a straggler at 32x: waiting costs little then).
UPDATES_IN_FLIGHT = 32
UPDATES_IN_FLIGHT_BYTES = 256 << 20
# --quorum: the chief computes its own gradients on its main thread while they take at most
# PACE_SLACK times as long as the Q-th fastest other worker's (ChiefPace). Not less: the chief's
# gradients measure slower than the others' even in plain sync (digits, 2 cores: 1.4-1.6x), and so
# do those of its thread when it is not slow (0.8-1.45x), while a straggler worth a thread is
# slower than that. One preempted step is not a slow chief either: it moves after PACE_RUN
# gradients in a row said so, and each other worker's time is the lower median of its last
# PACE_WINDOW pushes.
PACE_SLACK = 2.0
OWED_MARGIN_S = 2e-3  # --quorum: an update's trip to a worker and its push's back, on top of its compute time
PACE_RUN, PACE_WINDOW = 3, 5


class GradientThread:
    """--quorum, on the chief when it is the slow one (ChiefPace): computes its gradients off the
    main thread, so the main thread keeps gathering the others' while a slow gradient of its own
    is still being computed. It works on its own snapshot of the parameters; the main thread owns
    all MPI calls."""

    def __init__(self, ctx: Context, taken: int = 0):
        be, n = ctx.backend, ctx.model.n_params
        self.ctx = ctx
        self.snapshot = be.xp.empty(n, be.xp.float32)
        self.grad = be.xp.empty(n, be.xp.float32)
        self.source = GradientSource(ctx, taken)
        self.version: int | None = None  # None: idle; else the step its parameters belong to
        self.loss = float("nan")
        self.seconds = 0.0  # how long the last gradient took (ChiefPace)
        self.error: BaseException | None = None
        self._go, self._done, self._quit = threading.Event(), threading.Event(), False
        self._thread = threading.Thread(target=self._run, name="mpitrain-gradient", daemon=True)
        self._thread.start()

    def start(self, params, version: int) -> None:
        self.snapshot[...] = params
        self.version = version
        self._done.clear()
        self._go.set()

    @property
    def idle(self) -> bool:
        return self.version is None

    @property
    def finished(self) -> bool:
        if self.error is not None:
            raise RuntimeError("the gradient thread failed") from self.error
        return self.version is not None and self._done.is_set()

    def discard(self) -> None:
        self.version = None

    def close(self) -> None:
        self._done.wait()  # a gradient still being computed at the end is simply not used
        self._quit = True
        self._go.set()
        self._thread.join()

    def _run(self) -> None:
        be = self.ctx.backend
        if be.is_gpu:
            be.cp.cuda.Device(be.device_id).use()  # CuPy's current device is per thread
        self._done.set()
        while True:
            self._go.wait()
            self._go.clear()
            if self._quit:
                return
            try:
                self.loss, t0 = self.compute(self.snapshot)
                self.ctx.activity.helper_computed(t0, t0 + self.seconds, self.version)
            except BaseException as e:  # surfaced on the main thread by `finished`
                self.error = e
            self._done.set()

    def compute(self, params) -> tuple[float, float]:
        """The next batch's gradient on `params` into `grad` (the straggler's pause included), on
        this thread, or on the main thread while this one is idle (ChiefPace). Its loss and when it
        started; `seconds` says how long it took."""
        t0 = time.perf_counter()
        loss = self.source.compute(params, self.grad)
        self.seconds = self.source.seconds
        return loss, t0


class QuorumUpdate:
    """--quorum, chief -> every other worker: one step's update. The payload is the averaged
    gradient, which every worker applies with its own optimizer (replicas stay bitwise identical),
    then one weight per worker, 1 if its gradient is in the average; the mean loss rides in the
    header. Wire-typed like every gradient (--compress), weights included (0 and 1 are exact)."""

    def __init__(self, ctx: Context):
        be, n = ctx.backend, ctx.model.n_params
        self.msg = Message(n + ctx.workers, be.host_alloc, ctx.cfg.wire_dtype)
        self.gradient, self.weights = self.msg.payload[:n], self.msg.payload[n:]
        self.xp = np if isinstance(self.msg.payload, np.ndarray) else be.xp  # device memory with CUDA-aware MPI
        self.reqs: list = []  # its sends, one per other worker

    def weigh(self, chosen: list[int]) -> None:
        weights = np.zeros(len(self.weights), np.float32)
        weights[chosen] = 1.0
        encode(self.xp, self.xp.asarray(weights), self.weights)

    def chose(self, w: int) -> bool:
        return bool(self.weights[w] != 0)  # 0 is all-zero bits in every wire type


class UpdateRing:
    """--quorum, on the chief: each step's update goes to every other worker from a buffer of its
    own, free again once all its sends are done. A worker busy with a slow gradient receives the
    updates afterwards, in order; up to UPDATES_IN_FLIGHT wait for it (fewer for a big model),
    then the chief waits too."""

    def __init__(self, ctx: Context, peers: list[int], poller: Poller):
        self.ctx, self.peers, self.poller = ctx, peers, poller
        self.busy: deque[QuorumUpdate] = deque()
        self.free: list[QuorumUpdate] = [QuorumUpdate(ctx)]
        self.most = max(2, min(UPDATES_IN_FLIGHT, UPDATES_IN_FLIGHT_BYTES // self.free[0].msg.buf.nbytes))
        self.made = 1

    def take(self) -> QuorumUpdate:
        self._reap()
        if self.free:
            return self.free.pop()
        if self.made < self.most:
            self.made += 1
            return QuorumUpdate(self.ctx)
        oldest = self.busy.popleft()
        act = self.ctx.activity
        phase = act.phase
        act.enter(WAIT)  # on the workers that are behind, not on rank 0 (what a stall line says)
        between_workers(self.ctx, lambda: self.poller.all(oldest.reqs, self.peers))
        act.enter(phase)
        return oldest

    def send(self, update: QuorumUpdate) -> None:
        spec = update.msg.spec()
        comm, index = self.ctx.worker_comm, self.ctx.layout.worker_index
        update.reqs = [comm.Isend(spec, dest=index(r), tag=TAG_UPDATE) for r in self.peers]
        self.busy.append(update)

    def delivered(self) -> bool:
        self._reap()
        return not self.busy

    def _reap(self) -> None:
        def sent(u: QuorumUpdate) -> bool:
            return all(tested(r, p) for r, p in zip(u.reqs, self.peers))

        while self.busy and between_workers(self.ctx, lambda: sent(self.busy[0])):
            self.free.append(self.busy.popleft())


def between_workers(ctx: Context, call):
    """Run `call` (an MPI wait or test between workers). A message to or from a worker that failed
    is the lost worker's case, which rank 0 judges (await_verdict); rank 0 lost raises on."""
    try:
        return call()
    except PeerLost as e:
        if PS_RANK in e.lost:
            raise
        await_verdict(ctx, next(iter(e.lost.values())))


def arrived(ctx: Context, req, peer: int) -> bool:
    """Whether `req`, a message between workers, is complete (`tested`, through between_workers)."""
    return between_workers(ctx, lambda: tested(req, peer))


class ChiefPace:
    """--quorum, on the chief: where its own gradients are computed. On its main thread
    (`inline`) at first: no hand-over to a thread, and no polling beside the computation on the
    cores the other workers need; the pushes that came meanwhile count first. Once PACE_RUN
    gradients of its own in a row took more than PACE_SLACK times the Q-th fastest other
    worker's (each push says how long it took), on its gradient thread, so that a slow chief never
    holds a step up; back on its main thread once PACE_RUN in a row on the thread did not."""

    def __init__(self, others: int, quorum: int):
        self.quorum = quorum
        self.others = [deque(maxlen=PACE_WINDOW) for _ in range(others)]  # their compute times, seconds
        self.inline = True
        self.run = 0  # its gradients in a row that said it computes in the wrong place

    def heard(self, i: int, seconds: float) -> None:
        self.others[i].append(seconds)

    def computed(self, seconds: float) -> None:
        """One gradient of its own took `seconds`, inline or on the thread."""
        known = sorted(sorted(d)[(len(d) - 1) // 2] for d in self.others if d)  # lower medians
        if len(known) < self.quorum:
            return  # nothing to compare with yet
        slow = seconds > PACE_SLACK * known[self.quorum - 1]
        self.run = self.run + 1 if slow == self.inline else 0
        if self.run >= PACE_RUN:
            self.inline, self.run = not self.inline, 0


class QuorumChief:
    """Sync with --quorum Q < workers, on the chief worker (worker 0). Each step takes the first Q
    gradients computed on the current parameters, in the order it sees them: its own or another
    worker's, pushed to it. It averages them, sends the average to every other worker
    (UpdateRing: it never waits for a worker that is still computing) and applies it. It computes
    its own gradients on its main thread unless it is the slow one (ChiefPace); then on its
    gradient thread, while the main thread gathers, so a slow gradient of its own never holds a
    step up: it is dropped like any late one. Rank 0 is not in the loop: it follows the chief's
    status, as in plain sync, and ends the run if a worker is lost."""

    def __init__(self, ctx: Context, start: TrainState, on_step=None):
        be, n = ctx.backend, ctx.model.n_params
        self.ctx, self.start, self.on_step, self.n, self.Q = ctx, start, on_step, n, ctx.cfg.quorum
        self.params = be.asarray(start.params)
        self.step_fn = SyncStep(ctx, self.params, start)
        self.helper = GradientThread(ctx, start.position(ctx.worker_index))
        self.others = list(ctx.layout.worker_ranks[1:])
        wire = ctx.cfg.wire_dtype
        self.narrow = np.dtype(wire) != np.float32
        self.inbox = [Message(n, be.host_alloc, wire) for _ in self.others]
        self.landing = [be.mirror(m.payload) for m in self.inbox]  # float32 on the device; NumPy: the payload
        self.recv = [self._post(m, r) for m, r in zip(self.inbox, self.others)]
        self.updates = UpdateRing(ctx, self.others, Poller(WORKER_POLL_S, ctx.watch))
        self.kill = Kill(ctx.rank)
        self.pace = ChiefPace(len(self.others), self.Q)
        self.chosen: list[int] = []  # worker indices whose gradients are in the current step's sum
        self.own_for: int | None = None  # the step of its last own gradient: one per step at most
        self.own_loss = 0.0
        self.dropped = self.contributed = self.stopped = 0
        self.taken = [0] * ctx.workers  # gradients each worker has in the updates (its fair share: owed_until)
        self.held: tuple | None = None  # its own gradient for this step, held for a worker owed a turn
        self.sent_at = time.perf_counter()  # when the last update went out

    def run(self) -> WorkerResult:
        ctx, step_fn = self.ctx, self.step_fn
        # The main thread polls MPI between short sleeps; by default CPython lets the compute
        # thread keep the GIL for 5 ms before handing it back, which would make every step wait.
        switch = sys.getswitchinterval()
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        total = ctx.global_step_budget
        recent = deque([float("nan")], maxlen=LOSS_WINDOW)
        diverged, loss = None, float("nan")
        applied = self.start.global_step  # updates applied: where a regroup takes this worker's state from
        try:
            for step in range(self.start.global_step, total):
                self.kill.at(step - self.start.global_step + 1)
                self.chosen = []
                ctx.activity.enter(WAIT, step)
                poll(lambda: self._gathered(step), WORKER_POLL_S, ctx.watch)
                last = STOP.requested  # a stop request: this update is the last, and says so
                loss = self._update(step, FLAG_STOP_STEP if last else 0)
                if step_fn.why:
                    diverged = step
                    break
                applied = step + 1
                recent.append(loss)
                if self.on_step is not None:
                    self.on_step(step + 1, loss, step_fn)
                if last:
                    total = step + 1
                    break
        except Regroup as r:
            r.state, r.counts = step_fn.train_state(applied), (self.contributed, self.dropped)
            raise
        finally:
            self.helper.close()
            sys.setswitchinterval(switch)
        ctx.activity.enter(WAIT)
        try:
            poll(self._closed, WORKER_POLL_S, ctx.watch)
        except Regroup as r:
            r.state, r.counts = step_fn.train_state(applied), (self.contributed, self.dropped)
            raise
        timing = ctx.activity.times()
        if diverged is not None:
            return sync_result(step_fn, diverged, loss, timing, self.contributed, self.dropped)
        return sync_result(step_fn, max(total, self.start.global_step), mean_loss(recent), timing,
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
                self.dropped += 1  # computed on parameters of a step that closed without it
            helper.discard()
        self._take_pushes(step)
        if self.held is not None and len(self.chosen) < self.Q and time.perf_counter() >= self.held[2]:
            self._add(0, *self.held[:2])  # nobody owed came in time
            self.held = None
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
        Without this the chief's own gradient, computed while the others still receive the last
        update, always came first: --quorum 1 of 2 counted [2994, 6] (issue #33)."""
        until = self.owed_until()
        if until is None:
            self._add(0, grad, loss)
        else:
            self.held = (grad, loss, until)

    def owed_until(self) -> float | None:
        """When the earliest push of a worker owed a turn is due: one with fewer gradients counted
        than the chief, not in this step yet, and not a straggler (its gradients take at most
        PACE_SLACK times the chief's). None when nobody is owed, or that time has passed. A
        worker's push is due PACE_SLACK times its (lower median) compute time after the last
        update went out, plus OWED_MARGIN_S for the messages."""
        own, mine = self.taken[0], max(self.helper.seconds, 1e-9)
        due = []
        for i, times in enumerate(self.pace.others):
            if i + 1 in self.chosen or self.taken[i + 1] >= own or not times:
                continue
            t = sorted(times)[(len(times) - 1) // 2]
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
        loss, _ = helper.compute(self.params)
        act.stepped()
        act.enter(WAIT, step)
        self._take_pushes(step)
        self.pace.computed(helper.seconds)  # against what the pushes just taken say too
        if len(self.chosen) < self.Q:
            self._offer_own(step, helper.grad, loss)
        else:
            self.dropped += 1  # in time, but after Q others
        return len(self.chosen) >= self.Q

    def _receive(self, i: int, step: int | None) -> None:
        """Worker i's message, while step `step` is being gathered (None: after the last one)."""
        msg, rank = self.inbox[i], self.others[i]
        msg.check(TAG_QGRAD, rank)
        if msg.flags & FLAG_STOP:
            self.stopped += 1  # that worker sends nothing more: its receive is not posted again
            return
        if step is not None and msg.step > step:
            raise ProtocolError(f"worker rank {rank} sent a gradient for step {msg.step} "
                                f"while the chief is at step {step}")
        self.pace.heard(i, msg.seconds)
        if msg.step == step and len(self.chosen) < self.Q:
            self.ctx.backend.upload(self.landing[i], msg.payload)
            self._add(i + 1, self.landing[i], msg.loss)
        # else late: its worker learns from the update that it was left out, and counts it
        self.recv[i] = self._post(msg, rank)

    def _post(self, msg: Message, rank: int):
        return self.ctx.worker_comm.Irecv(msg.spec(), source=self.ctx.layout.worker_index(rank), tag=TAG_QGRAD)

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
        if self.held is not None:  # held for a worker owed a turn, which came: Q without it
            self.dropped += 1
            self.held = None
        own = 0 in self.chosen
        self.contributed += own
        self.step_fn.own_loss = self.own_loss if own else 0.0
        return self.step_fn.apply(step)

    def _closed(self) -> bool:
        """After the last step: every update delivered, and every other worker's last message
        (STOP) in, so that no receive is left posted."""
        for i, rank in enumerate(self.others):
            while self.recv[i] and arrived(self.ctx, self.recv[i], rank):
                self._receive(i, None)
        return self.stopped == len(self.others) and self.updates.delivered()


class QuorumFollower:
    """Sync with --quorum, on every worker but the chief: compute a gradient on the current
    parameters, push it to the chief unless the step already closed, and apply every update the
    chief sends, in order. One thread is enough: no collective waits for this worker, and the
    updates that come while it computes queue up until it takes them."""

    def __init__(self, ctx: Context, start: TrainState):
        be, n = ctx.backend, ctx.model.n_params
        self.ctx, self.start, self.n = ctx, start, n
        self.params = be.asarray(start.params)
        self.step_fn = SyncStep(ctx, self.params, start)
        self.chief = ctx.layout.worker_rank(0)
        # Two push buffers, alternating: a push the chief did not need may still be in flight when
        # the next gradient is computed. NumPy float32: computed straight into the message.
        self.outs = [Message(n, be.host_alloc, ctx.cfg.wire_dtype) for _ in range(2)]
        self.grads = [be.mirror(m.payload) for m in self.outs]
        self.sends = [MPI.REQUEST_NULL] * 2
        self.update = QuorumUpdate(ctx)
        self.source = GradientSource(ctx, start.position(ctx.worker_index))
        self.kill = Kill(ctx.rank)
        self.poller = Poller(WORKER_POLL_S, ctx.watch)
        self.total = ctx.global_step_budget
        self.step = start.global_step  # updates applied: the parameters are those of this step
        self.pending = MPI.REQUEST_NULL
        self.mine: int | None = None  # the step of the gradient pushed and not yet answered
        self.my_loss = 0.0
        self.computed = self.contributed = self.dropped = 0
        self.recent = deque([float("nan")], maxlen=LOSS_WINDOW)
        self.loss = float("nan")

    def run(self) -> WorkerResult:
        try:
            return self._run()
        except Regroup as r:  # self.step: the updates applied, in order
            r.state, r.counts = self.step_fn.train_state(self.step), (self.contributed, self.dropped)
            raise

    def _run(self) -> WorkerResult:
        ctx, act, step_fn = self.ctx, self.ctx.activity, self.step_fn
        self._post()
        while self.step < self.total and not step_fn.why:
            step, slot = self.step, self.computed % 2
            act.enter(COMPUTE, step)
            self.kill.at(self.computed + 1)
            self._sent(slot)  # two pushes ago: long gone
            loss = self.source.compute(self.params, self.grads[slot])
            took = self.source.seconds
            act.stepped()
            self.computed += 1
            self._take_updates()
            if self.step != step or step_fn.why:
                self.dropped += 1  # the step closed while this gradient was computed
                continue
            self._push(slot, step, 0, loss, took)
            self.mine, self.my_loss = step, loss
            act.enter(WAIT)
            poll(lambda: self._take_updates() and (self.step != step or step_fn.why), WORKER_POLL_S, ctx.watch)
        act.enter(WAIT)
        self._sent(0)
        self._push(0, self.step, FLAG_STOP, 0.0)  # no more from this worker
        between_workers(ctx, lambda: self.poller.all(self.sends, [self.chief] * 2))
        timing = act.times()
        if step_fn.why:
            return sync_result(step_fn, self.step, self.loss, timing, self.contributed, self.dropped)
        return sync_result(step_fn, max(self.total, self.start.global_step), mean_loss(self.recent), timing,
                            self.contributed, self.dropped)

    def _sent(self, slot: int) -> None:
        between_workers(self.ctx, lambda: self.poller.all([self.sends[slot]], [self.chief]))

    def _push(self, slot: int, step: int, flags: int, loss: float, seconds: float = 0.0) -> None:
        self.ctx.activity.enter(PUSH)
        out = self.outs[slot]
        self.ctx.backend.download(self.grads[slot], out.payload)
        out.stamp(TAG_QGRAD, step, self.computed, flags, loss, seconds)
        self.sends[slot] = self.ctx.worker_comm.Isend(out.spec(), dest=CHIEF_INDEX, tag=TAG_QGRAD)

    def _post(self) -> None:
        if self.step < self.total:
            self.pending = self.ctx.worker_comm.Irecv(self.update.msg.spec(), source=CHIEF_INDEX, tag=TAG_UPDATE)

    def _take_updates(self) -> bool:
        """Apply every update that came, in order; True if any did."""
        took = False
        while self.pending and arrived(self.ctx, self.pending, self.chief):
            took = True
            self._apply()
            if not self.step_fn.why:
                self._post()
        return took

    def _apply(self) -> None:
        u, step_fn, n = self.update, self.step_fn, self.n
        u.msg.check(TAG_UPDATE, self.chief, count=n + self.ctx.workers)
        if u.msg.step != self.step:
            raise ProtocolError(f"the chief sent the update of step {u.msg.step} "
                                f"while this worker is at step {self.step}")
        step_fn.own_loss = 0.0
        if self.mine == self.step:
            if u.chose(self.ctx.worker_index):
                self.contributed += 1
                step_fn.own_loss = self.my_loss
            else:
                self.dropped += 1  # in time, but after Q others
            self.mine = None
        self.ctx.backend.upload(step_fn.buf[:n], u.gradient)
        step_fn.buf[n] = u.msg.loss
        self.loss = step_fn.apply(self.step)
        if not step_fn.why:
            self.recent.append(self.loss)
            self.step += 1
            if u.msg.flags & FLAG_STOP_STEP:
                self.total = self.step  # the chief's last update: a stop was requested


def train(ctx: Context, start: TrainState, on_step=None) -> WorkerResult:
    """The --quorum loop of a sync worker: the chief's or a follower's (sync.work calls it)."""
    if ctx.worker_index == 0:
        return QuorumChief(ctx, start, on_step).run()
    return QuorumFollower(ctx, start).run()


class QuorumMode(SyncMode):
    """Sync --quorum Q below the number of workers: each step averages the first Q gradients; the
    chief worker (worker 0) decides which, rank 0 and the servers follow as in plain sync."""

    name = "sync"  # the summary's mode: sync, with its quorum

    def worker(self, ctx: Context, progress=None) -> Trained:
        return Trained(worker=work(ctx, train))

    def waits_for(self, cfg, workers: int) -> str:
        return f"waiting for the workers' --quorum steps ({cfg.quorum} of {workers} gradients each)"


QUORUM = QuorumMode()
