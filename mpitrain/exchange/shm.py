"""--ps-transport shm: the async parameter store in memory shared by every rank of the host.

The parameters, the optimizer's state, the moving average and a version counter (the global step)
live in one segment that every rank maps. A worker pushes by applying its own gradient under the
store's lock, in arrival order (the same serial update, optim.ServerUpdate, that rank 0 applies on
the message path; SGD's and momentum's last pass is one BLAS axpy here, optim.axpy, which rounds
once where NumPy rounds twice), and pulls by copying the parameters out in the same hold of the lock: one lock
per step, no message, no rank 0 in the loop. Rank 0 only reads: each applied step leaves its loss,
its basis and its worker in a ring that rank 0 follows for the bar, the log, the staleness counts
and the loss guard (modes/async_shm.py); it evaluates and checkpoints at steps where it holds the
workers (`hold_at`) and stops them with the `stop` slot.

Why the OS's shared memory (a file in /dev/shm, mmap) and not MPI's shared windows: its locks are
POSIX record locks (`fcntl.lockf`), which the kernel releases when their holder dies however it dies (MPI_Win_lock's
owner dies holding it for good), and the file can be found and removed by the next job on the
host. The name is unlinked as soon as every rank has mapped it, so a job that ends in any way,
SIGKILL included, leaves nothing; one killed before that leaves a file with its creator's pid,
which the next store made on the host removes (`sweep`).

A worker killed half-way through an apply leaves a partial step (some elements updated, some
not), never a torn version: the version is one aligned 8-byte word, written after the apply.

With --num-ps K the parameters are K shards (Layout.shard_slices), each with its own lock (a byte
range of the file: `fcntl.lockf`, also released by the kernel when its holder dies) and its own
counts (a row of the header per shard), so K workers can apply at once, one per shard. A push
goes through the shards in order; rank 0's duties, the hold and the stop are shard 0's, as on the
message path rank 0's count is the run's. Server ranks 1..K-1 only map the store and wait for the
end (modes/async_shm.keep_store).
"""

from __future__ import annotations

import contextlib
import fcntl
import math
import mmap
import os
import secrets

import numpy as np

from mpitrain.core.layout import PS_RANK
from mpitrain.core.optim import ServerUpdate, StalenessHold
from mpitrain.core.outer import OuterUpdate, PushSpans
from mpitrain.duties.checkpoint import OPT_PREFIX, TrainState, state_arrays
from mpitrain.exchange.waiting import poll
from mpitrain.launch.mpiimpl import orphans
from mpitrain.membership.faults import kill_here, store_kill

SHM_DIR = "/dev/shm"
PREFIX = "mpitrain-store"
NAME_BYTES = 256  # the segment's path, sent by rank 0 to every rank (a fixed-size buffer: no pickle)
RING = 4096  # steps rank 0 may fall behind the workers (it holds them before the ring wraps)
HOLD_POLL_S = 1e-3  # a held worker (rank 0 evaluating or saving) looks again after this

# The header's int64 slots, one place for each: a row per shard; the run's slots (HOLD_AT, STOP,
# DIVERGED_*) are in shard 0's row only.
VERSION = 0  # the shard's global step: updates applied, written after each apply (shard 0's: the run's)
HOLD_AT = 1  # no worker applies a step while VERSION >= HOLD_AT (rank 0 has a duty at that step)
STOP = 2  # nonzero: every worker stops at its next push (the budget, a signal, a divergence)
OPT_T = 3  # the optimizer's update count (Adam's bias correction)
EMA_T = 4  # --ema-decay's update count
DIVERGED_STEP = 5  # a worker's loss was not finite at this step (-1: never); not applied
DIVERGED_RANK = 6
DC_T = 7  # --delay-compensation: the gradients its mean square has seen
HEADER = 8
# A worker's `active` slot: 1 training, 0 done (or stopped), LOST rank 0 declared it lost (so that
# the other servers, which have no loop of their own, take it for lost too and not for done).
LOST = -1


