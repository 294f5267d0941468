"""Fragments on the wire: chunking, size limits, and refusal of malformed payloads."""

import pytest
import torch

from common.codec.fragment import (
    chunks,
    decode_fragment,
    encode_fragment,
    max_fragment_bytes,
    params_crc32,
)
from common.errors import InvalidArgument
from common.generated.diloco.v1 import aggregator_pb2 as pb

SHAPES = [(3, 4), (70,)]


def fragment() -> list[torch.Tensor]:
    return [torch.randn(s) for s in SHAPES]


@pytest.mark.parametrize("codec", ["fp32", "bf16", "fp4_e2m1"])
def test_fragment_round_trip_through_chunks(codec: str) -> None:
    tensors = fragment()
    data = encode_fragment(tensors, codec)
    assert len(data) <= max_fragment_bytes(SHAPES, pb.CODEC_FP32)
    pieces = list(chunks(data, size=7))
    assert all(len(p) <= 7 for p in pieces)
    decoded = decode_fragment(b"".join(pieces), SHAPES)
    if codec == "fp32":
        assert all(torch.equal(a, b) for a, b in zip(tensors, decoded, strict=True))
    assert [tuple(t.shape) for t in decoded] == SHAPES


def test_decode_fragment_rejects_garbage_wrong_count_and_mixed_codecs() -> None:
    with pytest.raises(InvalidArgument, match="not a valid EncodedFragment"):
        decode_fragment(b"\xff\xff\xff", SHAPES)
    with pytest.raises(InvalidArgument, match="1 tensors, expected 2"):
        decode_fragment(encode_fragment([torch.zeros(3, 4)], "fp32"), SHAPES)
    tensors = fragment()
    mixed = pb.EncodedFragment.FromString(encode_fragment(tensors, "fp32"))
    mixed.tensors[1].CopyFrom(
        pb.EncodedFragment.FromString(encode_fragment(tensors, "bf16")).tensors[1]
    )
    with pytest.raises(InvalidArgument, match="one codec"):
        decode_fragment(mixed.SerializeToString(), SHAPES)


def test_params_crc32_sees_a_single_bit() -> None:
    tensors = fragment()
    flipped = [t.clone() for t in tensors]
    flipped[1].view(torch.int32)[5] ^= 1
    assert params_crc32(tensors) != params_crc32(flipped)
    assert params_crc32(tensors) == params_crc32([t.clone() for t in tensors])
