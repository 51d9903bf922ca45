"""The wire format: message tags and the fixed header in front of every payload.

Every hot-path message is a header of HEADER_SLOTS int64 slots, then the payload (parameters or
gradients, float32 or a --compress type). With one parameter server it is ONE contiguous byte
buffer; with --num-ps K a worker's message to server k is its header and its slice of the one
flat buffer (Message.shard_parts: an MPI struct datatype received in place, sent from a
contiguous copy). It travels with the uppercase buffer API (`Isend`/`Irecv` of `[buf, MPI.BYTE]`
or that datatype), never pickled. This module is the only place that knows the tags, the slot
positions and the flag bits.
"""

from __future__ import annotations

import functools

import numpy as np

from mpitrain.core.stop import STOP

MAGIC = 0x4D505452  # "MPTR": catches a peer that is not mpitrain, or a misrouted buffer
VERSION = 19  # bump when the layout below changes (2: heartbeats carry an activity snapshot; 3: --quorum messages;
#               4: H_SECONDS; 5: H_SIGNAL, FLAG_STOP_STEP, FLAG_STOPPED; 6: TAG_REGROUP, FLAG_REGROUPED;
#               7: TAG_JOIN, FLAG_REFORM, the goodbye's payload; 8: FLAG_LEAVING out of FLAG_STOP, H_GENERATION
#               and H_JOINER out of H_STEP and H_LOCAL_STEP; 9: TAG_STORE, the shm store's name point to point;
#               10: TAG_ADOPT, a successor's offer to the spares; 11: FLAG_HOLD; 12: TAG_MAIL, async's mailboxes;
#               13: one meaning per name: FLAG_ENDED out of FLAG_STOP (now FLAG_FINAL), H_BUDGET out of H_STEP,
#               H_LOCAL_STEP renamed H_PUSHED; 14: H_SIGNAL's ROOM, sync's room vote slot; 15: a sync status's H_PUSHED
#               counts the deal's batches; 16: H_LEASE, H_LEASE_N, async's data leases; 17: --quorum deals,
#               TAG_LEFT_OUT; 18: TAG_PER_WORKER, sync's save vote slot; 19: H_LOW, H_APPLIED, 18 slots)

# Tags (one per message kind, so a posted receive can never match the wrong kind).
TAG_GRAD = 11  # worker -> PS: a gradient (async)
TAG_PARAMS = 12  # PS -> worker: parameters (async reply)
TAG_STATUS = 13  # coordinator (worker 0) -> PS: progress of a sync run (header only), or parameters (EVAL/STOP)
TAG_QGRAD = 15  # sync --quorum, worker -> coordinator (worker 0): a gradient on the parameters of step H_STEP (flagged LEAVING: its last message)
TAG_UPDATE = 16  # sync --quorum, coordinator -> the other workers: step H_STEP's mean gradient, then a weight per worker
TAG_HEARTBEAT = 17  # any rank -> its watchers: I am alive, and what I do (BEAT_* below; liveness.py)
TAG_REPORT = 18  # at the end, worker -> PS: its report (JSON bytes, once); PS -> worker: goodbye (header)
TAG_SHARD = 19  # --num-ps: rank 0 -> server k: send me your shard (header); server k -> rank 0: its shard's state
TAG_JOIN = 21  # rank 0 <-> a worker joining, on their own connection (join.py): JSON hello and answer, then GO (header; flagged ENDED: the job ended instead) and the joiner's header back
TAG_REGROUP = 20  # sync, rank 0 -> the workers left: regroup without the lost (H_GENERATION; payload: lost ranks), flagged GO: now, flagged ENDED: training is over; worker -> rank 0: READY for generation H_GENERATION (elastic.py)
TAG_FAILOVER = 22  # worker <-> worker, rank 0 lost (--on-lost-server continue): HERE (global step, gradients pushed), then the successor's DECIDE (one flag per rank of the new world); int64, not a Message (failover.py)
TAG_STORE = 23  # --ps-transport shm, rank 0 -> every other rank: the store's path (exchange/shm.py, NAME_BYTES); back: one byte, mapped
TAG_ADOPT = 24  # rank 0's successor <-> a waiting spare (--spares, --on-lost-server continue), on their own connection
#                 (spares.split): the successor's offer (header), the spare's answer (header)
TAG_MAIL = 25  # async, rank 0 -> a worker of another launch on its host: its mailbox's path (exchange/mailbox.py); back: 1 byte
TAG_LEFT_OUT = 26  # sync --quorum, coordinator -> PS just before a state flagged CKPT or FINAL: the batches left out of
#                    the updates by epoch (int64 pairs, not a Message; report.py, sync_follow.py)
TAG_PER_WORKER = 27  # sync, coordinator -> PS just before a state flagged CKPT or FINAL where Mode.worker_arrays
#                      is not empty: every worker's own arrays at that step (float32, a row per worker, or none;
#                      not a Message; report.py, sync_follow.py)

