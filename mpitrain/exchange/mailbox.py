"""Async over MPI, a worker on rank 0's host that another launch started (--respawn, --join): its
gradients and rank 0's replies go through a shared-memory mailbox instead of MPI; heartbeats, notices
and the end's reports stay MPI's.

Why: MPI reaches a process of another launch over its network module even on the same host (MPICH:
UCX, with `UCX_RNDV_THRESH=inf` for safety, every message copied through 8 KB FIFO cells; Open MPI:
TCP), and rank 0 exchanged 0.70x as often with such a worker as with one the launcher started
(benchmarks/spawned_link.py): async's goodput under --respawn stopped at 0.70. Here a push is a copy
into the mailbox and one counter written; a reply the same the other way.

The segment (one per such worker, made by rank 0): a header of counters, two gradient slots and two
parameter slots, each a protocol.Message (header + payload, as MPI would carry it, so the server
checks it alike). Push p fills gradient slot (p - 1) % 2 and then sets PUSHED = p; rank 0's reply to
it fills parameter slot p % 2 and then sets ANSWERED = p (slot 0 holds the start). A counter is one
aligned 8-byte word written after its slot and read before it, with a memory barrier between
(`fence`), so a process killed half-way through a write leaves a slot that is never announced, as a
half-sent message is never received: the heartbeat watch names the dead after --worker-timeout
(samehost.py sooner), as on MPI. Two slots each way, as MPIPushPull's buffers: the
worker computes into a gradient slot whose push has been answered, on a parameter slot rank 0 is done
with (its next write there answers a push computed after it).

Set-up is two messages (TAG_MAIL): rank 0 sends the segment's path, the worker maps it and answers one
byte (1: mapped; 0: it could not, another /dev/shm: both keep to MPI). The name is unlinked as soon as
the worker has answered or is lost, so a job that ends in any way leaves nothing; a rank 0 killed
before that leaves a file with its pid, which the next mailbox made on the host removes. Mode 0600 and
a random name sent only to the job's own rank (DESIGN.md, Security).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import threading

import numpy as np
from mpi4py import MPI

from mpitrain.core.compress import scheme
from mpitrain.core.layout import PS_RANK
from mpitrain.duties.checkpoint import TrainState
from mpitrain.exchange import shm
from mpitrain.exchange.mpi import first_mark, held_copy
from mpitrain.exchange.protocol import (FLAG_DIVERGED, FLAG_LAST, FLAG_LEAVING, FLAG_FINAL, HEADER_BYTES, TAG_GRAD,
                                        TAG_MAIL, TAG_PARAMS, Message)
from mpitrain.exchange.transport import END_POLL_S, WORKER_POLL_S, Poller
from mpitrain.exchange.waiting import poll
from mpitrain.launch.faults import kill_here, push_kill

PREFIX = "mpitrain-mail"
PUSHED, ANSWERED = 0, 1  # the header's counters: the worker's pushes announced, rank 0's answers announced
COUNTERS = 8  # int64 slots (a cache line), the rest spare
NOT_MAPPED = b"\0"  # the worker's answer to the path when it could not map it (shm.MAPPED when it did)
_BARRIER = threading.Lock()


def fence() -> None:
    """A memory barrier between a slot and its counter: a lock taken and released (its atomic
    instructions order memory; ~0.1-1 us). x86, where this is tested, keeps stores and loads in order
    without it; on ARM it is what keeps a counter from being seen before its slot (untested there)."""
    with _BARRIER:
        pass


def wanted(ctx, rank: int) -> bool:
    """Whether rank 0 and worker `rank` of an async job exchange through a mailbox this phase. Both sides
    answer alike from what both know (node_info's strangers, the agreed flags): one server (--num-ps 1),
    --ps-transport mpi, --joined-link shm, and the worker on rank 0's host in another launch than rank 0's."""
    cfg, layout = ctx.cfg, ctx.layout
    if cfg.ps_transport != "mpi" or cfg.joined_link != "shm" or layout.shards != 1:
        return False
    if scheme(cfg.compress, cfg.sparsify) is not None:  # a compressed push is no mailbox slot's size: over MPI
        return False
    if layout.single or layout.is_server(rank):
        return False
    other = rank if ctx.rank == PS_RANK else PS_RANK
    return (ctx.rank == PS_RANK or ctx.rank == rank) and other in ctx.node.strangers_here


def sweep() -> list[str]:
    """Remove mailboxes whose rank 0 was killed before the name was unlinked."""
    return shm.sweep(prefix=PREFIX)


class Segment:
    """One mapping of a mailbox: the counters and the four slots as Messages over the shared memory."""

    def __init__(self, path: str, n: int, wire, create: bool):
        slot = -(-(HEADER_BYTES + np.dtype(wire).itemsize * n) // 64) * 64  # whole cache lines: no slot shares one
        size = 8 * COUNTERS + 4 * slot
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        self.path, fd = path, os.open(path, flags, 0o600)  # the job's user only (DESIGN.md, Security)
        try:
            if create:
                os.ftruncate(fd, size)
            self.mm = mmap.mmap(fd, size)
        except BaseException:
            if create:
                self.unlink()
            raise
        finally:
            os.close(fd)  # the mapping keeps the memory
        raw = np.frombuffer(self.mm, np.uint8)
        self.counters = raw[: 8 * COUNTERS].view(np.int64)
        at = [8 * COUNTERS + k * slot for k in range(4)]
        # Only the creator clears headers: the worker maps slots rank 0 may already be writing
        slots = [Message(n, lambda nbytes, a=a: raw[a:a + nbytes], wire, clear=create) for a in at]
        self.grads, self.params = slots[:2], slots[2:]
        # A push's goodbye (FLAG_LEAVING, header only: count 0) is stamped over its gradient slot's header
        self.byes = [Message(0, lambda nbytes, m=m: m.buf[:nbytes], wire, clear=False) for m in self.grads]

    def unlink(self) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self.path)

    def close(self) -> None:
        """Unmap, once nothing reads the slots (a view that outlives it keeps the memory: no error)."""
        self.grads = self.params = self.byes = self.counters = None
        with contextlib.suppress(BufferError):
            self.mm.close()


class ServerMail:
    """Rank 0's side, driven by AsyncServer: for each worker `wanted`, the segment, its offer (the path,
    sent over MPI) and, once the worker has mapped it, the pushes it announces and the answers."""

    def __init__(self, ctx, n: int, worker_ranks: list[int]):
        self.ctx, self.n, self.wire = ctx, n, ctx.cfg.wire_dtype
        chief = ctx.rank == PS_RANK  # another server of --num-ps offers none (wanted: one server only)
        self.offered = [w for w, rank in enumerate(worker_ranks) if chief and wanted(ctx, rank)]
        self.boxes: dict[int, Segment] = {}  # w -> its mailbox, once the worker has mapped it
        self.taken: dict[int, int] = {}  # w -> its pushes rank 0 has taken
        self.declined: set[int] = set()  # offered, but could not map it: over MPI
        self._pending: dict[int, tuple[Segment, bytearray, bytearray]] = {}  # offered, not answered yet

    def offer(self, w: int, rank: int) -> tuple:
        """Make w's mailbox and send its path: (the send, the receive of the answer) for rank 0's loop."""
        if not self._pending and not self.boxes:
            sweep()
        path = os.path.join(shm.SHM_DIR, shm.segment_name(os.getpid(), secrets.token_hex(8), PREFIX))
        seg = Segment(path, self.n, self.wire, create=True)
        name, answer = bytearray(shm.NAME_BYTES), bytearray(1)
        name[:len(path)] = path.encode()
        self._pending[w] = (seg, name, answer)
        comm = self.ctx.comm
        return (comm.Isend([name, MPI.BYTE], dest=rank, tag=TAG_MAIL),
                comm.Irecv([answer, MPI.BYTE], source=rank, tag=TAG_MAIL))

    def answering(self, w: int) -> bool:
        return w in self._pending

    def answered(self, w: int) -> bool:
        """The worker's answer arrived: True if it mapped the mailbox (its pushes come through it)."""
        seg, _, answer = self._pending.pop(w)
        seg.unlink()
        if answer != shm.MAPPED:
            seg.close()
            self.declined.add(w)
            return False
        self.boxes[w], self.taken[w] = seg, 0
        return True

    def arrived(self) -> list[int]:
        """The workers whose next push (or goodbye) is announced; each is taken: `push(w)` is it."""
        new = [w for w, seg in self.boxes.items() if seg.counters[PUSHED] > self.taken[w]]
        if new:
            fence()
        for w in new:
            self.taken[w] += 1
        return new

    def awaits(self, w: int) -> bool:
        """A push of w's may come: it has a mailbox and every push taken is answered."""
        seg = self.boxes.get(w)
        return seg is not None and int(seg.counters[ANSWERED]) == self.taken[w]

    def push(self, w: int) -> Message:
        """The push just taken from w (its header and gradient, in shared memory)."""
        return self.boxes[w].grads[(self.taken[w] - 1) % 2]

    def reply(self, w: int) -> Message:
        """Where the answer to w's push goes: stamp it, then `announce`."""
        return self.boxes[w].params[self.taken[w] % 2]

    def announce(self, w: int) -> None:
        fence()
        self.boxes[w].counters[ANSWERED] = self.taken[w]  # after the slot: see the module's docstring

    def drop(self, w: int) -> None:
        """w was lost: its mailbox is given up (the name too, if it never answered)."""
        pending = self._pending.pop(w, None)
        seg = pending[0] if pending else self.boxes.pop(w, None)
        if seg is not None:
            seg.unlink()
            seg.close()

    def close(self) -> None:
        for w in list(self._pending) + list(self.boxes):
            self.drop(w)


