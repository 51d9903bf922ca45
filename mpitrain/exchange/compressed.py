"""The sync workers' exchange of compressed parts (--compress int8 / int4, --sparsify P): a Reducer
whose sum is an Allgather of every worker's part, each decoded and added by every worker in rank
order. MPI cannot add int8 blocks that carry different scales, nor top-k lists, in place; the
gather makes every worker's sum bitwise the same, so replicas stay identical as with Allreduce.
A part costs each worker (W - 1) parts to receive: it pays while a part is under about half the
float32 gradient per other worker (int8 3.9x smaller, int4 7.7x, top 2% in int8 39x; the start
line says how many bytes).

A part is [the values, compressed with error feedback (core/compress.py)][the tail slots, float32
as they are]: the loss, weight, votes and stamp that sync reads exactly (modes/sync.torn).
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from mpitrain.core.compress import Compressor, scheme
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
        self.parts = np.zeros(self.workers * self._size(self.compressor), np.uint8)  # every worker's, in rank order

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
        parts = self.parts[: self.workers * size]
        mine = parts[self.me * size: (self.me + 1) * size]
        c.compress_to_host(buf[:values], mine[:body], be.to_host)
        mine[body: body + 4 * self.tail].view(np.float32)[...] = be.to_host(buf[values:])
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
            tails += gathered[w * size + body: w * size + body + 4 * self.tail].view(np.float32)
        buf[values:] = be.asarray(tails)
        self.ctx.activity.moved(size, size * (self.workers - 1))


def reducer_for(ctx: Context, n: int, tail: int):
    """Sync's reducer of [n values][tail exact slots]: MPI's Allreduce, or the gather of compressed parts."""
    if scheme(ctx.cfg.compress, ctx.cfg.sparsify) is not None:
        return GatherReducer(ctx, n, tail)
    return MPIReducer(ctx, n + tail)