# Header slots.
H_MAGIC = 0
H_VERSION = 1
H_TAG = 2  # the tag it was sent with: a second check that buffer and receive match
H_COUNT = 3  # number of payload elements (parameters)
H_STEP = 4  # a global step: of these parameters (PS -> worker, sync states), or the version a gradient was computed on
H_PUSHED = 5  # a count of gradients: a worker's own (with --local-steps: its inner steps); a sync status's: the
#              deal's worker batches in the updates up to H_STEP (core/ledger.py)
H_FLAGS = 6
H_LOSS = 7  # float64 bits of the minibatch loss
H_SECONDS = 8  # float64 bits: --quorum push, how long its gradient took to compute (the coordinator's pace, quorum.CoordinatorPace)
H_SIGNAL = 9  # its sender's stop request or room to make (core/stop.StopRequest.wire): 0, a signal, -1 or -2
H_GENERATION = 10  # the number of a regroup (TAG_REGROUP, FLAG_REGROUPED) or of a join (a FLAG_REFORM goodbye)
H_JOINER = 11  # a FLAG_REFORM goodbye: who joins the new world (join.NOBODY, CONNECTED or SPAWNED)
H_BUDGET = 12  # the job's step budget: rank 0 -> a waiting spare (spares.py: its heartbeat, the successor's offer)
H_LEASE = 13  # async, rank 0 -> worker: the first batch number of the block it is lent (core/ledger.Leases);
#              worker -> servers: the block its gradient was computed on
H_LEASE_N = 14  # how many numbers the block holds (0: none lent with this reply)
H_LOW = 15  # async, rank 0 -> worker: every batch number below it is applied in these parameters, and
H_APPLIED = 16  # how many numbers are (core/ledger.Leases.mark): a take-over deals the rest again, and counts
#               what it deals twice (membership/failover.lent_ledger)
HEADER_SLOTS = 18  # slot 17 is free: 144 bytes keep the payload 16-byte aligned for SIMD loads
HEADER_BYTES = HEADER_SLOTS * 8

# A heartbeat's payload (float64): the sender's activity (observe.Activity.snapshot), so a peer
# knows where it is and how fast it goes, not only that it is alive.
BEAT_STEPS = 0  # gradients computed so far
BEAT_PHASE = 1  # observe.PHASES code of what it is doing now
BEAT_PHASE_S = 2  # for how long, at the time of the beat
BEAT_STEP_S = 3  # median step time (observe.Activity.busy_s per gradient)
BEAT_COMPUTE = 4  # share of its wall time computing
BEAT_WAIT = 5  # share of its wall time waiting on peers
BEAT_GLOBAL_STEP = 6  # the global step it works on
BEAT_PID = 7  # who sent it (samehost.identity): its pid,
BEAT_STARTED = 8  # its process's start time (clock ticks since boot),
BEAT_HOST = 9  # and its kernel boot and pid namespace, as one key
BEAT_FIELDS = 10

FLAG_LAST = 1  # worker: this is my last gradient (my epochs are done)
FLAG_FINAL = 2  # the last of its kind, with the final parameters: the last reply (async), state (sync) or request (TAG_SHARD)
FLAG_EVAL = 4  # sync coordinator -> PS: these parameters are for --eval-every
FLAG_CKPT = 8  # sync coordinator -> PS: checkpoint this state (parameters, then the optimizer's arrays)
FLAG_DIVERGED = 16  # a non-finite loss: training stops (PS -> workers in async, coordinator -> PS in sync)
FLAG_PEER_LOST = 32  # PS -> worker, goodbye: a rank was lost, so nobody may call MPI_Finalize
FLAG_STOP_STEP = 64  # --quorum update: the last step; a stop was requested (stopping.py)
FLAG_STOPPED = 128  # PS -> worker, goodbye: the run stopped on request before its budget (exit 128 + H_SIGNAL)
FLAG_REGROUPED = 256  # sync, the coordinator (worker 0) -> PS: the first status after a regroup (H_GENERATION: its generation)
FLAG_REFORM = 1024  # PS -> worker, goodbye: not the end, a worker joins: every rank left forms a new world with it (payload: the ranks lost)
FLAG_GO = 512  # sync, PS -> the workers left: every one of them is READY (TAG_REGROUP, header only, back): regroup now
FLAG_LEAVING = 2048  # the sender sends no more of this kind: a worker leaves a server (header only), its last --quorum push, a last heartbeat
FLAG_LATE = 4096  # --quorum push, header only: a contribution finished after its step closed; only its time (H_SECONDS) counts
FLAG_ENDED = 16384  # membership, instead of a GO: the job ended (TAG_REGROUP's DONE, TAG_JOIN, TAG_ADOPT)
FLAG_HOLD = 8192  # a heartbeat: the sender blocks in MPI now (MPI_Comm_spawn), its beats too, for up to liveness.HOLD_S


