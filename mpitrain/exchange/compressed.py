"""The sync workers' exchange of compressed parts (--compress int8 / int4, --sparsify P): a Reducer
whose sum is an Allgather of every worker's part, each decoded and added by every worker in rank
order. MPI cannot add int8 blocks that carry different scales, nor top-k lists, in place; the
gather makes every worker's sum bitwise the same, so replicas stay identical as with Allreduce.
A part costs each worker (W - 1) parts to receive: it pays while a part is under about half the
float32 gradient per other worker (int8 3.9x smaller, int4 7.7x, top 2% in int8 39x; the start
line says how many bytes).

With --compress-replies (ScatterReducer) the sum is a reduce-scatter and an Allgather of compressed
sums, as a parameter server with W shards would do it: every worker compresses its values as W
chunks and sends chunk j to worker j (an Alltoall), worker j adds the W chunks j in rank order and
sends that sum compressed again with its own error feedback (the sums' residual) to all (an
Allgather), and every worker decodes the same W sums. Each worker receives 2 (W - 1) / W of a part
instead of W - 1 parts (4 workers: 1.5 against 3), for a second compression of every value.

A part is [the values, compressed with error feedback (core/compress.py)][the tail slots, float32
as they are]: the loss, weight, votes and stamp that sync reads exactly (modes/sync_slots.torn). In the
reduce-scatter every chunk carries its sender's tail and every sum the tails' sum: a worker that died
sending a chunk leaves a short weight in that sum, and a sum that did not arrive whole a tail unlike
the others' (both read as torn).
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from mpitrain.core.compress import BLOCK, Compressor, scheme
from mpitrain.exchange.mpi import InFlight, MPIReducer, WorkersCollective
from mpitrain.runtime import Context

ALIGN = 8  # each part starts on an 8-byte boundary: its scales and tail are read as float32 in place


class GatherReducer(WorkersCollective):
    """exchange.base.Reducer over a buffer of `n` compressed values and `tail` exact float32 slots (or of a
    part's values: --fragments)."""

    def __init__(self, ctx: Context, n: int, tail: int):
        super().__init__(ctx)
        self.n, self.tail = n, tail
        self.scheme = scheme(ctx.cfg.compress, ctx.cfg.sparsify)
        self.compressor = Compressor(self.scheme, n, self.be.xp)  # its residual: every parameter's error feedback
        self.by_part: dict[tuple[int, int], Compressor] = {}  # --fragments: a part's, its residual a view of that
        self.workers = 1 if self.alone else self.comm.Get_size()
        self.me = 0 if self.alone else self.comm.Get_rank()
        self.parts = np.zeros(0, np.uint8)  # every worker's part, in rank order (start: the largest exchange's size)

    def _slots(self, piece: np.ndarray, body: int) -> np.ndarray:
        """The exact slots (float32) behind a piece's compressed `body` bytes."""
        return piece[body: body + 4 * self.tail].view(np.float32)

    def _size(self, c: Compressor) -> int:
        """The bytes of a worker's part through `c`: its values compressed, then the tail, aligned."""
        return -(-(c.wire_bytes + 4 * self.tail) // ALIGN) * ALIGN

    def _for(self, part: slice | None) -> Compressor:
        """The compressor of `part` of the parameters (all of them: None). A part's residual is a view of the
        whole's, so that a checkpoint's row holds every part's error feedback, and a last exchange of them all
        sends what each part held back."""
        if part is None or (part.start, part.stop) == (0, self.n):
            return self.compressor
        key = (part.start, part.stop)
        if key not in self.by_part:
            c = Compressor(self.scheme, part.stop - part.start, self.be.xp)
            c.residual = self.compressor.residual[part]
            self.by_part[key] = c
        return self.by_part[key]

    def start(self, buf, part: slice | None = None) -> InFlight:
        """Compress this worker's part of `buf` (with its error feedback) and start gathering every part."""
        be, c = self.be, self._for(part)
        values, body, size = c.n, c.wire_bytes, self._size(c)
        if self.parts.size < self.workers * size:  # (a flight left in flight keeps the old one alive: abandon)
            self.parts = np.zeros(self.workers * size, np.uint8)
        parts = self.parts[: self.workers * size]
        mine = parts[self.me * size: (self.me + 1) * size]
        c.compress_to_host(buf[:values], mine[:body], be.to_host)
        self._slots(mine, body)[...] = be.to_host(buf[values:])
        spec = [parts, MPI.BYTE]
        return InFlight(self.comm.Iallgather(MPI.IN_PLACE, spec), spec, buf)

    def finish(self, flight: InFlight) -> None:
        """Wait for the parts, then their sum into the buffer given to `start`."""
        self.land(flight)
        be, xp, buf, gathered = self.be, self.be.xp, flight.buf, flight.spec[0]
        values, size = buf.shape[0] - self.tail, gathered.size // self.workers
        body = self.scheme.wire_bytes(values)
        parts = gathered if xp is np else be.asarray(gathered)
        tails = np.zeros(self.tail, np.float32)
        for w in range(self.workers):  # rank order on every worker: the same sum everywhere
            part = parts[w * size: (w + 1) * size]
            self.compressor.decompress(part[:body], buf[:values], add=w > 0)  # (the scheme's: any part's size)
            tails += self._slots(gathered[w * size:], body)
        buf[values:] = be.asarray(tails)
        self.ctx.activity.moved(size, size * (self.workers - 1))


class Scattered(InFlight):
    """A ScatterReducer's sum in flight: the Alltoall of chunks (stage 1), then the Allgather of sums (2)."""

    def __init__(self, req, spec, buf, chunks: list[tuple[int, int]], piece: int):
        super().__init__(req, spec, buf)
        self.chunks, self.piece, self.stage = chunks, piece, 1  # (chunk j: parameters a..b, worker j adds it)
        self.lo = chunks[0][0]  # the first parameter buf's values are


class ScatterReducer(GatherReducer):
    """--compress-replies in sync: the sum as a reduce-scatter of compressed chunks and an Allgather of
    compressed sums (module doc). `sums` is the sums' error feedback, of the chunks this worker adds
    (a row of the checkpoint's beside the residual: checkpoint.SUMS)."""

    def __init__(self, ctx: Context, n: int, tail: int):
        super().__init__(ctx, n, tail)
        self.sums = self.be.xp.zeros(n, self.be.xp.float32)
        self.by_sum: dict[tuple[int, int], Compressor] = {}  # a chunk's sum's, its residual a view of `sums`
        self.out = self.into = np.zeros(0, np.uint8)  # the chunks this worker sends, then its sum; those it adds,
        # then every worker's sum (_buffers: as large as the largest exchange's, a fragment's or the whole model's)

    def _chunks(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """Parameters lo..hi cut in one chunk per worker (worker j adds chunk j), at whole blocks of a
        quantiser's scales where every chunk keeps some."""
        w, n = self.workers, hi - lo
        step = -(-n // w)
        if (w - 1) * (-(-step // BLOCK) * BLOCK) < n:
            step = -(-step // BLOCK) * BLOCK
        return [(lo + min(n, j * step), lo + min(n, (j + 1) * step)) for j in range(w)]

    def _for_sum(self, a: int, b: int) -> Compressor:
        """The compressor of the sum of chunk a..b that this worker adds (a chunk it sends: GatherReducer._for)."""
        if (a, b) not in self.by_sum:
            c = self.by_sum[a, b] = Compressor(self.scheme, b - a, self.be.xp)
            c.residual = self.sums[a:b]
        return self.by_sum[a, b]

    def _piece(self, chunks) -> int:
        """The bytes of one chunk or sum on the wire, the largest chunk's (MPI's Alltoall sends equal pieces)."""
        return -(-(max(self.scheme.wire_bytes(b - a) for a, b in chunks) + 4 * self.tail) // ALIGN) * ALIGN

    def _buffers(self, size: int) -> tuple[np.ndarray, np.ndarray]:
        if self.out.size < size:  # (a flight left in flight keeps the old ones alive: InFlight.abandon)
            self.out, self.into = np.zeros(size, np.uint8), np.zeros(size, np.uint8)
        return self.out[:size], self.into[:size]

    def start(self, buf, part: slice | None = None) -> InFlight:
        """Compress this worker's values as one chunk for each worker and start sending them (stage 1)."""
        lo = 0 if part is None else part.start
        chunks = self._chunks(lo, lo + buf.shape[0] - self.tail)
        piece = self._piece(chunks)
        out, into = self._buffers(self.workers * piece)
        tail = self.be.to_host(buf[buf.shape[0] - self.tail:])
        for j, (a, b) in enumerate(chunks):
            c, mine = self._for(slice(a, b)), out[j * piece: (j + 1) * piece]
            c.compress_to_host(buf[a - lo: b - lo], mine[: c.wire_bytes], self.be.to_host)
            self._slots(mine, c.wire_bytes)[...] = tail
        req = self.comm.Ialltoall([out, MPI.BYTE], [into, MPI.BYTE])
        return Scattered(req, (out, into), buf, chunks, piece)

    def progress(self, flight: Scattered) -> None:
        """One look (WorkersCollective's); the chunks in, this worker's sum goes out at once."""
        super().progress(flight)
        if flight.stage == 1 and not flight.req and flight.failed is None:
            self._add(flight)

    def _add(self, flight: Scattered) -> None:
        """Stage 1 landed: add the chunks this worker was sent, in rank order, and start sending the sum."""
        be, buf, piece, me = self.be, flight.buf, flight.piece, self.me
        a, b = flight.chunks[me]
        out, into = flight.spec
        parts = into if be.xp is np else be.asarray(into)
        body = self.scheme.wire_bytes(b - a)
        mine, tails = buf[a - flight.lo: b - flight.lo], np.zeros(self.tail, np.float32)
        for w in range(self.workers):
            self.scheme.decode(be.xp, parts[w * piece: w * piece + body], mine, add=w > 0)
            tails += self._slots(into[w * piece:], body)
        sent = out[me * piece: (me + 1) * piece]
        self._for_sum(a, b).compress_to_host(mine, sent[:body], be.to_host)
        self._slots(sent, body)[...] = tails
        flight.req = self.comm.Iallgather([sent, MPI.BYTE], [into, MPI.BYTE])
        flight.stage = 2

    def finish(self, flight: Scattered) -> None:
        """Wait for both stages, then every worker's sum into the buffer given to `start`."""
        self.land(flight)
        if flight.stage == 1:
            self._add(flight)
            self.land(flight)
        be, buf, piece, into = self.be, flight.buf, flight.piece, flight.spec[1]
        parts = into if be.xp is np else be.asarray(into)
        tails, whole = None, True
        for w, (a, b) in enumerate(flight.chunks):
            body = self.scheme.wire_bytes(b - a)
            self.scheme.decode(be.xp, parts[w * piece: w * piece + body], buf[a - flight.lo: b - flight.lo])
            its = self._slots(into[w * piece:], body)
            if tails is None:
                tails = its.copy()
            whole = whole and np.array_equal(its.view(np.uint8), tails.view(np.uint8))  # (bytes: NaN equals NaN)
        if not whole:  # a sum that did not arrive whole: no weight, read as torn
            tails[...] = 0
        buf[buf.shape[0] - self.tail:] = be.asarray(tails)
        self.ctx.activity.moved(self.workers * piece, 2 * (self.workers - 1) * piece)


def reducer_for(ctx: Context, n: int, tail: int):
    """Sync's reducer of [n values][tail exact slots]: MPI's Allreduce, or the gather of compressed parts (their
    reduce-scatter, --compress-replies)."""
    if scheme(ctx.cfg.compress, ctx.cfg.sparsify) is not None:
        return (ScatterReducer if ctx.cfg.compress_replies else GatherReducer)(ctx, n, tail)
    return MPIReducer(ctx, n + tail)
