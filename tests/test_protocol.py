"""The wire header: one buffer, checked on arrival."""

import numpy as np
import pytest

from mpitrain.core.codec import WIRE_DTYPES, decode, encode
from mpitrain.core.config import codec_names
from mpitrain.exchange.protocol import (
    FLAG_FINAL,
    H_MAGIC,
    H_VERSION,
    HEADER_BYTES,
    MAGIC,
    TAG_GRAD,
    TAG_PARAMS,
    VERSION,
    Message,
    ProtocolError,
)


def test_header_and_payload_share_one_buffer():
    m = Message(10)
    assert m.buf.nbytes == HEADER_BYTES + 40
    m.payload[:] = np.arange(10)
    m.stamp(TAG_PARAMS, step=7, pushed=3, flags=FLAG_FINAL, loss=0.125)
    copy = Message(10)
    copy.buf[:] = m.buf  # what MPI does: bytes in, bytes out
    copy.check(TAG_PARAMS, source=0)
    assert (copy.step, copy.pushed, copy.flags, copy.loss) == (7, 3, FLAG_FINAL, 0.125)
    assert copy.payload.tolist() == list(range(10))


@pytest.mark.parametrize("compress", ["fp16", "bf16"])
def test_a_16_bit_payload_halves_the_bytes(compress):
    assert Message(10, dtype=WIRE_DTYPES[compress]).buf.nbytes == HEADER_BYTES + 20


def test_every_compression_has_a_wire_type_that_round_trips_and_a_sum_of_its_width():
    """Each codec of the one list: its wire type carries a float32 value there and back (to its
    precision), and its MPI SUM works on elements of the wire type's width."""
    from mpitrain.core.codec import CODECS

    assert tuple(CODECS) == ("none", "fp16", "bf16")
    assert codec_names() == (*CODECS, "int8", "int4", "int2")  # then the gathered ones (core/compress.py)
    values = np.array([0.0, 1.0, -2.5, 3.0e-3, 1024.0], np.float32)
    for name, codec in CODECS.items():
        wire, back = np.empty(len(values), codec.wire), np.empty(len(values), np.float32)
        encode(np, values, wire)
        decode(np, wire, back)
        np.testing.assert_allclose(back, values, rtol=1e-2 if name != "none" else 0)
        assert np.dtype(codec.wire).itemsize == (4 if name == "none" else 2)
        assert (codec.add is None) == (name == "none")  # float32 sums with MPI's own SUM


def test_bf16_keeps_the_top_half_rounded_to_nearest_even():
    bits = np.array([0x3F800000, 0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF, 0x7F800000, 0xFF800000,
                     0x00000001, 0x7F7FFFFF], np.uint32)
    wire = np.empty(len(bits), np.uint16)
    encode(np, bits.view(np.float32), wire)
    # 1.0 exact; a tie rounds to the even (1.0 / 1.0117...); above and below a tie; +-inf;
    # the smallest subnormal to 0; float32's largest rounds up to infinity, as bf16 must
    assert wire.tolist() == [0x3F80, 0x3F80, 0x3F82, 0x3F81, 0x3F80, 0x7F80, 0xFF80, 0x0000, 0x7F80]
    back = np.empty(len(bits), np.float32)
    decode(np, wire, back)
    assert back.view(np.uint32).tolist() == [w << 16 for w in wire.tolist()]


def test_bf16_round_trip_error_is_within_half_a_unit_of_its_8_bits():
    x = np.random.default_rng(0).standard_normal(10000).astype(np.float32) * 1e-6  # float16 would flush these
    wire, back = np.empty(x.shape, np.uint16), np.empty(x.shape, np.float32)
    encode(np, x, wire)
    decode(np, wire, back)
    assert np.max(np.abs(back - x) / np.abs(x)) <= 2.0 ** -8
    assert np.all(back != 0)


def test_16_bit_allreduce_ops_add_in_place():
    from mpitrain.core import codec

    a, b = np.array([1.5, -2.0, 3.0], np.float32), np.array([0.25, 2.0, 1e-3], np.float32)
    for compress, dtype in (("fp16", np.float16), ("bf16", np.uint16)):
        acc, other = np.empty(3, dtype), np.empty(3, dtype)
        encode(np, a, acc)
        encode(np, b, other)
        codec.CODECS[compress].add(other, acc, None)
        total = np.empty(3, np.float32)
        decode(np, acc, total)
        assert total == pytest.approx(a + b, rel=2.0 ** -7), compress


