"""The wire header: one buffer, checked on arrival."""

import numpy as np
import pytest

from mpitrain.protocol import (FLAG_STOP, HEADER_BYTES, MAGIC, TAG_GRAD, TAG_PARAMS, VERSION, Message,
                               ProtocolError, H_MAGIC, H_VERSION)


def test_header_and_payload_share_one_buffer():
    m = Message(10)
    assert m.buf.nbytes == HEADER_BYTES + 40
    m.payload[:] = np.arange(10)
    m.stamp(TAG_PARAMS, step=7, local_step=3, flags=FLAG_STOP, loss=0.125)
    copy = Message(10)
    copy.buf[:] = m.buf  # what MPI does: bytes in, bytes out
    copy.check(TAG_PARAMS, source=0)
    assert (copy.step, copy.local_step, copy.flags, copy.loss) == (7, 3, FLAG_STOP, 0.125)
    assert copy.payload.tolist() == list(range(10))


def test_fp16_payload_halves_the_bytes():
    assert Message(10, dtype=np.float16).buf.nbytes == HEADER_BYTES + 20


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
