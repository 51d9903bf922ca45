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
import mmap
import os
import secrets

import numpy as np

from mpitrain.core.layout import PS_RANK
from mpitrain.core.ledger import Leases, PairQueue
from mpitrain.duties.checkpoint import OPT_PREFIX, TrainState, state_arrays
from mpitrain.launch.faults import kill_here, push_kill
from mpitrain.launch.mpiimpl import orphans

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
LEASES_HELD = 2  # blocks a worker's queue has room for: one is all it holds (a push on the store never overlaps)
# The ledger's undo record (Store.ledger_begin): open?, whose, then the words a change may write: the next
# fresh number, the queue to deal again (head, length) and its head slot's pair, the worker's queue (head, length)
JOURNAL = 9
# The ledger section's words: the next fresh number, the [head, length] of the queue to deal again, then each
# worker's queue's [head, length] (held(w))
FRESH, REDEAL = 0, 1


def held(w: int) -> int:
    return 3 + 2 * w


# A worker's `active` slot: 1 training, 0 done (or stopped), LOST rank 0 declared it lost (so that
# the other servers, which have no loop of their own, take it for lost too and not for done).
LOST = -1


def _sections(n: int, workers: int, state_names: tuple[str, ...], ema: bool, dc: bool,
              shards: int, redeal: int) -> list[tuple[str, type, int]]:
    """The segment's layout, in order: (name, dtype, length); the 8-byte ones first (aligned).
    `bases`: the version of the parameters each worker computes on (--max-staleness reads it); `applying`: the
    block a worker is applying and has not yet marked applied (Store.settle). The data
    ledger (core/ledger.Leases over PairQueues): the next number never dealt, the blocks to deal again (room
    for `redeal`, the start's and every worker's, each lost at most once in a phase) and each worker's
    block, with their queues' [head, length]."""
    return ([("header", np.int64, HEADER * shards), ("active", np.int64, workers), ("bases", np.int64, workers),
             ("applying", np.int64, workers), ("diverged_loss", np.float64, 1), ("ring_loss", np.float64, RING),
             ("ring_basis", np.int64, RING), ("ring_worker", np.int64, RING), ("ring_span", np.int64, RING),
             ("ledger", np.int64, held(workers)), ("ledger_journal", np.int64, JOURNAL),
             ("ledger_redeal", np.int64, 2 * redeal),
             ("ledger_out", np.int64, 2 * LEASES_HELD * workers), ("params", np.float32, n)]
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
                 create: bool, shards: int = 1, redeal: int = 0):
        sections = _sections(n, workers, state_names, ema, dc, shards, redeal + LEASES_HELD * workers)
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
        self.active, self.params, self.ema, self.applying = v["active"], v["params"], v.get("ema"), v["applying"]
        self.opt = {name: v[f"opt_{name}"] for name in state_names}
        self.locks = [ShardLock(self.fd, k) for k in range(shards)]
        self._ledger = (memoryview(v["ledger"]), memoryview(v["ledger_journal"]), memoryview(v["ledger_redeal"]))

    def leases(self, span: int, end: int | None) -> Leases:
        """The job's deal in the store (core/ledger.Leases over its arrays): a worker grants itself its next
        block as it pushes, rank 0 takes a lost worker's back; each under shard 0's lock, between
        ledger_begin and ledger_end."""
        (L, _, red), blocks = self._ledger, memoryview(self.views["ledger_out"])
        out = [PairQueue(blocks[2 * LEASES_HELD * w:2 * LEASES_HELD * (w + 1)], L[held(w):held(w) + 2])
               for w in range(len(self.active))]
        return Leases.over(L[FRESH:FRESH + 1], PairQueue(red, L[REDEAL:REDEAL + 2]), out, span, end)

    def ledger_begin(self, w: int) -> None:
        """Under shard 0's lock, before worker w's blocks change: the words the change may write, kept. A
        process killed half-way through it (the kernel frees its lock) leaves the record open, and whoever
        takes the lock next puts them back (ledger_undo): a dealt number never falls between the next fresh
        one and a worker's queue (chaos, shm-2ps: a run one global step short of its budget)."""
        self.ledger_undo()
        L, j, red = self._ledger
        head, slot = L[REDEAL], 2 * L[REDEAL]
        j[1], j[2], j[3], j[4], j[5], j[6] = w, L[FRESH], head, L[REDEAL + 1], L[held(w)], L[held(w) + 1]
        j[7], j[8] = (red[slot], red[slot + 1]) if slot < len(red) else (0, 0)
        j[0] = 1

    def ledger_end(self) -> None:
        self._ledger[1][0] = 0

    def settle(self, w: int, leases: Leases):
        """Rank 0, worker w lost, under shard 0's lock after ledger_begin(w): where its last push got to (issue 81).
        Its `applying` slot says -(first + 1) from before its apply to the step's count, first + 1 from then until
        its block is marked applied, 0 after. A block applied and counted whose mark it did not live to write is
        marked now (trained once, not dealt again); a block whose gradient may be in the parameters, in whole or in
        part (killed inside the apply, a window of about 20 us), is returned: it is dealt again, trained twice,
        and the caller counts it (the summary's `repeated`). None: nothing of its block is in the parameters."""
        mark, self.applying[w] = int(self.applying[w]), 0
        head = leases.out[w][0] if leases.out[w] else None
        if head is None or head[0] != abs(mark) - 1:
            return None
        if mark > 0:
            leases.applied(w, head)
            return None
        return head

    def ledger_undo(self) -> bool:
        """Under shard 0's lock: a change its process did not finish, undone (True); False when none is open."""
        L, j, red = self._ledger
        if not j[0]:
            return False
        w, slot = j[1], 2 * j[3]
        L[FRESH], L[REDEAL], L[REDEAL + 1], L[held(w)], L[held(w) + 1] = j[2], j[3], j[4], j[5], j[6]
        if slot < len(red):
            red[slot], red[slot + 1] = j[7], j[8]
        j[0] = 0
        return True

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

    def fill(self, start: TrainState, workers: int, hold_at: int, deal: Leases | None = None) -> None:
        """Rank 0, before any worker maps it: the start state, and the deal as its start left it."""
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
        self.views["ledger"][:] = 0
        self.views["ledger_journal"][:] = 0
        self.applying[:] = 0
        if deal is not None:
            shared = self.leases(deal.span, deal.end)
            shared.fresh = deal.fresh
            shared.redeal.extendleft(reversed(deal.redeal))
            for w, blocks in enumerate(deal.out):
                shared.out[w].extendleft(reversed(blocks))

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

    def snapshot(self, positions: list[int], deal: Leases | None = None, shards: int = 0) -> tuple[TrainState, list]:
        """The whole training state at one version of shard 0 (copies, taken under every lock); with the
        store's `deal`, how far it got and what is out (to deal again on a resume), over `shards`. With
        --num-ps a push may be between its shards (`applying`, Store.settle): a block every shard holds is
        applied in this state, though not yet marked; one some shards hold is out (a resume deals it again)
        and returned, for the checkpoint to count (the summary's `partial`)."""
        with self.locked_all():
            h = self.header
            state = TrainState(self.params.copy(), int(h[VERSION]), int(h[OPT_T]),
                               {k: a.copy() for k, a in self.opt.items()}, list(positions),
                               None if self.ema is None else self.ema.copy())
            in_part = []
            if deal is not None:
                self.ledger_undo()
                state.dealt, state.deal_shards, state.redeal = deal.fresh, shards, deal.unapplied()
                for w, mark in enumerate(int(m) for m in self.applying):
                    head = deal.out[w][0] if mark and deal.out[w] else None
                    if head is not None and head[0] == abs(mark) - 1:
                        (state.redeal.remove if mark > 0 else in_part.append)(head)
            return state, in_part

    def close(self) -> None:
        self.views = self.rows = self.header = self.active = self.params = self.ema = self.opt = self._ledger = None
        with contextlib.suppress(BufferError):  # a view still held elsewhere: the mapping goes with the process
            self.mm.close()
        os.close(self.fd)