def _int_slot(index: int) -> property:
    """A read-only accessor of one int64 header slot (Framed.step, .flags, ...)."""
    return property(lambda self: int(self.header[index]))


class ProtocolError(RuntimeError):
    """A message that is not what this rank expects: ranks from different versions or models."""


class Framed:
    """A header of HEADER_SLOTS int64 in front of a payload: stamping and checking. Subclasses say
    where the bytes live: by default `buf`, header and payload back to back in one buffer (a Part
    says otherwise in `spec`)."""

    header: np.ndarray
    payload: np.ndarray
    count: int
    buf: np.ndarray

    def spec(self):
        spec = self.__dict__.get("_spec")  # made once: a server passes it twice per gradient
        if spec is None:
            from mpi4py import MPI

            spec = self._spec = [self.buf, MPI.BYTE]
        return spec

    def send(self, comm, dest: int, tag: int, nbytes: int | None = None):
        """Start sending this message to `dest` on `tag` (its first `nbytes` alone: a header without
        its payload); the request. The modes post every message through here and `listen`."""
        if nbytes is None:
            return comm.Isend(self.spec(), dest=dest, tag=tag)
        from mpi4py import MPI

        return comm.Isend([self.buf[:nbytes], MPI.BYTE], dest=dest, tag=tag)

    def listen(self, comm, source: int, tag: int):
        """Post the receive of `source`'s next message on `tag` into this buffer; the request."""
        return comm.Irecv(self.spec(), source=source, tag=tag)

    @functools.cached_property
    def _floats(self) -> np.ndarray:
        """The header's slots as float64 (H_LOSS, H_SECONDS): one view, not one per access."""
        return self.header.view(np.float64)

    def stamp(self, tag: int, step: int = 0, pushed: int = 0, flags: int = 0, loss: float = 0.0,
              seconds: float = 0.0, generation: int = 0, joiner: int = 0, budget: int = 0,
              lease: tuple[int, int] | None = None, mark: tuple[int, int] = (0, 0)) -> None:
        h = self.header
        h[H_MAGIC] = MAGIC
        h[H_VERSION] = VERSION
        h[H_TAG] = tag
        h[H_COUNT] = self.count
        h[H_STEP] = step
        h[H_PUSHED] = pushed
        h[H_FLAGS] = flags
        f = self._floats
        f[H_LOSS] = loss
        f[H_SECONDS] = seconds
        h[H_SIGNAL] = STOP.wire  # a stop request spreads with every message (stopping.py)
        h[H_GENERATION] = generation
        h[H_JOINER] = joiner
        h[H_BUDGET] = budget
        h[H_LEASE], h[H_LEASE_N] = lease or (0, 0)
        h[H_LOW], h[H_APPLIED] = mark

    def check(self, tag: int, source: int, count: int | None = None) -> None:
        """Raise ProtocolError unless this buffer holds a well-formed message of kind `tag`
        with `count` payload elements (default: the buffer's own size)."""
        h = self.header
        count = self.count if count is None else count
        if h[H_MAGIC] != MAGIC:
            raise ProtocolError(f"message from rank {source} has a bad magic number {int(h[H_MAGIC]):#x}: "
                                "is every rank running mpitrain?")
        if h[H_VERSION] != VERSION:
            raise ProtocolError(f"rank {source} speaks protocol version {int(h[H_VERSION])}, this rank {VERSION}: "
                                "install the same mpitrain on every host")
        if h[H_TAG] != tag:
            raise ProtocolError(f"rank {source} sent message kind {int(h[H_TAG])} where {tag} was expected")
        if h[H_COUNT] != count:
            raise ProtocolError(f"rank {source} sent {int(h[H_COUNT])} parameters where {count} were expected: "
                                "start every rank with the same model flags (and --num-ps)")
        STOP.heard(int(h[H_SIGNAL]), source)

    def refresh(self) -> None:
        """Before sending: bring the payload up to date with the buffer it stands for (a
        Copied part copies; every other kind already is that buffer)."""

    def free(self) -> None:
        """After the last use: release MPI resources (a Part's datatype)."""

    step = _int_slot(H_STEP)
    pushed = _int_slot(H_PUSHED)
    generation = _int_slot(H_GENERATION)
    joiner = _int_slot(H_JOINER)
    budget = _int_slot(H_BUDGET)
    flags = _int_slot(H_FLAGS)

    @property
    def lease(self) -> tuple[int, int] | None:
        """The block of batch numbers this message lends or names (None: none)."""
        n = int(self.header[H_LEASE_N])
        return (int(self.header[H_LEASE]), n) if n else None

    @property
    def mark(self) -> tuple[int, int]:
        """Rank 0's reply: (every batch number below this applied, how many are) in its parameters."""
        return int(self.header[H_LOW]), int(self.header[H_APPLIED])

    @property
    def loss(self) -> float:
        return float(self._floats[H_LOSS])

    @property
    def seconds(self) -> float:
        return float(self._floats[H_SECONDS])


