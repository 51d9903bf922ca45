"""The parameter servers: rank 0, and with --num-ps K ranks 1..K-1 too, each owning one slice
(shard) of the master parameters and its optimizer state; rank 0 is the chief that evaluates,
logs and checkpoints.

Async: one pre-posted Irecv per worker; whichever gradient completes is applied and answered
with fresh parameters (held back, with --max-staleness, while applying it would leave another
worker's gradient too stale). Each server does this for its own slice, on its own; rank 0 gathers
the others' slices only to evaluate or save (shards.py). Sync: the workers average among
themselves (with --quorum, the chief worker gathers each step's first Q gradients, worker.py);
rank 0 follows the chief worker's status messages and receives the state at eval, checkpoint
and end, each server its slice.
"""

from __future__ import annotations

import math
import sys
import time
from collections import Counter, deque
from dataclasses import dataclass, field

import numpy as np
from mpi4py import MPI

from mpitrain import checkpoint
from mpitrain.checkpoint import Checkpointer, TrainState
from mpitrain.codec import decode, encode
from mpitrain.guard import NON_FINITE, LossGuard
from mpitrain.layout import PS_RANK
from mpitrain.liveness import PeerLost
from mpitrain.console import say
from mpitrain.metrics import Progress, RunLog
from mpitrain.observe import APPLY, CHECKPOINT, EVAL, PUSH, WAIT, attribute, step_time_from_beat
from mpitrain.optim import Optimizer, make_ema, staleness_scaled_lr
from mpitrain.protocol import (FLAG_CKPT, FLAG_DIVERGED, FLAG_EVAL, FLAG_LAST, FLAG_STOP, TAG_GRAD, TAG_PARAMS, TAG_SHARD,
                               TAG_STATUS, Message, ProtocolError)
from mpitrain.runtime import Context, start_state
from mpitrain.shards import Gather, ShardService, assemble
from mpitrain.stopping import STOP
from mpitrain.transport import CHIEF_POLL_S, PS_POLL_NO_OVERLAP_S, PS_POLL_S, Poller, tested
from mpitrain.worker import LOSS_WINDOW


@dataclass
class ServerState:
    params: np.ndarray
    global_step: int = 0
    local_steps: list[int] = field(default_factory=list)
    recent_losses: deque = field(default_factory=lambda: deque(maxlen=LOSS_WINDOW))
    staleness: Counter = field(default_factory=Counter)  # staleness -> applied gradients
    eval_history: list[dict] = field(default_factory=list)
    checkpoints: list[str] = field(default_factory=list)  # written by this run, oldest first
    ema: np.ndarray | None = None  # --ema-decay: the averaged parameters at the end
    start_step: int = 0  # > 0 when resumed
    diverged: dict | None = None  # {"global_step", "ranks", "loss"} once a loss was not finite
    log: RunLog | None = None  # --log-dir
    lost_workers: list[dict] = field(default_factory=list)  # async: workers declared lost, in order
    train_s: float = 0.0
    busy_fraction: float = 0.0
    bytes_in: int = 0  # message bytes this server received and sent while training (--num-ps rows)
    bytes_out: int = 0

    @property
    def final_loss(self) -> float:
        return float(np.mean(self.recent_losses)) if self.recent_losses else float("nan")


def begin(ctx: Context) -> tuple[TrainState, ServerState, Checkpointer]:
    """The start state (fresh or resumed, broadcast to the workers), rank 0's view of it, and the
    checkpointer (which will not save the step it resumed from again)."""
    start = start_state(ctx)
    state = ServerState(start.params, global_step=start.global_step, local_steps=list(start.positions),
                        start_step=start.global_step)
    cfg = ctx.cfg
    if cfg.log_dir and ctx.rank == PS_RANK:
        state.log = RunLog(cfg.log_dir, {"mode": "local" if ctx.local else cfg.mode, "model": ctx.model.description,
                                         "dataset": ctx.data.name, "world_size": ctx.size, "workers": ctx.workers,
                                         "start_step": start.global_step}, cfg.log_every)
    ckpt = Checkpointer(ctx.cfg, ctx.fingerprint)
    ckpt.mark(start.global_step)
    state.checkpoints = ckpt.saved  # the same list: it grows as rank 0 saves
    return start, state, ckpt