def _sections(n: int, workers: int, state_names: tuple[str, ...], ema: bool, dc: bool,
              shards: int) -> list[tuple[str, type, int]]:
    """The segment's layout, in order: (name, dtype, length); the 8-byte ones first (aligned).
    `bases`: the version of the parameters each worker computes on (--max-staleness reads it)."""
    return ([("header", np.int64, HEADER * shards), ("active", np.int64, workers), ("bases", np.int64, workers),
             ("diverged_loss", np.float64, 1), ("ring_loss", np.float64, RING), ("ring_basis", np.int64, RING),
             ("ring_worker", np.int64, RING), ("ring_span", np.int64, RING), ("params", np.float32, n)]
            + [(f"opt_{name}", np.float32, n) for name in state_names]
            + ([("ema", np.float32, n)] if ema else [])
            + ([("dc_mean_square", np.float32, n)] if dc else []))


def segment_name(pid: int, token: str, prefix: str = PREFIX) -> str:
    return f"{prefix}.{os.getuid()}.{pid}.{token}"


def sweep(shm_dir: str = SHM_DIR, prefix: str = PREFIX) -> list[str]:
    """Remove the segments of this user's jobs whose creator is gone (killed before every rank had
    mapped the segment, the only time its name exists); returns what it removed. (Also the async
    mailboxes', exchange/mailbox.py, by their prefix.)"""
    removed = []
    for path in orphans(shm_dir, f"{prefix}.{os.getuid()}."):
        with contextlib.suppress(OSError):
            os.unlink(path)
            removed.append(os.path.basename(path))
    return removed


class ShardLock:
    """A shard's lock: byte `shard` of the segment's file, a POSIX record lock (the kernel's, released
    when its holder dies however it dies). A class, not a generator context manager: every push
    takes it, and contextlib's machinery cost ~3 us of a softmax push's ~70 (2026-11-29)."""

    __slots__ = ("fd", "shard")

    def __init__(self, fd: int, shard: int):
        self.fd, self.shard = fd, shard

    def __enter__(self) -> None:
        fcntl.lockf(self.fd, fcntl.LOCK_EX, 1, self.shard)

    def __exit__(self, *exc) -> None:
        fcntl.lockf(self.fd, fcntl.LOCK_UN, 1, self.shard)


