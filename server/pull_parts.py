"""Pull answers as lists of shared byte strings whose concatenation is the serialized message.

    parts = snapshot_parts(params)                  # == encode_fragment(params, "fp32")
    parts = chain_parts(have_version, logged)       # == FragmentUpdates(...).SerializeToString()

Why: the server answers every pull of a version with the same bytes. Serializing a whole
message per answer cost, for each snapshot, about four model-sized buffers (the tensors'
bytes, their copies inside the EncodedTensor messages, the merged EncodedFragment and its
serialization), and for each update chain one buffer of up to a snapshot's size per pull.
Those large short-lived buffers, made by many RPC threads at once, fragmented the glibc heap
until the server's RSS grew with the number of learners (bench/load.py, 4 MiB model: 0.7 GB
at 64 learners with about 0.16 GB of live heap). Here the big pieces (each tensor's float32
bytes, each logged update) are made once and shared; the framing around them is a few bytes
written by hand in protobuf's wire format. tests/unit/test_pull_parts.py holds the result
byte-equal to protobuf's own serialization.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from common.checksum import crc32
from common.generated.diloco.v1 import aggregator_pb2 as pb

_LENGTH_DELIMITED = 2


def snapshot_parts(params: Sequence[torch.Tensor]) -> tuple[bytes, ...]:
    """The serialized fp32 EncodedFragment of `params` (encode_fragment's bytes), in parts;
    one copy of the parameters' bytes, nothing else of their size. Raises ValueError for a
    non-finite value, as common.codec.encode does."""
    parts: list[bytes] = []
    for t in params:
        flat = t.detach().reshape(-1).to(torch.float32)
        if not bool(torch.isfinite(flat).all()):
            raise ValueError("cannot encode a tensor with NaN or infinite values")
        payload = flat.cpu().numpy().tobytes()
        # EncodedTensor fields in number order: codec, shape | payload | scales (none), crc32.
        head = pb.EncodedTensor(codec=pb.CODEC_FP32, shape=list(t.shape)).SerializeToString()
        if payload:
            head += _field_header(3, len(payload))
        tail = pb.EncodedTensor(crc32=crc32(b"", crc32(payload))).SerializeToString()
        size = len(head) + len(payload) + len(tail)
        parts += (_field_header(1, size) + head, payload, tail)
    return tuple(part for part in parts if part)


def chain_parts(have_version: int, updates: Iterable[bytes]) -> tuple[bytes, ...]:
    """The serialized FragmentUpdates(from_version=have_version, updates=...) in parts, each
    update being the logged bytes of a serialized EncodedFragment (shared, not copied)."""
    parts = [pb.FragmentUpdates(from_version=have_version).SerializeToString()]
    for data in updates:
        parts += (_field_header(2, len(data)), data)
    return tuple(part for part in parts if part)


def _field_header(field_number: int, length: int) -> bytes:
    """Tag and length of a length-delimited field."""
    return _varint(field_number << 3 | _LENGTH_DELIMITED) + _varint(length)


def _varint(value: int) -> bytes:
    """Protobuf's base-128 varint of a non-negative int."""
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)
