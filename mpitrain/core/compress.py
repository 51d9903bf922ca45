"""Compressors that no MPI SUM can add (--compress int8 / int4, --sparsify P): what a worker sends
instead of its whole float32 gradient. Sync gathers every worker's part and each worker adds them
all, in rank order, so the sum is bitwise the same everywhere (exchange/compressed.py); async's
pushes and --quorum's contributions are written and read through `Pushes`, the reader decoding
into float32 before it applies anything.

A scheme turns float32 values into bytes and back (`encode`, `decode`, `wire_bytes`): BlockQuantizer
keeps one float32 scale per BLOCK values (their largest magnitude over 127, or over 7 for int4) and
each value as a rounded multiple of it, so an entry is off by at most half its block's scale; TopK
keeps the k largest magnitudes with their indices (and quantises those values when given a
quantiser). A Compressor (Horovod's two-method shape: compress, decompress) wraps a scheme with
error feedback (Seide et al. 2014; Karimireddy et al. 2019): what it could not send this time is
kept and added to the next exchange, so over many exchanges everything is sent.

The elementwise wire types (none, fp16, bf16) stay core/codec.py's: MPI sums them in place.
Written for NumPy and CuPy alike (`xp`); run on NumPy only (no GPU on the machines that built it).
"""

from __future__ import annotations

import math

import numpy as np

from mpitrain.core.codec import CODECS

BLOCK = 256  # values per scale: 4 bytes of scale per 256 (int8: 1.6% on top of the 1 byte each)
LEVELS = {8: 127, 4: 7, 2: 1}  # the largest integer each width sends (symmetric: no zero-point to carry)


