from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from afd.connectors.wire import (
    Header,
    Kind,
    Op,
    ProtocolError,
    Role,
    TensorName,
    decode_payload,
    encode,
    flat_bytes,
    make_message,
    tensor_bytes,
)

DTYPES = [torch.float32, torch.bfloat16, torch.int32, torch.uint8]


@given(
    st.sampled_from(list(Kind)), st.integers(0, 7), st.integers(0, 7), st.integers(-1, 60), st.integers(0, 7),
    st.integers(0, 2**40), st.lists(st.tuples(st.sampled_from(list(TensorName)), st.sampled_from(DTYPES), st.lists(st.integers(0, 5), max_size=3)), max_size=4, unique_by=lambda x: x[0]),
)
def test_round_trip_is_byte_exact(kind, src, dst, layer, mb, seq, tensors):
    data = {name: (torch.randn(shape) * 10).to(dtype) for name, dtype, shape in tensors}
    n = next(iter(data.values())).shape[0] if data and next(iter(data.values())).dim() else 0
    msg = make_message(Header(kind, Role.FFN, src, dst, layer, mb, seq, n, Op.ROUTED | Op.SHARED), data)
    header_bytes, parts = encode(msg)
    payload = b"".join(bytes(tensor_bytes(t)) for t in parts)
    header, size = Header.unpack(header_bytes, "test")
    assert size == len(header_bytes) and header == msg.header
    out = decode_payload(header, payload, "test")  # a transport's reusable buffer (shm, loopback)
    wire = torch.cat([flat_bytes(t) for t in parts]) if parts else torch.empty(0, dtype=torch.uint8)
    handed = decode_payload(header, wire, "test")  # a fresh tensor handed over (torch transport): views where aligned
    for name, t in data.items():
        assert out.tensors[name].dtype == t.dtype and torch.equal(out.tensors[name], t)
        assert handed.tensors[name].dtype == t.dtype and torch.equal(handed.tensors[name], t)


def test_damaged_messages_are_refused_with_both_ranks_named():
    msg = make_message(Header(Kind.WORK, Role.ATTENTION, 1, 0, 3, 0, 7, 2), {TensorName.HIDDEN: torch.ones(2, 4)})
    hb, parts = encode(msg)
    payload = bytes(tensor_bytes(parts[0]))
    with pytest.raises(ProtocolError, match="bad magic"):
        Header.unpack(b"XXXX" + hb[4:], "ffn rank 0")
    with pytest.raises(ProtocolError, match="truncated header"):
        Header.unpack(hb[:10], "ffn rank 0")
    with pytest.raises(ProtocolError, match="ffn rank 0: truncated payload from attention rank 1"):
        decode_payload(msg.header, payload[:-4], "ffn rank 0")
    bad_version = bytearray(hb)
    bad_version[4] = 9
    with pytest.raises(ProtocolError, match="protocol version 9 from attention rank 1"):
        Header.unpack(bytes(bad_version), "ffn rank 0")
    with pytest.raises(ProtocolError, match=r"ffn rank 0: message from attention rank 1 does not pair: layer=3 \(expected 4\)"):
        msg.header.expect("ffn rank 0", layer=4, seq=7)


def test_a_tensor_after_an_odd_sized_one_is_decoded_from_an_unaligned_offset():
    hidden, ids = torch.randn(3, 1).bfloat16(), torch.tensor([[7, -1]], dtype=torch.int32)  # ids start at byte 6
    msg = make_message(Header(Kind.WORK, Role.ATTENTION, 0, 0, 1, 0, 1, 3), {TensorName.HIDDEN: hidden, TensorName.EXPERT_IDS: ids})
    _, parts = encode(msg)
    out = decode_payload(msg.header, torch.cat([flat_bytes(t) for t in parts]), "test")
    assert torch.equal(out.get(TensorName.HIDDEN), hidden) and torch.equal(out.get(TensorName.EXPERT_IDS), ids)


def test_a_tensor_table_seen_before_still_has_the_fixed_fields_checked():
    """Parsed tables are cached by their bytes; the payload size and tensor count in the fixed part are checked every time."""
    from afd.connectors import wire

    msg = make_message(Header(Kind.WORK, Role.ATTENTION, 1, 0, 3, 0, 7, 2), {TensorName.HIDDEN: torch.ones(2, 4), TensorName.WEIGHTS: torch.ones(2, 1)})
    hb, _ = encode(msg)
    first, _ = Header.unpack(hb, "ffn rank 0")
    again, size = Header.unpack(hb, "ffn rank 0")  # from the cache: the same specs, the same header
    assert again == first == msg.header and size == len(hb) and again.tensors is first.tensors
    fields = list(wire._FIXED.unpack_from(hb, 0))
    fields[-1] += 4  # payload bytes
    with pytest.raises(ProtocolError, match="declares 44 payload bytes but its tensor table sums to 40"):
        Header.unpack(wire._FIXED.pack(*fields) + hb[wire._FIXED.size :], "ffn rank 0")
    fields[-1] -= 4
    fields[-2] = 1  # one tensor: the same table bytes read as one entry and trailing bytes
    with pytest.raises(ProtocolError, match="tensor table sums to 32"):
        Header.unpack(wire._FIXED.pack(*fields) + hb[wire._FIXED.size :], "ffn rank 0")
    fields[-2] = 3  # a third entry the table does not hold
    with pytest.raises(ProtocolError, match="truncated tensor table"):
        Header.unpack(wire._FIXED.pack(*fields) + hb[wire._FIXED.size :], "ffn rank 0")


@given(st.integers(0, 40), st.sampled_from([torch.float32, torch.bfloat16]), st.integers(0, 63), st.integers(0, 60), st.integers(0, 2**40),
       st.integers(0, 7), st.integers(0, 2**63 - 1), st.integers(1, 15), st.integers(0, 9), st.floats(0, 10_000, allow_nan=False))
def test_the_packed_result_header_is_the_result_message_s(n, dtype, src, layer, seq, mb, members, ffn_members, placement, busy_s):
    """An FFN rank packs its answers' headers directly (result_header); they are the bytes result_message's header packs to,
    and carry the union's compute time to the microsecond (saturating, ~71 minutes, rather than wrapping)."""
    from afd.connectors.wire import result_header
    from afd.connectors.work import result_message

    work = Header(Kind.WORK, Role.ATTENTION, src, 3, layer, mb, seq, n, Op.ROUTED | Op.SHARED, epoch=seq % 5, members=members,
                  ffn_members=ffn_members, placement=placement)
    out = torch.randn(n, 24).to(dtype)
    packed = result_header(work, 3, out, busy_s)
    assert packed == result_message(work, 3, out, busy_s).header.pack()
    header, size = Header.unpack(packed, "attention rank 0")
    assert header == result_message(work, 3, out, busy_s).header and size == len(packed)
    assert header.busy_us == min(round(busy_s * 1e6), 2**32 - 1)