@pytest.mark.parametrize("slot,value,needle", [(H_MAGIC, 1234, "magic"), (H_VERSION, VERSION + 1, "protocol version")])
def test_corrupt_or_foreign_header_is_rejected(slot, value, needle):
    m = Message(4)
    m.stamp(TAG_GRAD, 0)
    m.header[slot] = value
    with pytest.raises(ProtocolError, match=needle):
        m.check(TAG_GRAD, source=2)


def test_wrong_kind_and_wrong_model_size_are_rejected():
    m = Message(4)
    m.stamp(TAG_GRAD, 0)
    with pytest.raises(ProtocolError, match="kind"):
        m.check(TAG_PARAMS, source=1)
    other = Message(4)
    other.buf[:] = m.buf
    other.count = 5  # a peer started with another model
    with pytest.raises(ProtocolError, match="4 parameters where 5"):
        other.check(TAG_GRAD, source=1)
    assert MAGIC == int(m.header[H_MAGIC])


def _float16_cases() -> np.ndarray:
    """Random float32 bit patterns (every exponent: subnormals, overflow, inf, NaN) and the edges."""
    bits = np.random.default_rng(7).integers(0, 2**32, size=400_000, dtype=np.uint64).astype(np.uint32)
    edges = np.array([0.0, -0.0, 65504, 65519.996, 65520, 65536, -65520, 6e-8, 2.9e-8, 3.0e-8, 2.0 ** -14,
                      2.0 ** -14 * (1 - 2.0 ** -11), 1e-45, np.inf, -np.inf, np.nan], np.float32)
    small = np.random.default_rng(8).standard_normal(100_000).astype(np.float32) * 1e-5  # float16 subnormals
    return np.concatenate([bits.view(np.float32), edges, small])


@pytest.mark.parametrize("chunk", [None, 1000])
def test_fp16_encode_is_numpys_cast_bit_for_bit(chunk, monkeypatch):
    from mpitrain.core import codec

    if chunk:
        monkeypatch.setattr(codec, "CHUNK", chunk)  # the chunked path, with a ragged last chunk
    x = _float16_cases()
    wire = np.empty(x.shape, np.float16)
    encode(np, x, wire)
    with np.errstate(all="ignore"):
        want = x.astype(np.float16)
    nan = np.isnan(want)
    assert np.array_equal(wire.view(np.uint16)[~nan], want.view(np.uint16)[~nan])
    assert not np.isfinite(wire[nan]).any()  # a NaN stays non-finite (it may become inf)


def test_fp16_decode_is_exact_for_every_float16():
    every = np.arange(2**16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    back = np.empty(every.shape, np.float32)
    decode(np, every, back)
    want = every.astype(np.float32)
    nan = np.isnan(want)
    assert np.array_equal(back[~nan].view(np.uint32), want[~nan].view(np.uint32))  # -0.0, subnormals, inf too
    assert np.isnan(back[nan]).all()


def test_fp16_allreduce_op_is_numpys_float16_add():
    from mpitrain.core import codec

    rng = np.random.default_rng(3)
    a, b = (rng.standard_normal(5000).astype(np.float16) * 100 for _ in range(2))
    acc = a.copy()
    codec.CODECS["fp16"].add(b, acc, None)
    with np.errstate(over="ignore"):
        assert np.array_equal(acc.view(np.uint16), (a + b).view(np.uint16))


def test_each_flag_is_a_bit_of_its_own():
    """One meaning per flag: no two names share a bit, so a message can say two things at once
    and a reader never has to know which tag a flag came with to know what it means."""
    from mpitrain.exchange import protocol

    flags = {name: value for name, value in vars(protocol).items() if name.startswith("FLAG_")}
    assert all(v > 0 and v & (v - 1) == 0 for v in flags.values()), flags
    assert len(set(flags.values())) == len(flags), flags


def test_a_regroup_or_join_number_travels_in_a_slot_of_its_own():
    """One meaning per header slot: the step and a worker's count are never reused for a
    regroup's or a join's number, nor for who joins."""
    from mpitrain.exchange.protocol import TAG_REPORT

    m = Message(0)
    m.stamp(TAG_REPORT, step=5, pushed=3, generation=2, joiner=1)
    got = Message(0)
    got.buf[:] = m.buf
    got.check(TAG_REPORT, source=0)
    assert (got.step, got.pushed, got.generation, got.joiner) == (5, 3, 2, 1)
