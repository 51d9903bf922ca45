"""--quorum's pieces below the loops (quorum.py): where the coordinator computes its own gradients
(CoordinatorPace: inline, or on a GradientThread while it is the slow one), the ring of updates
in flight to the other workers (UpdateRing of QuorumUpdate), and the calls between workers.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable

import numpy as np

from mpitrain.core.codec import encode
from mpitrain.core.layout import PS_RANK
from mpitrain.core.ledger import SyncDeal
from mpitrain.core.outer import InnerSteps, RoundSource
from mpitrain.duties.observe import WAIT
from mpitrain.exchange.mpi import await_verdict
from mpitrain.exchange.protocol import TAG_UPDATE, Message
from mpitrain.exchange.transport import Poller, tested
from mpitrain.membership.liveness import PeerLost
from mpitrain.modes.gradients import DealtBatches, GradientSource
from mpitrain.runtime import Context

SWITCH_INTERVAL_S = 1e-4  # --quorum: GIL hand-over between the MPI thread and the compute thread


# --quorum: updates the coordinator keeps for a worker still computing before it waits for it, and the
# memory they may take (a worker that far behind is a straggler at 32x: waiting costs little then).
UPDATES_IN_FLIGHT = 32


UPDATES_IN_FLIGHT_BYTES = 256 << 20


# --quorum: the coordinator computes its own gradients on its main thread while they take at most
# PACE_SLACK times as long as the Q-th fastest other worker's (CoordinatorPace). Not less: the coordinator's
# gradients measure slower than the others' even in plain sync (digits, 2 cores: 1.4-1.6x), and so
# do those of its thread when it is not slow (0.8-1.45x), while a straggler worth a thread is
# slower than that. One preempted step is not a slow coordinator either: it moves after PACE_RUN
# gradients in a row said so, and each other worker's time is the lower median of its last
# PACE_WINDOW pushes.
PACE_SLACK = 2.0
PACE_RUN, PACE_WINDOW = 3, 5
# On its thread, every PACE_PROBE-th gradient of its own is computed on the main thread instead, to see
# whether it is still the slow one there: on the thread its gradients measure slower than they would inline
# (the main thread's polling takes the GIL from it: digits, --local-steps 8, at --straggler 1:x1.3 3.7-5.7 ms
# a round there, 3.5 inline, the others' 1.7), so a coordinator that measures 1.4-1.6x the others inline
# could be sent there by a few slow rounds and never come back, every round it computed too late to count.
# A real straggler pays one step in PACE_PROBE held up by its probe: at --straggler 1:x5, 16 cost it 6-8% of
# its steps/s, 32 nothing this VM could tell (interleaved runs, 2026-11-30).
PACE_PROBE = 32


OWED_MARGIN_S = 2e-3  # --quorum: an update's trip to a worker and its push's back, on top of its compute time
UNHEARD_HOLDS = 3  # --quorum: holds for a worker never heard from before it is taken for a straggler (owed_until)


class GradientThread:
    """--quorum, on the coordinator when it is the slow one (CoordinatorPace): computes its gradients off the
    main thread, so the main thread keeps gathering the others' while a slow gradient of its own
    is still being computed. It works on its own snapshot of the parameters; the main thread owns
    all MPI calls."""

    def __init__(self, ctx: Context, source):
        be, n = ctx.backend, ctx.model.n_params
        self.ctx = ctx
        self.snapshot = be.xp.empty(n, be.xp.float32)
        self.grad = be.xp.empty(n, be.xp.float32)
        self.source = source  # a ContributionSource
        self.version: int | None = None  # None: idle; else the step its parameters belong to
        self.loss = float("nan")
        self.seconds = 0.0  # how long the last gradient took (CoordinatorPace)
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
                self.loss, t0 = self.compute(self.snapshot, self.version)
                self.ctx.activity.helper_computed(t0, t0 + self.seconds, self.version)
            except BaseException as e:  # surfaced on the main thread by `finished`
                self.error = e
            self._done.set()

    def compute(self, params, step: int) -> tuple[float, float]:
        """The next batch's gradient on `params` (of global step `step`) into `grad` (the straggler's
        pause included), on this thread, or on the main thread while this one is idle (CoordinatorPace).
        Its loss and when it started; `seconds` says how long it took."""
        t0 = time.perf_counter()
        loss = self.source.compute(params, self.grad, step)
        self.seconds = self.source.seconds
        return loss, t0


class ContributionSource:
    """What a worker computes towards one quorum update on the parameters of global step `step`: its batch
    of that update in the job's deal (core/ledger.SyncDeal), the gradient (GradientSource), or with
    --local-steps H a round of H inner steps on its batches of the H updates from there
    (outer.RoundSource). `compute(params, out, step)`; `seconds`, how long it took. A worker computes on
    the newest parameters it has, so it takes the batches of that step: those of the steps it skipped
    went to no update (the summary's `dropped`, by epoch: SyncStep.leave_out). `total`: the loop's budget, now."""

    def __init__(self, ctx: Context, deal: SyncDeal, total: Callable[[], int]):
        self.batches = DealtBatches(ctx, deal)
        self.source = GradientSource(ctx, batches=self.batches)
        if ctx.cfg.local_steps > 1:
            self.source = RoundSource(self.source, InnerSteps(ctx.cfg, ctx.model.n_params, ctx.backend.xp),
                                      ctx.lr_at, total)

    def compute(self, params, out, step: int) -> float:
        self.batches.step = step
        return self.source.compute(params, out, step)

    @property
    def seconds(self) -> float:
        return self.source.seconds


class QuorumUpdate:
    """--quorum, coordinator -> every other worker: one step's update. The payload is the averaged
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
    """--quorum, on the coordinator: each step's update goes to every other worker from a buffer of its
    own, free again once all its sends are done. A worker busy with a slow gradient receives the
    updates afterwards, in order; up to UPDATES_IN_FLIGHT wait for it (fewer for a big model),
    then the coordinator waits too."""

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
        comm, index = self.ctx.worker_comm, self.ctx.layout.worker_index
        update.reqs = [update.msg.send(comm, index(r), TAG_UPDATE) for r in self.peers]
        self.ctx.activity.moved(sent=update.msg.buf.nbytes * len(self.peers))
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


class CoordinatorPace:
    """--quorum, on the coordinator: where its own gradients are computed. On its main thread
    (`inline`) at first: no hand-over to a thread, and no polling beside the computation on the
    cores the other workers need; the pushes that came meanwhile count first. Once PACE_RUN
    gradients of its own in a row took more than PACE_SLACK times the Q-th fastest other
    worker's (each push says how long it took), on its gradient thread, so that a slow coordinator never
    holds a step up; back on its main thread once PACE_RUN in a row on the thread did not, or once a
    probe (every PACE_PROBE-th, computed inline) was not slow: a coordinator slower than the others for
    a few rounds by chance (start-up, a busy core) was kept on its thread for good and starved there,
    --quorum 1 of 2 --local-steps 8 counting [64, 1436] in CI."""

    def __init__(self, others: int, quorum: int):
        self.quorum = quorum
        self.others = [deque(maxlen=PACE_WINDOW) for _ in range(others)]  # their compute times, seconds
        self.inline = True
        self.run = 0  # its gradients in a row that said it computes in the wrong place
        self.threaded = 0  # its gradients on the thread (every PACE_PROBE-th: a probe, computed inline)
        self.probing = False  # the next gradient is a probe

    def heard(self, i: int, seconds: float) -> None:
        self.others[i].append(seconds)

    def computed(self, seconds: float) -> None:
        """One gradient of its own took `seconds`, inline or on the thread."""
        known = sorted(sorted(d)[(len(d) - 1) // 2] for d in self.others if d)  # lower medians
        if len(known) < self.quorum:
            return  # nothing to compare with yet
        slow = seconds > PACE_SLACK * known[self.quorum - 1]
        if self.probing:  # inline for once, from the thread: where it belongs now
            self.probing, self.inline, self.run = False, not slow, 0
            return
        if not self.inline:
            self.threaded += 1
        self.run = self.run + 1 if slow == self.inline else 0
        if self.run >= PACE_RUN:
            self.inline, self.run = not self.inline, 0
        elif not self.inline and self.threaded % PACE_PROBE == 0:
            self.inline = self.probing = True