class Clock:
    """Wall and CPU time of rank 0 over training: busy fraction = CPU / wall."""

    def __init__(self):
        self.wall0, self.cpu0 = time.perf_counter(), time.process_time()

    def elapsed(self) -> float:
        return time.perf_counter() - self.wall0

    def stop(self, state: ServerState) -> None:
        state.train_s = self.elapsed()
        state.busy_fraction = (time.process_time() - self.cpu0) / max(state.train_s, 1e-9)


def record_eval(ctx: Context, state: ServerState, clock: Clock, params: np.ndarray, step: int,
                ema: np.ndarray | None = None) -> None:
    """--eval-every: test-set loss and accuracy of rank 0's parameters (and of their moving
    average), with the wall time."""
    ctx.activity.enter(EVAL)
    loss, acc, _ = ctx.model.evaluate(params, ctx.data.x_test, ctx.data.y_test)
    entry = {"global_step": step, "seconds": clock.elapsed(), "test_accuracy": acc, "test_loss": loss}
    if ema is not None:
        entry["ema_test_loss"], entry["ema_test_accuracy"], _ = ctx.model.evaluate(ema, ctx.data.x_test, ctx.data.y_test)
    state.eval_history.append(entry)
    if state.log:
        state.log.eval(entry)


def log_train(ctx: Context, state: ServerState, clock: Clock, step: int, loss: float, force: bool = False,
              **extra) -> None:
    """--log-dir: the training scalars at a global step (loss, lr, samples/s, each worker's step
    time from its heartbeats, and what the caller adds)."""
    if state.log is None or not (force or state.log.due(step)):
        return
    lr = ctx.lr_at(step)
    rate = (step - state.start_step) * ctx.global_batch / max(clock.elapsed(), 1e-9)
    state.log.train(step, True, loss=loss, lr=lr, samples_per_second=rate, **extra)
    rows, _ = attribute(beat_step_times(ctx), ctx.cfg.straggler_report)
    if rows:
        state.log.workers(step, rows)


def seen_workers(ctx: Context) -> dict[int, tuple]:
    """Watch.seen() of the workers only (rank 0 also watches the other servers, --num-ps)."""
    return {r: seen for r, seen in ctx.watch.seen().items() if not ctx.layout.is_server(r)}


def beat_step_times(ctx: Context) -> dict[int, dict]:
    """Each worker's step time as its last heartbeat told it."""
    return {r: step_time_from_beat(b) for r, (b, _, _) in seen_workers(ctx).items() if b is not None}


def staleness_feasible(global_step: int, other_bases: list[int], bound: int) -> bool:
    """After one more update, can every other pending gradient (computed on parameters of step
    `basis`) still be applied, oldest first, with staleness <= bound? The k-th goes at step g+k."""
    return all(global_step + k - b <= bound for k, b in enumerate(sorted(other_bases), start=1))


def record_lost(state: ServerState, rank: int, why: str, then: str = "", loud: bool = True) -> None:
    """A worker declared lost: in the summary (lost_workers), on stderr (rank 0's line; `loud`),
    and in the log."""
    info = {"rank": rank, "global_step": state.global_step, "reason": why}
    state.lost_workers.append(info)
    if loud:
        say(f"mpitrain: worker rank {rank} lost at global step {state.global_step} ({why}){then}", sys.stderr)
    if state.log:
        state.log.event("worker_lost", **info)


