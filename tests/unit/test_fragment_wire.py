"""common/codec/framing.py: the writer's bytes are protobuf's own and pinned; the parser checks
framing, headers, lengths, checksums and scales without decoding the values."""

from __future__ import annotations

import zlib

import pytest
import torch

from common.codec.fp4 import NOT_FINITE
from common.codec.fragment import apply_updates, decode_fragment, encode_fragment
from common.codec.framing import chain_parts, fragment_parts, tensor_message
from common.codec.sparse import SPARSE_CODECS
from common.codec.tensor import CODECS, decode, encode, parse_fragment, parse_fragment_view
from common.errors import InvalidArgument
from common.generated.diloco.v1 import aggregator_pb2 as pb


def pinned_tensors() -> list[torch.Tensor]:
    """Odd sizes, an empty and a 0-d tensor, and values near float32's smallest."""
    g = torch.Generator().manual_seed(2024)
    return [
        torch.randn(3, 45, generator=g),
        torch.randn(0, 4),
        torch.randn((), generator=g) * 1e5,
        torch.randn(70, generator=g) * 1e-30,
    ]


# (length, zlib CRC32) of encode_fragment(pinned_tensors(), codec): the wire bytes themselves.
PINNED = {
    "fp32": (879, 0xA80A6C04),
    "bf16": (467, 0x7659A861),
    "fp4_e2m1": (170, 0xFD8537DE),
    "fp4_e3m0": (170, 0x2ADCAC87),
    "sparse_2bit": (96, 0x2AF13444),
}


@pytest.mark.parametrize("codec", CODECS)
def test_fragment_bytes_are_pinned_and_protobufs_own(codec: str) -> None:
    tensors = pinned_tensors()
    data = encode_fragment(tensors, codec)
    assert (len(data), zlib.crc32(data)) == PINNED[codec]
    if CODECS[codec] in SPARSE_CODECS:  # encoded whole fragments only (common/codec/sparse.py)
        msg = pb.EncodedFragment.FromString(data)
        assert msg.SerializeToString() == data
        for t in msg.tensors:
            k = t.sparse_k.to_bytes(4, "little")
            assert t.crc32 == zlib.crc32(k, zlib.crc32(t.scales, zlib.crc32(t.payload)))
        return
    # Protobuf's serialization of the same fields, checksummed here independently.
    messages = []
    for t in tensors:
        msg = encode(t, codec)
        expected_crc = zlib.crc32(msg.scales, zlib.crc32(msg.payload))
        messages.append(
            pb.EncodedTensor(
                codec=CODECS[codec],
                shape=list(t.shape),
                payload=msg.payload,
                scales=msg.scales,
                crc32=expected_crc,
            )
        )
    assert data == pb.EncodedFragment(tensors=messages).SerializeToString()


def test_parts_pass_payloads_through_uncopied() -> None:
    payload, scales = memoryview(bytes(range(200))), memoryview(b"\x7f" * 7)
    parts = fragment_parts([(pb.CODEC_FP4_E2M1, (400,), payload, scales)])
    assert any(p is payload for p in parts) and any(p is scales for p in parts)
    (msg,) = pb.EncodedFragment.FromString(b"".join(parts)).tensors
    assert msg == tensor_message(pb.CODEC_FP4_E2M1, (400,), payload, scales)
    assert msg.payload == bytes(payload) and msg.scales == bytes(scales)


@pytest.mark.parametrize("have_version", [0, 5, 127, 128, 300_000])
def test_chain_parts_equal_fragment_updates(have_version: int) -> None:
    torch.manual_seed(1)
    updates = [
        pb.EncodedFragment(tensors=[encode(torch.randn(n) * 1e-3, "fp4_e2m1")])
        for n in (32, 70_000, 1000)
    ]
    logged = [u.SerializeToString() for u in updates]
    parts = chain_parts(have_version, logged)
    expected = pb.FragmentUpdates(from_version=have_version, updates=updates).SerializeToString()
    assert b"".join(parts) == expected
    assert any(part is logged[1] for part in parts)  # shared, not copied


def test_chain_parts_apply_like_a_serialized_chain() -> None:
    torch.manual_seed(2)
    deltas = [torch.randn(64) * 1e-2 for _ in range(3)]
    logged = [
        pb.EncodedFragment(tensors=[encode(d, "fp4_e2m1")]).SerializeToString() for d in deltas
    ]
    replica = [torch.zeros(64)]
    assert apply_updates(replica, b"".join(chain_parts(4, logged)), 4) == 7
    assert not torch.equal(replica[0], torch.zeros(64))