class Store:
    """One rank's mapping of the segment: numpy views of each section, and the lock."""

    def __init__(self, path: str, n: int, workers: int, state_names: tuple[str, ...], ema: bool, dc: bool,
                 create: bool, shards: int = 1):
        sections = _sections(n, workers, state_names, ema, dc, shards)
        size = sum(np.dtype(t).itemsize * k for _, t, k in sections)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        self.path, self.fd = path, os.open(path, flags, 0o600)  # the job's user only (DESIGN.md, Security)
        try:
            if create:
                os.ftruncate(self.fd, size)
            self.mm = mmap.mmap(self.fd, size)
        except BaseException:
            os.close(self.fd)
            raise
        offset, self.views = 0, {}
        for name, dtype, k in sections:
            self.views[name] = np.frombuffer(self.mm, dtype, k, offset)
            offset += np.dtype(dtype).itemsize * k
        v = self.views
        self.rows = v["header"].reshape(shards, HEADER)  # each shard's counts
        self.header = self.rows[0]  # shard 0's, and the run's slots
        self.active, self.params, self.ema = v["active"], v["params"], v.get("ema")
        self.opt = {name: v[f"opt_{name}"] for name in state_names}
        self.locks = [ShardLock(self.fd, k) for k in range(shards)]

    def locked(self, shard: int = 0) -> ShardLock:
        """Shard `shard`'s lock, as a `with` block. Whoever takes several takes them in order."""
        return self.locks[shard]

    @contextlib.contextmanager
    def locked_all(self):
        """Every shard's lock, in order: no push is half-way through a shard meanwhile."""
        with contextlib.ExitStack() as stack:
            for k in range(len(self.rows)):
                stack.enter_context(self.locked(k))
            yield self

    def fill(self, start: TrainState, workers: int, hold_at: int) -> None:
        """Rank 0, before any worker maps it: the start state."""
        self.rows[:] = 0
        self.rows[:, VERSION], self.rows[:, OPT_T], self.rows[:, EMA_T] = start.global_step, start.opt_t, start.global_step
        h = self.header
        h[HOLD_AT], h[DIVERGED_STEP] = hold_at, -1
        self.params[:] = start.params
        for name, view in self.opt.items():
            saved = start.opt_state.get(name)
            view[:] = 0 if saved is None else saved
        if self.ema is not None:
            self.ema[:] = start.params if start.ema is None else start.ema
        self.active[:] = 1
        self.views["bases"][:] = start.global_step

    def may_step(self, version: int, worker: int, hold) -> bool:
        """Whether `worker` may apply at `version` now: not a step rank 0 holds (HOLD_AT), and within
        --max-staleness (`hold`, a StalenessHold: as the message path's server decides) of the other
        workers still training. Read under shard 0's lock to apply, outside it to wait."""
        if version >= self.header[HOLD_AT]:
            return False
        if hold.bound is None:  # no --max-staleness: nothing to gather
            return True
        others = [int(self.views["bases"][u]) for u in range(len(self.active)) if u != worker and self.active[u] > 0]
        return hold.allows(version, others)

    def diverged(self, rank: int, version: int, loss: float) -> None:
        """Under shard 0's lock: a non-finite loss at `version`, never applied; every worker stops."""
        self.views["diverged_loss"][0] = loss
        h = self.header
        h[DIVERGED_RANK], h[DIVERGED_STEP], h[STOP] = rank, version, 1

    def stepped(self, version: int, loss: float, basis: int, worker: int, span: int = 1) -> None:
        """Under shard 0's lock, after `worker`'s apply made steps `version` + 1 .. `version` + `span`
        (--local-steps: a push's inner steps; else 1): its ring entry, at the first of them, then the
        version (a reader never sees a step that is not there), then the worker's next basis."""
        v, i = self.views, (version + 1) % RING
        v["ring_loss"][i], v["ring_basis"][i], v["ring_worker"][i], v["ring_span"][i] = loss, basis, worker, span
        self.header[VERSION] = version + span
        v["bases"][worker] = version + span

    def snapshot(self, positions: list[int]) -> TrainState:
        """The whole training state at one version of shard 0 (copies, taken under every lock)."""
        with self.locked_all():
            h = self.header
            return TrainState(self.params.copy(), int(h[VERSION]), int(h[OPT_T]),
                              {k: a.copy() for k, a in self.opt.items()}, list(positions),
                              None if self.ema is None else self.ema.copy())

    def close(self) -> None:
        self.views = self.rows = self.header = self.active = self.params = self.ema = self.opt = None
        with contextlib.suppress(BufferError):  # a view still held elsewhere: the mapping goes with the process
            self.mm.close()
        os.close(self.fd)


def stored_state(cfg) -> tuple[str, ...]:
    """The update rule's state arrays the store holds, as the run's state names them (the optimizer's;
    with --local-steps the outer optimizer's, the inner ones being each worker's own)."""
    return tuple(name[len(OPT_PREFIX):] for name in state_arrays(cfg) if name.startswith(OPT_PREFIX))


