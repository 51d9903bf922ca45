"""How parameters and gradients are written on the wire (--compress): float32, float16, bfloat16.

Updates are always computed in float32; only the wire is narrower. `encode` writes float32 values
into a wire-typed array, `decode` reads them back, with NumPy or CuPy (`xp`) alike.

bfloat16 is the top half of a float32 (same exponent range, 8 bits of mantissa), so it is
converted with integer shifts on the float32's bits. It needs no float16 range care either:
gradients too small for float16 stay non-zero.

float16 on a CPU: NumPy converts one element at a time (~5 ns each on the 2-core VM: 400 us to
narrow 79,510 values, 200 us to widen them). Here both directions are whole-array integer and
float passes over the bits instead (each pass ~12 us), bit-identical to NumPy's casts, round
to nearest even, subnormals and overflow included: 1.5-2x faster to narrow, 1.7-3x to
widen (benchmarks/README.md). CuPy keeps its own casts: a GPU converts float16 natively.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable

import numpy as np

BF16_ROUND = 0x7FFF  # with the kept bits' lowest one added: round to nearest, ties to even

# float32 -> float16 on the bits (after Maratyszcza's FP16 library, fp16_ieee_from_fp32_value):
# the magnitude is clamped so that infinities, NaNs and everything at or above 65536.0 become
# float16 infinity; adding a power of two chosen from the exponent then makes the FPU round the
# mantissa to float16's 10 bits (to nearest even), and the result's exponent and low bits are
# float16's. A NaN becomes infinity: either is non-finite, and a non-finite gradient or loss
# stops training before anything is applied (guard.py), as with bf16.
F16_CLAMP = 0x47800000  # 65536.0: the smallest float32 that rounds to float16 infinity
F16_FLOOR = 0x38800000  # 2**-14, float16's smallest normal: below it, float16 has fixed steps
F16_BIAS = 0x07800000  # with the exponent: 2**(e + 15), the rounding constant
F16_SCALE = 2.0 ** 112  # float32 bits of a float16 moved to bits 13-27, times this, are its value
F16_MAX_BITS = 0x7C00  # float16 exponent all ones: infinity or NaN
CHUNK = 1 << 18  # elements per pass: bounds a scratch set (4.5 MiB) whatever the model's size
SCRATCH_SIZES = 4  # lengths kept per thread: the whole model, a chunk, an Allreduce op's pieces
_local = threading.local()  # scratch per thread: two threads converting at once never share one


def is_bf16(arr) -> bool:
    return arr.dtype == np.uint16


def encode(xp, src, dst) -> None:
    """float32 `src` -> wire array `dst` (same length; float32, float16 or bf16 bits)."""
    if is_bf16(dst):
        _bf16_encode(xp, src, dst)
    elif dst.dtype == np.float16 and xp is np:
        for s in _chunks(len(src)):
            _fp16_encode(src[s], dst[s].view(np.uint16))
    else:
        dst[...] = src  # float32 copy, or CuPy's float16 cast


def decode(xp, src, dst) -> None:
    """Wire array `src` -> float32 `dst`."""
    if is_bf16(src):
        out = dst.view(xp.uint32)
        out[...] = src
        out <<= 16
    elif src.dtype == np.float16 and xp is np:
        for s in _chunks(len(src)):
            _fp16_decode(src[s].view(np.uint16), dst[s])
    else:
        dst[...] = src


def _bf16_encode(xp, src, dst) -> None:
    # (A NaN whose payload sits in the low bits may round to infinity: either is non-finite, and
    # a non-finite gradient or loss stops training before anything is applied; guard.py.)
    bits = src.view(xp.uint32)
    rounded = bits >> 16
    rounded &= 1
    rounded += bits
    rounded += xp.uint32(BF16_ROUND)
    rounded >>= 16
    dst[...] = rounded


def _chunks(n: int):
    return (slice(i, min(i + CHUNK, n)) for i in range(0, n, CHUNK))


class _Scratch:
    """Work arrays for one chunk size. The constants are whole arrays: NumPy's minimum and
    maximum against a scalar take ~4x as long as against an array (measured)."""

    def __init__(self, n: int):
        self.a, self.b = np.empty(n, np.uint32), np.empty(n, np.uint32)
        self.half = np.empty(n, np.uint16)
        self.clamp, self.floor = np.full(n, F16_CLAMP, np.uint32), np.full(n, F16_FLOOR, np.uint32)


def _scratch(n: int) -> _Scratch:
    cache = _local.__dict__.setdefault("scratch", {})
    if n not in cache:
        if len(cache) >= SCRATCH_SIZES:
            cache.clear()
        cache[n] = _Scratch(n)
    return cache[n]


def _fp16_encode(src: np.ndarray, out: np.ndarray) -> None:
    """float32 `src` -> float16 bits `out` (uint16), as NumPy's cast would give them."""
    w = _scratch(len(src))
    mag, bias = w.a, w.b
    np.bitwise_and(src.view(np.uint32), np.uint32(0x7FFFFFFF), out=mag)
    np.minimum(mag, w.clamp, out=mag)  # inf, NaN and >= 65536 -> 65536, which becomes inf
    np.bitwise_and(mag, np.uint32(0x7F800000), out=bias)
    np.maximum(bias, w.floor, out=bias)  # float16 subnormals round at 2**-24 steps
    bias += np.uint32(F16_BIAS)
    rounded = mag.view(np.float32)
    rounded *= np.float32(4.0)
    rounded += bias.view(np.float32)  # the FPU rounds to the 10 bits kept
    np.right_shift(mag, 13, out=bias)
    bias &= np.uint32(0x7C00)  # float16's exponent ...
    mag &= np.uint32(0xFFF)  # ... plus its mantissa, whose carry may raise the exponent
    bias += mag
    np.right_shift(src.view(np.uint32), 16, out=mag)
    mag &= np.uint32(0x8000)  # the sign
    bias |= mag
    out[...] = bias