def stored_state(cfg) -> tuple[str, ...]:
    """The update rule's state arrays the store holds, as the run's state names them (the optimizer's;
    with --local-steps the outer optimizer's, the inner ones being each worker's own)."""
    return tuple(name[len(OPT_PREFIX):] for name in state_arrays(cfg) if name.startswith(OPT_PREFIX))


def open_store(ctx, start: TrainState, hold_at: int = 0, here: bool = True,
               lost: dict[int, str] | None = None, deal: Leases | None = None) -> Store | None:
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
        StoreKill(ctx.rank).at(0, "opening")
        poller.all([ctx.comm.Irecv([buf, MPI.BYTE], source=PS_RANK, tag=TAG_STORE)], [PS_RANK])
        store = Store(bytes(buf).rstrip(b"\0").decode(), n, W, names, ema, dc, create=False, shards=K,
                      redeal=len(start.redeal)) if here else None
        poller.all([ctx.comm.Isend([MAPPED, MPI.BYTE], dest=PS_RANK, tag=TAG_STORE)], [PS_RANK])
        return store
    sweep()
    path = os.path.join(SHM_DIR, segment_name(os.getpid(), secrets.token_hex(8)))
    store = Store(path, n, W, names, ema, dc, create=True, shards=K, redeal=len(start.redeal))
    store.fill(start, W, hold_at, deal)
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


class StoreKill:
    """MPITRAIN_INJECT_KILL=RANK:STEP:POINT (launch/faults.py): this rank SIGKILLs itself at its push STEP's
    POINT in the store (0: opening it), as the fault tests ask; the store's one door to the fault hooks."""

    __slots__ = ("when",)

    def __init__(self, rank: int):
        self.when = push_kill(rank)

    def at(self, count: int, point: str) -> None:
        if self.when == (count, point):
            kill_here()


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