class Message(Framed):
    """One header + payload buffer. `payload` is a view (float32, or float16 with --compress
    fp16) into the same memory, so header and payload travel as one message."""

    def __init__(self, count: int, host_alloc=None, dtype=np.float32, clear: bool = True):
        nbytes = HEADER_BYTES + np.dtype(dtype).itemsize * count
        raw = host_alloc(nbytes) if host_alloc is not None else np.empty(nbytes, np.uint8)
        self.buf = raw
        self.header = raw[:HEADER_BYTES].view(np.int64)
        self.payload = raw[HEADER_BYTES:].view(dtype)
        self.count = count
        if clear:  # not over memory that may hold a message already (a mailbox mapped by its worker)
            self.header[:] = 0

    def shard_parts(self, slices: list[slice], sending: bool = False) -> list[Framed]:
        """One message per shard over this buffer (--num-ps): the part for slices[k] carries
        payload[slices[k]]. With one shard that is this message itself; the first shard's part
        is contiguous already. The others are received in place (Part), but sent from a copy
        (Copied): MPICH packs a non-contiguous send only while the sender is inside an MPI call
        (measured: a receive took 6.1 ms against 0.2 ms while the sender computed for 5 ms), so
        a worker's pushes to the other servers waited for its next poll; async ran at 0.24x."""
        if len(slices) == 1:
            return [self]
        return [_Head(self, s) if s.start == 0 else (Copied if sending else Part)(self.payload[s]) for s in slices]


class _Head(Framed):
    """The first shard's part: this buffer's own header and the payload right behind it."""

    def __init__(self, msg: Message, s: slice):
        self.header, self.payload, self.count = msg.header, msg.payload[s], s.stop - s.start
        self.buf = msg.buf[: HEADER_BYTES + self.payload.nbytes]


class Copied(Message):
    """A contiguous message whose payload is a copy of a view into a bigger buffer, taken by
    `refresh` before each send."""

    def __init__(self, source: np.ndarray):
        super().__init__(source.size, dtype=source.dtype)
        self.source = source

    def refresh(self) -> None:
        self.payload[:] = self.source


class Part(Framed):
    """A header of its own and a view into a bigger payload buffer, sent or received as ONE
    message by an MPI struct datatype over both addresses: the bytes on the wire are exactly a
    Message's (header, then payload), so the peer receives it into a plain Message. No copy."""

    def __init__(self, payload: np.ndarray):
        from mpi4py import MPI

        self.header = np.zeros(HEADER_SLOTS, np.int64)
        self.payload, self.count = payload, payload.size
        self._type = MPI.Datatype.Create_struct([HEADER_BYTES, payload.nbytes],
                                                [MPI.Get_address(self.header), MPI.Get_address(payload)],
                                                [MPI.BYTE, MPI.BYTE]).Commit()

    def spec(self):
        from mpi4py import MPI

        return [MPI.BOTTOM, 1, self._type]  # absolute addresses: this object keeps both arrays alive

    def free(self) -> None:
        from mpi4py import MPI

        if self._type != MPI.DATATYPE_NULL:
            self._type.Free()