def _fp16_decode(src: np.ndarray, dst: np.ndarray) -> None:
    """float16 bits `src` (uint16) -> float32 `dst`, exactly."""
    out = dst.view(np.uint32)
    out[...] = src
    out <<= 16  # sign at bit 31, exponent and mantissa at 16-30 ...
    arithmetic = out.view(np.int32)
    arithmetic >>= 3  # ... at 13-27; the sign is copied into 28-30 ...
    out &= np.uint32(0x8FFFFFFF)  # ... and cleared there
    dst *= np.float32(F16_SCALE)  # rebias the exponent; float16 subnormals become float32 normals
    magnitude = _scratch(len(src)).half
    np.bitwise_and(src, np.uint16(0x7FFF), out=magnitude)
    if magnitude.max(initial=0) >= F16_MAX_BITS:  # rare: infinities and NaNs came out as 65536-131071
        out[magnitude >= F16_MAX_BITS] |= np.uint32(0x7F800000)


def _sum_op(wire_dtype):
    """A 16-bit SUM for MPI: widens both operands, adds in float32 and rounds back once (what
    NumPy's own float16 add does, element by element)."""

    def add(inbuf, inoutbuf, datatype) -> None:
        acc = np.frombuffer(inoutbuf, wire_dtype)
        total, other = np.empty(acc.shape, np.float32), np.empty(acc.shape, np.float32)
        decode(np, acc, total)
        decode(np, np.frombuffer(inbuf, wire_dtype), other)
        total += other
        encode(np, total, acc)

    return add


@dataclass(frozen=True)
class Codec:
    """One --compress choice: its element type on the wire (bfloat16 travels as its 16 raw bits)
    and its Allreduce SUM. encode/decode above serve every codec (they go by the wire type)."""

    name: str
    wire: type
    add: Callable | None = None  # the body of its MPI SUM op (exchange.mpi.wire_sum); None: MPI's own float SUM
    exact: int = 2 ** 24  # every integer up to this one survives the wire and its sum exactly (sync's tail slots)


# --compress NAME -> its codec: the one list of them (the CLI's choices and validate read it).
CODECS = {c.name: c for c in (Codec("none", np.float32), Codec("fp16", np.float16, _sum_op(np.float16), 2 ** 11),
                              Codec("bf16", np.uint16, _sum_op(np.uint16), 2 ** 8))}
WIRE_DTYPES = {name: c.wire for name, c in CODECS.items()}  # --compress -> element type on the wire