def open_store(ctx, start: TrainState, hold_at: int = 0, here: bool = True,
               lost: dict[int, str] | None = None) -> Store | None:
    """Rank 0 makes the segment, fills it and sends its name to every other rank; each maps it
    (`here`; a worker on another host takes part without mapping it, and gets None) and says so;
    once every rank has, or was lost, rank 0 unlinks the name (the memory lives until the last rank
    unmaps it). Point to point, not a collective: rank 0's set-up before this can take seconds (under
    load; --log-dir's import of PyTorch took 3-5 s before metrics.summary_writer_class), and a worker
    killed meanwhile would hold a barrier for ever and end the job although --respawn could replace it.
    Rank 0 gives such a worker up (into `lost`, its caller's to record) as it would one lost in
    training; a lost server ends the job as ever."""
    from mpi4py import MPI

    from mpitrain.exchange.protocol import TAG_STORE
    from mpitrain.exchange.transport import END_POLL_S, Poller

    names = stored_state(ctx.cfg)  # SharedUpdate's BLAS was loaded in set-up (optim.preload_blas)
    ema, dc = bool(ctx.cfg.ema_decay), ctx.cfg.delay_compensation is not None
    n, W, K = ctx.model.n_params, ctx.workers, ctx.layout.shards
    buf = bytearray(NAME_BYTES)
    poller = Poller(END_POLL_S, ctx.watch)
    if ctx.rank != PS_RANK:
        if store_kill(ctx.rank) == (0, "opening"):
            kill_here()
        poller.all([ctx.comm.Irecv([buf, MPI.BYTE], source=PS_RANK, tag=TAG_STORE)], [PS_RANK])
        store = Store(bytes(buf).rstrip(b"\0").decode(), n, W, names, ema, dc, create=False, shards=K) if here else None
        poller.all([ctx.comm.Isend([MAPPED, MPI.BYTE], dest=PS_RANK, tag=TAG_STORE)], [PS_RANK])
        return store
    sweep()
    path = os.path.join(SHM_DIR, segment_name(os.getpid(), secrets.token_hex(8)))
    store = Store(path, n, W, names, ema, dc, create=True, shards=K)
    store.fill(start, W, hold_at)
    buf[:len(path)] = path.encode()
    exchanges = {r: (ctx.comm.Isend([buf, MPI.BYTE], dest=r, tag=TAG_STORE),
                     ctx.comm.Irecv([bytearray(1), MPI.BYTE], source=r, tag=TAG_STORE))
                 for r in range(ctx.size) if r != PS_RANK}
    gone = _hear_from(ctx, poller, exchanges)
    with contextlib.suppress(OSError):
        os.unlink(store.path)
    if lost is not None:
        lost.update(gone)
    return store


MAPPED = bytearray(b"\1")  # a rank's answer to the store's name: mapped (or, on another host, heard)


