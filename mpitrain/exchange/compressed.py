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
    """exchange.base.Reducer over a buffer of `n` compressed values and `tail` exact float32 slots."""

    def __init__(self, ctx: Context, n: int, tail: int):
        super().__init__(ctx)
        self.n, self.tail = n, tail
        self.compressor = Compressor(scheme(ctx.cfg.compress, ctx.cfg.sparsify), n, self.be.xp)
        self.body = self.compressor.wire_bytes
        self.part = -(-(self.body + 4 * tail) // ALIGN) * ALIGN
        workers = 1 if self.alone else self.comm.Get_size()
        self.me = 0 if self.alone else self.comm.Get_rank()
        self.parts = np.zeros(workers * self.part, np.uint8)  # every worker's, in rank order

    def start(self, buf) -> InFlight:
        """Compress this worker's part of `buf` (with its error feedback) and start gathering every part."""
        be, n, body = self.be, self.n, self.body
        mine = self.parts[self.me * self.part: (self.me + 1) * self.part]
        self.compressor.compress_to_host(buf[:n], mine[:body], be.to_host)
        mine[body: body + 4 * self.tail].view(np.float32)[...] = be.to_host(buf[n:])
        spec = [self.parts, MPI.BYTE]
        return InFlight(self.comm.Iallgather(MPI.IN_PLACE, spec), spec, buf)

    def finish(self, flight: InFlight) -> None:
        """Wait for the parts, then their sum into the buffer given to `start`."""
        self.land(flight)
        be, xp, n, body, size, buf = self.be, self.be.xp, self.n, self.body, self.part, flight.buf
        parts = self.parts if xp is np else be.asarray(self.parts)
        tails = np.zeros(self.tail, np.float32)
        for w in range(len(self.parts) // size):  # rank order on every worker: the same sum everywhere
            part = parts[w * size: (w + 1) * size]
            self.compressor.decompress(part[:body], buf[:n], add=w > 0)
            tails += self.parts[w * size + body: w * size + body + 4 * self.tail].view(np.float32)
        buf[n:] = be.asarray(tails)
        self.ctx.activity.moved(size, size * (len(self.parts) // size - 1))


def reducer_for(ctx: Context, n: int, tail: int):
    """Sync's reducer of [n values][tail exact slots]: MPI's Allreduce, or the gather of compressed parts."""
    if scheme(ctx.cfg.compress, ctx.cfg.sparsify) is not None:
        return GatherReducer(ctx, n, tail)
    return MPIReducer(ctx, n + tail)