class BlockQuantizer:
    """`bits`-bit integers with a float32 scale per BLOCK values. Wire: [scales][integers] (int4, int2:
    two or four per byte, the first in the lowest bits, each stored + 8 or + 2; int2 sends -1, 0 or 1 of its
    block's largest magnitude, SparseLoCo's 2 bits, error feedback carrying the rest)."""

    def __init__(self, bits: int):
        self.bits, self.levels = bits, LEVELS[bits]
        self.name = f"int{bits}"

    def blocks(self, n: int) -> int:
        return -(-n // BLOCK)

    def wire_bytes(self, n: int) -> int:
        nb = self.blocks(n)
        return 4 * nb + nb * BLOCK * self.bits // 8

    def encode(self, xp, values, out) -> None:
        """float32 `values` -> `out` (uint8, wire_bytes(len(values)))."""
        n, nb = values.size, self.blocks(values.size)
        padded = xp.zeros(nb * BLOCK, xp.float32)
        padded[:n] = values
        blocks = padded.reshape(nb, BLOCK)
        scales = out[: 4 * nb].view(xp.float32)
        xp.abs(blocks).max(axis=1, out=scales)
        scales /= self.levels
        scales[scales == 0] = 1  # an all-zero block: any scale sends zeros
        q = xp.rint(blocks / scales[:, None])
        xp.clip(q, -self.levels, self.levels, out=q)
        body = out[4 * nb:]
        if self.bits == 8:
            body.view(xp.int8)[...] = q.ravel()
            return
        per = 8 // self.bits
        u = (q.ravel() + (1 << (self.bits - 1))).astype(xp.uint8).reshape(-1, per)
        body[...] = u[:, 0]
        for i in range(1, per):
            body |= u[:, i] << (self.bits * i)

    def decode(self, xp, wire, out, add: bool = False) -> None:
        """`wire` -> float32 `out` (its length is the values' count); `add`: out += the values."""
        n, nb = out.size, self.blocks(out.size)
        scales = wire[: 4 * nb].view(xp.float32)
        body = wire[4 * nb:]
        if self.bits == 8:
            q = body.view(xp.int8).astype(xp.float32)
        else:
            per, mask = 8 // self.bits, (1 << self.bits) - 1
            q = xp.empty(per * body.size, xp.float32)
            for i in range(per):
                q[i::per] = (body >> (self.bits * i)) & mask
            q -= 1 << (self.bits - 1)
        values = (q.reshape(nb, BLOCK) * scales[:, None]).ravel()[:n]
        if add:
            out += values
        else:
            out[...] = values


class TopK:
    """The k = ceil(fraction x n) entries of largest magnitude: [indices, int32, ascending][values,
    float32 or through `inner`]. The rest are zeros to the reader (and the writer's residual)."""

    def __init__(self, fraction: float, inner: BlockQuantizer | None = None):
        self.fraction, self.inner = fraction, inner
        self.name = f"top {fraction * 100:g}%" + (f" in {inner.name}" if inner else "")

    def k(self, n: int) -> int:
        return max(1, min(n, math.ceil(self.fraction * n)))

    def _values_bytes(self, k: int) -> int:
        return self.inner.wire_bytes(k) if self.inner else 4 * k

    def wire_bytes(self, n: int) -> int:
        k = self.k(n)
        return 4 * k + self._values_bytes(k)

    def encode(self, xp, values, out) -> None:
        n = values.size
        k = self.k(n)
        idx = xp.sort(xp.argpartition(xp.abs(values), n - k)[n - k:]).astype(xp.int32)
        out[: 4 * k].view(xp.int32)[...] = idx
        picked = values[idx]
        if self.inner:
            self.inner.encode(xp, picked, out[4 * k:])
        else:
            out[4 * k:].view(xp.float32)[...] = picked

    def decode(self, xp, wire, out, add: bool = False) -> None:
        k = self.k(out.size)
        idx = wire[: 4 * k].view(xp.int32)
        picked = xp.empty(k, xp.float32)
        if self.inner:
            self.inner.decode(xp, wire[4 * k:], picked)
        else:
            picked[...] = wire[4 * k: 8 * k].view(xp.float32)
        if not add:
            out[...] = 0
        out[idx] += picked  # indices are distinct: no two adds to one entry


QUANTIZERS = {q.name: q for q in (BlockQuantizer(8), BlockQuantizer(4), BlockQuantizer(2))}
NAMES = (*CODECS, *QUANTIZERS)  # --compress's choices: the elementwise codecs, then these


def scheme(compress: str, sparsify: float | None):
    """The scheme for --compress and --sparsify (percent), or None: the elementwise wire (MPI sums it)."""
    inner = QUANTIZERS.get(compress)
    if sparsify is not None:
        return TopK(sparsify / 100, inner)
    return inner


class Compressor:
    """A scheme with error feedback over `n` values: compress(values, out) writes what is sent
    and keeps the rest (`residual`) for the next call; decompress(wire, out, add) reads a part."""

    def __init__(self, scheme_, n: int, xp):
        self.scheme, self.n, self.xp = scheme_, n, xp
        self.wire_bytes = scheme_.wire_bytes(n)
        self.residual = xp.zeros(n, xp.float32)
        self._sent = xp.empty(n, xp.float32)

    def compress(self, values, out) -> None:
        r = self.residual
        r += values  # what is owed: this exchange's values and what earlier ones held back
        self.scheme.encode(self.xp, r, out)
        self.scheme.decode(self.xp, out, self._sent)
        r -= self._sent

    def decompress(self, wire, out, add: bool = False) -> None:
        self.scheme.decode(self.xp, wire, out, add)

    def compress_to_host(self, values, host: np.ndarray, to_host) -> None:
        """compress() into host memory (uint8): straight there with NumPy; with CuPy on the device, then
        one copy of the compressed bytes (`to_host`: the backend's)."""
        if self.xp is np:
            self.compress(values, host)
            return
        wire = self.xp.empty(host.size, self.xp.uint8)
        self.compress(values, wire)
        host[...] = to_host(wire)


class Pushes:
    """How one sender's gradients travel to one reader (async's pushes, --quorum's contributions): `count`
    elements of `dtype` a message, which is n values of --compress's elementwise type, or a scheme's part
    with this sender's error feedback. `be`: the backend (staging to and from the host, the device's xp)."""

    def __init__(self, cfg, n: int, be):
        self.n, self.be, self.scheme = n, be, scheme(cfg.compress, cfg.sparsify)
        self.count, self.dtype = (n, cfg.wire_dtype) if self.scheme is None else (self.scheme.wire_bytes(n), np.uint8)
        self._feedback: Compressor | None = None  # made by the first write: a reader keeps none

    def gradient(self, payload):
        """The float32 array a sender computes into for `payload`: the payload itself where it can be."""
        return self.be.mirror(payload) if self.scheme is None else self.be.xp.zeros(self.n, self.be.xp.float32)

    def write(self, grad, payload) -> None:
        """The sender's: `grad` (float32) into the message's payload."""
        if self.scheme is None:
            self.be.download(grad, payload)
            return
        if self._feedback is None:
            self._feedback = Compressor(self.scheme, self.n, self.be.xp)
        self._feedback.compress_to_host(grad, payload, self.be.to_host)

    def read(self, payload, out) -> None:
        """The reader's: a received payload into float32 `out` (on the reader's device)."""
        if self.scheme is None:
            self.be.upload(out, payload)
        else:
            self.scheme.decode(self.be.xp, self.be.asarray(payload), out)


class Replies:
    """How async's replies travel (the server writes, a worker reads): the parameters as they are (in
    --compress's elementwise type), or with --compress-replies each worker's as their change since what it
    holds, in the pushes' scheme. The server keeps what each worker holds (`held`: the worker adds what it
    decodes, the server the same, bit for bit), so what one reply holds back the next one carries: error
    feedback without a residual of its own. A worker's parameters then trail the server's by one reply's
    compression error."""

    def __init__(self, cfg, n: int, be):
        self.n, self.be = n, be
        self.scheme = scheme(cfg.compress, cfg.sparsify) if cfg.compress_replies else None
        self.count, self.dtype = (n, cfg.wire_dtype) if self.scheme is None else (self.scheme.wire_bytes(n), np.uint8)
        self.held: dict[int, object] = {}  # the server's: worker -> the parameters it holds
        self._delta = None

    def start(self, worker: int, params) -> None:
        """The server's: `worker` holds `params` (the phase's start state, which it was given too)."""
        if self.scheme is not None:
            self.held[worker] = params.copy()

    def write(self, worker: int, params, payload) -> None:
        """The server's: the reply to `worker` into the message's payload (a copy: params change in flight)."""
        if self.scheme is None:
            self.be.download(params, payload)
            return
        xp, held = self.be.xp, self.held[worker]
        if self._delta is None:
            self._delta = xp.empty(self.n, xp.float32)
        xp.subtract(params, held, out=self._delta)
        wire = payload if xp is np else xp.empty(payload.size, xp.uint8)
        self.scheme.encode(xp, self._delta, wire)
        self.scheme.decode(xp, wire, held, add=True)  # what the worker will hold
        if xp is not np:
            payload[...] = self.be.to_host(wire)

    def read(self, payload, params) -> None:
        """A worker's: a reply's payload into its `params` (on its device)."""
        if self.scheme is None:
            self.be.upload(params, payload)
        else:
            self.scheme.decode(self.be.xp, self.be.asarray(payload), params, add=True)


def push_words(cfg, n: int, pushes: str = "async pushes", answer: str = "rank 0 replies with the parameters") \
        -> str | None:
    """For the start line (async, --quorum): what a push is when a scheme compresses it (None: the
    elementwise wire) and what answers it."""
    s = scheme(cfg.compress, cfg.sparsify)
    if s is None:
        return None
    if cfg.compress_replies:
        answer = f"rank 0 replies with the parameters' change since what the worker holds, {s.name} too"
    else:
        answer = f"{answer} in {np.dtype(cfg.wire_dtype).name}"
    return f"{pushes}: {s.name} with error feedback, {_fewer(s, n)} a push; {answer}"


def gather_words(cfg, n: int, workers: int) -> str | None:
    """For the start line (sync): what a worker's part is when a scheme compresses it (None: an Allreduce)."""
    s = scheme(cfg.compress, cfg.sparsify)
    if s is None:
        return None
    if cfg.compress_replies:
        how = (f"a reduce-scatter: each worker adds 1/{workers} of every part and sends that sum in {s.name} too, "
               f"receiving {2 * (workers - 1) / workers:.2g} of a part")
    else:
        how = f"an Allgather: each worker receives {workers - 1} other part{'s' if workers != 2 else ''}"
    when = "a step" if cfg.local_steps == 1 else f"an outer step (every {cfg.local_steps} steps)"
    if cfg.fragments > 1:
        when = f"for all the parameters, 1/{cfg.fragments} of them an exchange (--fragments {cfg.fragments})"
    return f"sync exchange: {s.name} with error feedback, {_fewer(s, n)} a worker {when}; {how}"


def _fewer(s, n: int) -> str:
    nbytes = s.wire_bytes(n)
    return f"{nbytes:,} bytes instead of {4 * n:,} ({4 * n / nbytes:.1f}x fewer)"