class AsyncServer:
    """The async serve loop and its bookkeeping, one method per decision. With --num-ps K each
    server runs one for its slice of the parameters (`self.params`, a view of `state.params`);
    rank 0, the chief, also evaluates and saves, with the other slices gathered for it."""

    def __init__(self, ctx: Context, progress: Progress):
        cfg = ctx.cfg
        self.ctx, self.cfg, self.comm, self.progress = ctx, cfg, ctx.comm, progress
        self.chief = ctx.rank == PS_RANK
        shard, W = ctx.shard, ctx.workers
        n = shard.stop - shard.start
        start, self.state, self.ckpt = begin(ctx)
        self.clock = Clock()
        self.params = self.state.params[shard]  # this server's slice, updated in place
        self.opt = Optimizer(cfg.optimizer, n, np, momentum=cfg.momentum)
        self.guard = LossGuard(cfg.divergence_factor)
        self.opt.restore(start.opt_t, {k: a[shard] for k, a in start.opt_state.items()})
        self.ema = make_ema(cfg.ema_decay, self.params, np, start.global_step,
                            None if start.ema is None else start.ema[shard])
        wire = cfg.wire_dtype
        self.inbox = [Message(n, dtype=wire) for _ in range(W)]
        self.outbox = [Message(n, dtype=wire) for _ in range(W)]
        self.message_bytes = self.inbox[0].buf.nbytes if W else 0
        # float16 / bfloat16 gradients are widened once, so the optimizer only ever sees float32.
        self.grad32 = np.empty(n, np.float32) if wire != np.float32 else None
        self.worker_ranks = list(ctx.layout.worker_ranks)  # worker w is MPI rank worker_ranks[w]
        self.recv = [self.comm.Irecv(self.inbox[w].spec(), source=r, tag=TAG_GRAD) for w, r in enumerate(self.worker_ranks)]
        self.sends = [MPI.REQUEST_NULL] * W
        # With --overlap a reply is not awaited until the worker's next gradient is computed, so
        # rank 0 can sleep longer between polls and leave the cores to the workers.
        self.poller = Poller(PS_POLL_S if cfg.effective_overlap else PS_POLL_NO_OVERLAP_S, ctx.watch)
        self.gather = Gather(ctx, self.poller) if self.chief else None  # the other servers' slices
        self.service = None if self.chief else ShardService(ctx, n)  # rank 0's requests for this slice
        self.active = set(range(W))  # workers not yet told to stop
        self.held: list[int] = []  # gradients received, not yet applied (--max-staleness)
        self.basis = [self.state.global_step] * W  # version each worker's next gradient is computed on
        self.stopping = False

    def run(self) -> ServerState:
        while self.active:
            try:
                self._serve_once()
            except PeerLost as e:  # silent past --worker-timeout, or its message failed in MPI
                self._lose(e.lost)
        self._drain_sends()
        self.clock.stop(self.state)
        if self.chief:
            final = self._full_state(FLAG_STOP)
            self.state.params, self.state.ema = final.params, final.ema
            self.ckpt.save(final, final=True)  # the final checkpoint
        else:
            self.service.finish(self._own_state(), self.poller)
            self.state.ema = self._ema_avg
        return self.state

    def _serve_once(self) -> None:
        """Apply what may be applied, then wait for the next gradients (and, on a server other
        than rank 0, for rank 0's request for this slice). A stop request (a signal here, or in
        a message's header) stops every worker at its next gradient, as --steps does."""
        self.stopping = self.stopping or STOP.requested
        self._apply_held()
        if self.held and not any(self.recv[w] for w in self.active):
            self._apply(self._oldest_held())  # never reached with S >= W-1; no hang regardless
            return
        self.ctx.activity.enter(WAIT)
        reqs = self.recv if self.chief else self.recv + [self.service.req]
        done = self.poller.some(reqs)
        if done.failed:  # a gradient from a process that died while sending it: never applied
            self._lose({(self.worker_ranks[w] if w < len(self.recv) else PS_RANK): why for w, why in done.failed.items()})
        for w in done.arrived:
            if w == len(self.recv):
                self.service.handle(self._own_state(), self.poller)
                continue
            self.ctx.watch.heard(self.worker_ranks[w])
            if self.inbox[w].flags & FLAG_STOP:  # the worker leaves: another server stopped it
                self.inbox[w].check(TAG_GRAD, self.worker_ranks[w], count=0)
                self.active.discard(w)
                continue
            self.inbox[w].check(TAG_GRAD, self.worker_ranks[w])
            self.state.bytes_in += self.message_bytes
            self.held.append(w)

    def _lose(self, lost: dict[int, str]) -> None:
        """Carry on without these workers: their gradients in flight are dropped, nothing is sent
        to them again, and the budget is finished by the others. A lost server cannot be done
        without (its slice of the parameters is gone): PeerLost ends the job (trainer.py)."""
        servers = {r: why for r, why in lost.items() if self.ctx.layout.is_server(r)}
        if servers:
            raise PeerLost(servers)
        for rank, why in lost.items():
            w = self.ctx.layout.worker_index(rank)
            self.ctx.watch.declare(rank, why)
            if any(info["rank"] == rank for info in self.state.lost_workers):
                continue
            self.active.discard(w)
            if w in self.held:
                self.held.remove(w)
            # Requests to or from a dead process never complete: dropped (never waited on), and
            # the job ends without MPI_Finalize, which would wait for them (see trainer.py).
            self.recv[w] = MPI.REQUEST_NULL
            self.sends[w] = MPI.REQUEST_NULL
            record_lost(self.state, rank, why, f"; continuing with {len(self.active)} worker(s)" if self.active else "",
                        loud=self.chief)

    def _drain_sends(self) -> None:
        """Wait for the last replies, giving up on any worker lost meanwhile."""
        while True:
            try:
                self.poller.all(self.sends, self.worker_ranks)
                return
            except PeerLost as e:
                self._lose(e.lost)

    @property
    def _ema_avg(self) -> np.ndarray | None:
        return self.ema.avg if self.ema else None

    def _own_state(self) -> TrainState:
        """This server's slice of the training state (the whole of it with one server)."""
        st = self.state
        return TrainState(self.params, st.global_step, self.opt.t, dict(self.opt.state), list(st.local_steps),
                          self._ema_avg)

    def _full_state(self, flags: int) -> TrainState:
        """Rank 0: the whole training state, the other servers' slices asked for (`flags` say
        why: FLAG_EVAL, FLAG_CKPT, FLAG_STOP). With one server, its own state as it is."""
        own = self._own_state()
        if not self.gather:
            return own
        pieces = self.gather.ask_all(own.global_step, flags)
        names, n = self.gather.names, self.ctx.model.n_params
        mine = (self.ctx.shard, checkpoint.to_flat(own, names))
        return assemble([mine] + pieces, names, n, own.global_step, own.opt_t, own.positions)

    def _checkpoint(self, flags: int = FLAG_CKPT) -> TrainState:
        state = self._full_state(flags)
        self.ckpt.save(state)
        return state

    def _oldest_held(self) -> int:
        return min(self.held, key=lambda w: self.inbox[w].step)

    def _may_apply(self, w: int) -> bool:
        """--max-staleness S: apply w's gradient only if every other pending gradient can still be
        applied within S updates of its basis. Applying moves the global step to g+1; at best the
        others follow oldest basis first, the k-th at step g+k, so it needs g + k - basis <= S for
        each (earliest-deadline-first: the oldest pending gradient then always qualifies, so this
        cannot deadlock when S >= workers-1). With --num-ps each server holds its own count."""
        bound = self.cfg.max_staleness
        if bound is None:
            return True
        return staleness_feasible(self.state.global_step, [self.basis[u] for u in self.active if u != w], bound)

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
        cfg, state, msg = self.cfg, self.state, self.inbox[w]
        self.held.remove(w)
        why = NON_FINITE if not math.isfinite(msg.loss) else self.guard.exploded(msg.loss)
        if why:  # diverged: never applied, and every worker is stopped
            state.diverged = {"global_step": state.global_step, "ranks": [self.worker_ranks[w]], "loss": msg.loss,
                              "why": why}
            self.stopping = True
            self._reply(w, stop=True)
            return
        staleness = state.global_step - msg.step
        self.ctx.activity.enter(APPLY, state.global_step)
        lr = self.ctx.lr_at(state.global_step)
        if cfg.staleness_lr:
            lr = staleness_scaled_lr(lr, staleness)
        grad = msg.payload
        if self.grad32 is not None:
            decode(np, grad, self.grad32)
            grad = self.grad32
        self.opt.step(self.params, grad, lr)
        if self.ema:
            self.ema.update(self.params)
        state.global_step += 1
        state.local_steps[w] += 1
        state.staleness[staleness] += 1
        state.recent_losses.append(msg.loss)
        if self.chief:
            self._chief_duties(msg.loss, staleness)
        # --steps counts rank 0's updates, the run's global step. Another server's count can run ahead
        # of it (a worker that died half-way through a push delivered that server's part only:
        # measured by chaos, the run then ended at 999 of 1000), so only rank 0 stops at the budget;
        # the workers it stops leave the other servers.
        self.stopping = STOP.requested or (self.chief and cfg.steps is not None and state.global_step >= cfg.steps)
        self._reply(w, stop=self.stopping or bool(msg.flags & FLAG_LAST))

    def _chief_duties(self, loss: float, staleness: int) -> None:
        """Rank 0 after each update: the bar, the log, --eval-every and checkpoints."""
        state, step = self.state, self.state.global_step
        self.progress.update(step, loss)
        log_train(self.ctx, state, self.clock, step, loss, staleness=staleness, local_steps=list(state.local_steps))
        # The budget's last step is saved once, at the end (run): with --num-ps the other servers
        # may not have applied their last gradients yet, and a save of the same step is skipped.
        evaluate, save = self.ctx.eval_due(step), self.ckpt.due(step) and step < self.ctx.global_step_budget
        if not (evaluate or save):
            return
        if save:
            self.ctx.activity.enter(CHECKPOINT)
            whole = self._checkpoint(FLAG_CKPT | (FLAG_EVAL if evaluate else 0))
        else:
            whole = self._full_state(FLAG_EVAL)
        if evaluate:
            record_eval(self.ctx, state, self.clock, whole.params, step, whole.ema)

    def _reply(self, w: int, stop: bool) -> None:
        state = self.state
        self.ctx.activity.enter(PUSH)
        rank = self.worker_ranks[w]
        if not tested(self.sends[w], rank, self.ctx.watch):  # consumed before this push: done at once
            self.poller.all([self.sends[w]], [rank])
        reply = self.outbox[w]
        encode(np, self.params, reply.payload)  # a copy (narrowed with --compress): params change in flight
        flags = (FLAG_STOP | (FLAG_DIVERGED if state.diverged else 0)) if stop else 0
        reply.stamp(TAG_PARAMS, state.global_step, state.local_steps[w], flags)
        self.sends[w] = self.comm.Isend(reply.spec(), dest=rank, tag=TAG_PARAMS)
        state.bytes_out += self.message_bytes
        self.basis[w] = state.global_step
        if stop:
            self.active.discard(w)
        else:
            self.recv[w] = self.comm.Irecv(self.inbox[w].spec(), source=rank, tag=TAG_GRAD)