def _hear_from(ctx, poller, exchanges: dict) -> dict[int, str]:
    """Rank 0: wait until each rank has the name and has answered (`exchanges`: rank -> the send and
    the answer's receive); a worker lost meanwhile, before or after its answer, is given up
    (returned, rank -> why: declared in the watch, so --respawn replaces it); a lost server raises
    PeerLost."""
    from mpitrain.membership.liveness import PeerLost

    gone: dict[int, str] = {}
    while True:
        waiting = [r for r in exchanges if r not in gone]
        try:
            poller.all([req for r in waiting for req in exchanges[r]], [r for r in waiting for _ in exchanges[r]])
            return gone
        except PeerLost as e:
            if any(ctx.layout.is_server(r) for r in e.lost):
                raise
            gone.update(e.lost)  # its requests stay posted: the dead rank takes and sends nothing more


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
    """An async worker's side on the store (exchange.base.PushPull): a push applies the gradient
    and copies the new parameters out under one hold of the lock, so `pull` only says whether the
    worker was stopped. With nothing to wait for there is no overlap: each gradient is computed on
    the parameters of the worker's own last push."""

    def __init__(self, ctx, start: TrainState):
        self.ctx, self.be = ctx, ctx.backend
        self.store = open_store(ctx, start)
        self.parts = ctx.layout.shard_slices(ctx.model.n_params)  # one with one server
        self.shared = [SharedUpdate(ctx.cfg, self.store, np, k, p, ctx.workers) for k, p in enumerate(self.parts)]
        self.worker = ctx.worker_index
        self.host_params = np.array(start.params, np.float32)  # the pulled parameters (a copy: the store moves on)
        self.params = self.be.asarray(self.host_params)  # NumPy: the same array
        self.grads = [self.be.xp.empty(ctx.model.n_params, self.be.xp.float32) for _ in range(2)]
        self.versions = [start.global_step] * len(self.parts)
        self.diverged_at: int | None = None
        self.lent = None  # the store's workers read their own shards: nothing is lent
        self.in_flight = False
        self.stopped = False
        self.count = 0  # this worker's pushes so far, the one in hand included (the fault injection's step)
        self.spans = PushSpans(ctx.cfg.local_steps, 1)  # the global steps each push makes (--local-steps: H)
        self.hold = StalenessHold(ctx.cfg.max_staleness, ctx.cfg.local_steps)
        self.kill_at = store_kill(ctx.rank)  # MPITRAIN_INJECT_KILL=RANK:STEP:POINT (the fault tests)

    def gradient(self, slot: int):
        return self.grads[slot]

    def push(self, slot: int, loss: float, versions: list[int], count: int, last: bool, lease=None) -> None:
        """`count`: the worker's gradients so far, this one's included (--local-steps: its inner steps)."""
        self.count += 1
        span = self.spans.span(0, count)
        self.ctx.watch.check()  # rank 0 is not in the loop: its loss is noticed here (PeerLost)
        grad = self.be.to_host(self.grads[slot])
        while True:
            with self.store.locked():
                done = self._apply(grad, loss, versions[0], span)
            if done is not None:
                break
            h = self.store.header  # rank 0 holds this step (evaluating, saving): wait outside the lock
            poll(lambda: h[STOP] or self.store.may_step(int(h[VERSION]), self.worker, self.hold), HOLD_POLL_S,
                 self.ctx.watch)
        if not done:  # shard 0 applied: the others, in order, each under its own lock
            for k in range(1, len(self.parts)):
                with self.store.locked(k):
                    self._apply_shard(k, grad, versions[k], span)
            if last:
                self.store.active[self.worker] = 0  # after its last shard: rank 0's final state holds it all
        self.stopped = done or last
        self.in_flight = True
        self.be.upload(self.params, self.host_params)  # NumPy: the same array, nothing to do

    def _apply(self, grad, loss: float, basis: int, span: int) -> bool | None:
        """Under shard 0's lock: apply and pull its part (False), stop without applying (True), or held (None);
        `span`: the global steps the push makes."""
        s, h = self.store, self.store.header
        self._injected("locked")
        if h[STOP]:
            return self._stop()
        v = int(h[VERSION])
        if not s.may_step(v, self.worker, self.hold):
            return None
        if not math.isfinite(loss):  # never applied; rank 0 stops the run (a diverged run saves nothing more)
            s.diverged(self.ctx.rank, v, loss)
            return self._stop()
        part = self.parts[0]
        self.shared[0].apply(grad[part], self.ctx.lr_at(v), v - basis, basis, self.host_params[part])
        self._injected("applying")
        s.stepped(v, loss, basis, self.worker, span)
        self.host_params[part] = s.params[part]
        self.versions[0] = v + span
        return False

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
        if self.kill_at == (self.count, point):
            kill_here()

    def _stop(self) -> bool:
        h = self.store.header
        if h[DIVERGED_STEP] >= 0:
            self.diverged_at = int(h[DIVERGED_STEP])
        self.store.active[self.worker] = 0
        return True

    def pull(self, count: int) -> bool:
        self.in_flight = False
        return self.stopped

    def held(self) -> TrainState:
        """What a take-over starts from (rank 0 lost, failover.py): not this worker's copy but the
        store itself, the newest state any worker applied, optimizer state and moving average too
        (rank 0 only reads the store: its death leaves it whole, and the kernel releases any lock it held)."""
        state = self.store.snapshot([])
        state.versions = [int(row[VERSION]) for row in self.store.rows]
        return state

    def leave(self, count: int) -> None:
        with self.store.locked():
            self.store.active[self.worker] = 0

    def close(self) -> None:
        self.store.close()