def _forged(t: torch.Tensor, codec: int, payload: bytes, scales: bytes = b"") -> bytes:
    msg = pb.EncodedTensor(
        codec=codec,
        shape=list(t.shape),
        payload=payload,
        scales=scales,
        crc32=zlib.crc32(scales, zlib.crc32(payload)),
    )
    return pb.EncodedFragment(tensors=[msg]).SerializeToString()


def test_the_parser_checks_everything_but_the_values() -> None:
    t = torch.tensor([1.0, float("nan"), 3.0])
    data = _forged(t, pb.CODEC_FP32, t.numpy().tobytes())
    (checked,) = parse_fragment(data, [(3,)])  # the values are not read ...
    assert (checked.codec, checked.shape, checked.numel) == (pb.CODEC_FP32, (3,), 3)
    with pytest.raises(InvalidArgument, match=NOT_FINITE):  # ... until they are decoded
        decode_fragment(data, [(3,)])
    with pytest.raises(InvalidArgument, match="checksum"):
        list(parse_fragment(data[:-1] + bytes([data[-1] ^ 1]), [(3,)]))
    nan_scale = _forged(torch.zeros(32), pb.CODEC_FP4_E2M1, bytes(16), b"\xff")
    with pytest.raises(InvalidArgument, match="NaN"):
        list(parse_fragment(nan_scale, [(32,)]))


def test_release_empties_the_callers_buffer_even_when_refused() -> None:
    data = bytearray(encode_fragment([torch.ones(4)], "fp32"))
    assert len(list(parse_fragment(data, [(4,)], release=True))) == 1
    assert len(data) == 0
    garbage = bytearray(b"\xff\xff\xff")
    with pytest.raises(InvalidArgument, match="not a valid EncodedFragment"):
        parse_fragment(garbage, [(4,)], release=True)
    assert len(garbage) == 0


def test_decode_of_a_message_and_of_a_fragment_agree() -> None:
    t = torch.randn(5, 7)
    for codec in CODECS:
        (from_fragment,) = decode_fragment(encode_fragment([t], codec), [(5, 7)])
        assert torch.equal(decode(encode(t, codec), (5, 7)), from_fragment)


def _views_equal(data: bytes, shapes) -> None:
    from_bytes = list(parse_fragment(data, shapes))
    from_view = list(parse_fragment_view(memoryview(bytearray(data)), shapes))
    assert [(t.codec, t.shape, bytes(t.payload), bytes(t.scales)) for t in from_view] == [
        (t.codec, t.shape, t.payload, t.scales) for t in from_bytes
    ]


@pytest.mark.parametrize("codec", CODECS)
def test_view_parser_reads_the_writers_bytes_in_place(codec: str) -> None:
    tensors = pinned_tensors()
    shapes = [tuple(t.shape) for t in tensors]
    data = encode_fragment(tensors, codec)
    _views_equal(data, shapes)
    buffer = memoryview(bytearray(data))
    checked = list(parse_fragment_view(buffer, shapes))
    if codec in ("fp32", "bf16", "fp4_e2m1", "fp4_e3m0"):  # sparse ones: protobuf's reading
        assert isinstance(checked[0].payload, memoryview)
        assert checked[0].payload.obj is buffer.obj


def test_view_parser_takes_other_encodings_as_protobuf_does() -> None:
    """Fields out of order, unpacked shapes, unknown fields: protobuf's reading, same words."""
    t = torch.randn(3, 5)
    msg = encode(t, "fp4_e2m1")
    reordered = (
        pb.EncodedTensor(crc32=msg.crc32).SerializeToString()
        + pb.EncodedTensor(scales=msg.scales, payload=msg.payload).SerializeToString()
        + bytes([0x10, 3, 0x10, 5])  # shape, unpacked
        + pb.EncodedTensor(codec=msg.codec).SerializeToString()
        + bytes([0x38, 1])  # an unknown field 7
    )
    data = b"\x0a" + bytes([len(reordered)]) + reordered
    _views_equal(data, [(3, 5)])
    for bad in (data[:-3], data + b"\x0a\x05ab", b"\xff" * 8, data[:1] + b"\x7f" + data[2:]):
        words = []
        for reader in (parse_fragment, lambda d, s: parse_fragment_view(memoryview(d), s)):
            with pytest.raises(InvalidArgument) as err:
                list(reader(bytearray(bad), [(3, 5)]))
            words.append(str(err.value))
        assert words[0] == words[1]