def serve_async(ctx: Context, progress: Progress) -> ServerState:
    return AsyncServer(ctx, progress).run()


def serve_sync(ctx: Context, progress: Progress) -> ServerState:
    """Follow the chief worker: header-only status messages for the bar, full ones (FLAG_EVAL)
    to evaluate, and the last one (FLAG_STOP) with the final parameters; one tag, so MPI's
    ordering delivers the final one last. (--quorum steps are decided by the chief worker.)"""
    cfg = ctx.cfg
    W = ctx.workers
    start, state, ckpt = begin(ctx)
    clock = Clock()
    chief = ctx.layout.worker_rank(0)
    names = checkpoint.state_arrays(cfg)  # [params, optimizer state..., ema]
    full_count = (ctx.shard.stop - ctx.shard.start) * len(names)  # rank 0's slice (all of it with one server)
    box = Message(full_count)
    poller = Poller(CHIEF_POLL_S, ctx.watch)  # PeerLost ends the job (trainer.py)
    gather = Gather(ctx, poller)  # --num-ps: the other servers forward their slices of the same step
    status = ctx.comm.Irecv(box.spec(), source=chief, tag=TAG_STATUS)
    final_seen = False
    while not final_seen:
        ctx.activity.enter(WAIT, state.global_step)
        done = poller.some([status])
        if done.failed:  # the chief died while sending
            raise PeerLost({chief: done.failed[0]})  # sync cannot go on: trainer.py
        if done.arrived:
            final, full = bool(box.flags & FLAG_STOP), bool(box.flags & (FLAG_STOP | FLAG_EVAL | FLAG_CKPT))
            box.check(TAG_STATUS, chief, count=full_count if full else 0)
            progress.update(box.step, box.loss)
            log_train(ctx, state, clock, box.step, box.loss, force=True,  # the chief already rate-limits
                      staleness=0, local_steps=[box.step] * W)
            received = _received(ctx, gather, box, names) if full else None
            state.bytes_in += box.buf.nbytes if full else 0
            if box.flags & FLAG_EVAL:
                record_eval(ctx, state, clock, received.params, box.step, received.ema)
            if box.flags & (FLAG_CKPT | FLAG_STOP):
                ctx.activity.enter(CHECKPOINT, box.step)
                ckpt.save(received, final=final)
            if final and box.flags & FLAG_DIVERGED:  # the why and the loss come in the chief's report
                state.diverged = {"global_step": box.step, "ranks": [], "loss": float("nan"), "why": None}
            if final:  # its loss is the chief's mean over the last LOSS_WINDOW steps
                state.global_step = box.step
                state.recent_losses.append(box.loss)
                state.params[:] = received.params
                state.ema = received.ema
                final_seen = True
                status = MPI.REQUEST_NULL
            else:
                status = ctx.comm.Irecv(box.spec(), source=chief, tag=TAG_STATUS)
    state.local_steps = [state.global_step] * W
    clock.stop(state)
    return state