def worker_exchange(ctx, start: TrainState):
    """A worker's exchange with rank 0 this phase: a MailPushPull where `wanted` (its mailbox mapped), else
    None (MPI's, the default)."""
    if not wanted(ctx, ctx.rank):
        return None
    poller = Poller(END_POLL_S, ctx.watch)
    name = bytearray(shm.NAME_BYTES)
    poller.all([ctx.comm.Irecv([name, MPI.BYTE], source=PS_RANK, tag=TAG_MAIL)], [PS_RANK])
    try:
        seg = Segment(bytes(name).rstrip(b"\0").decode(), ctx.model.n_params, ctx.cfg.wire_dtype, create=False)
    except (OSError, ValueError):  # another /dev/shm (a container of its own), or not the size this rank expects
        seg = None  # (mmap: "length is greater than file size"): MPI's link, as before
    answer = shm.MAPPED if seg is not None else bytearray(NOT_MAPPED)
    poller.all([ctx.comm.Isend([answer, MPI.BYTE], dest=PS_RANK, tag=TAG_MAIL)], [PS_RANK])
    return None if seg is None else MailPushPull(ctx, start, seg)


class MailPushPull:
    """An async worker's exchange through its mailbox (exchange.base.PushPull), one server. NumPy + float32:
    computed straight from a parameter slot into a gradient slot, no copy."""

    def __init__(self, ctx, start: TrainState, seg: Segment):
        self.ctx, self.be, self.seg = ctx, ctx.backend, seg
        be = self.be
        seg.params[0].payload[:] = start.params  # "answer 0": rank 0 writes this slot first with answer 2
        self.zero_copy = be.mirror(seg.params[0].payload) is seg.params[0].payload
        self.params = seg.params[0].payload if self.zero_copy else be.asarray(start.params)
        self.grads = [be.mirror(m.payload) for m in seg.grads]
        self.versions = [start.global_step]
        self.diverged_at: int | None = None
        self.lent = None
        self.mark = first_mark(ctx, start)
        self.sent = self.pulled = 0  # pushes announced; answers made the parameters
        self.kill_at = push_kill(ctx.rank)  # MPITRAIN_INJECT_KILL=RANK:STEP:mailing

    @property
    def in_flight(self) -> bool:
        return self.sent > self.pulled

    def gradient(self, slot: int):
        return self.grads[slot]

    def progress(self) -> None:
        pass  # nothing to move: a push is in the segment once written

    def push(self, slot: int, loss: float, versions: list[int], count: int, last: bool, lease=None) -> None:
        msg = self.seg.grads[slot]
        self.be.download(self.grads[slot], msg.payload)
        msg.stamp(TAG_GRAD, versions[0], count, FLAG_LAST if last else 0, loss, lease=lease)
        if self.kill_at == (count, "mailing"):
            msg.payload[: msg.count // 2] = np.nan  # a torn push: rank 0 must never take it
            kill_here()
        self._announce(msg.buf.nbytes)

    def _announce(self, nbytes: int) -> None:
        self.sent += 1
        fence()
        self.seg.counters[PUSHED] = self.sent  # after the slot: see the module's docstring
        self.ctx.activity.moved(sent=nbytes)

    def pull(self, count: int) -> bool:
        """Wait for rank 0's answer to the push in flight; it becomes the parameters. True: stopped."""
        counters = self.seg.counters
        poll(lambda: counters[ANSWERED] >= self.sent, WORKER_POLL_S, self.ctx.watch)
        fence()
        msg = self.seg.params[self.sent % 2]
        msg.check(TAG_PARAMS, PS_RANK)
        self.pulled = self.sent
        self.ctx.activity.moved(received=msg.buf.nbytes)
        if self.zero_copy:
            self.params = msg.payload
        else:
            self.be.upload(self.params, msg.payload)
        self.versions = [msg.step]
        self.lent, self.mark = msg.lease, msg.mark
        if msg.flags & FLAG_DIVERGED:
            self.diverged_at = msg.step
        return bool(msg.flags & FLAG_FINAL)

    def leave(self, count: int) -> None:
        """It stops with nothing pushed: a goodbye (header only) in the next push's slot."""
        bye = self.seg.byes[self.sent % 2]
        bye.stamp(TAG_GRAD, self.versions[0], count, FLAG_LEAVING)
        self._announce(bye.buf.nbytes)

    def held(self) -> TrainState:
        return held_copy(self)

    def close(self) -> None:
        self.params = self.grads = None
        self.seg.close()