def _received(ctx: Context, gather: Gather, box: Message, names: list[str]) -> TrainState:
    """The whole state the chief worker sent at box.step: rank 0's slice, and the other
    servers' slices of the same step, which they forward (sync_shard)."""
    pieces = [(ctx.shard, box.payload)]
    if gather:
        pieces += gather.wait(gather.post(), gather.ranks)
        behind = [(r, step) for r, step in zip(gather.ranks, gather.steps()) if step != box.step]
        if behind:
            raise ProtocolError(f"server rank {behind[0][0]} forwarded step {behind[0][1]} while the chief worker "
                                f"sent step {box.step}")
    return assemble(pieces, names, ctx.model.n_params, box.step, box.step, [box.step] * ctx.workers)


def sync_shard(ctx: Context) -> ServerState:
    """A server k > 0 in sync mode: the workers average among themselves, so it only keeps its
    slice of the state, which the chief worker sends it at eval, checkpoint and end, and
    forwards each to rank 0 for the whole state (one message, the same header, tag TAG_SHARD)."""
    _, state, _ = begin(ctx)
    clock = Clock()
    names, s = checkpoint.state_arrays(ctx.cfg), ctx.shard
    m, chief = s.stop - s.start, ctx.layout.worker_rank(0)
    box = Message(m * len(names))
    poller = Poller(CHIEF_POLL_S, ctx.watch)
    while True:
        ctx.activity.enter(WAIT, state.global_step)
        poller.all([ctx.comm.Irecv(box.spec(), source=chief, tag=TAG_STATUS)], [chief])
        box.check(TAG_STATUS, chief)
        state.global_step = box.step
        state.params[s] = box.payload[:m]
        state.bytes_in += box.buf.nbytes
        box.stamp(TAG_SHARD, box.step, box.local_step, box.flags, box.loss)
        poller.all([ctx.comm.Isend(box.spec(), dest=PS_RANK, tag=TAG_SHARD)], [PS_RANK])
        state.bytes_out += box.buf.nbytes
        if box.flags & FLAG_STOP:
            if box.flags & FLAG_DIVERGED:  # rank 0 and the workers say why
                state.diverged = {"global_step": box.step}
            break
    clock.stop(state)
    return state


def serve_shard(ctx: Context) -> ServerState:
    """A server other than rank 0 (--num-ps): its slice, in the run's mode."""
    if ctx.cfg.mode == "async":
        return AsyncServer(ctx, Progress(False, None, ctx.global_batch)).run()
    return sync_shard(ctx)
