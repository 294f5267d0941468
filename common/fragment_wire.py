"""The fragment wire format: its one writer and its one validating parser.

    parts = tensor_parts(codec, shape, payload, scales)  # one `tensors` entry, zero-copy
    for t in parse_fragment(data, shapes):               # checked, still in wire encoding
        ...                                               # decode, or read values in place

A fragment travels as a serialized `EncodedFragment`: one `EncodedTensor` per parameter, in
the fragment's order, all in one codec. A tensor is its codec, its shape, the payload (the
values: 4 bytes each for fp32, 2 for bf16, two 4-bit codes per byte for fp4), one E8M0 scale
byte per block of `FP4_BLOCK` values for fp4, and the CRC32 of payload then scales. Pulls of
4-bit updates send a `FragmentUpdates`: the logged fragments from a version on.

Every producer of these bytes goes through the writer here (the learner's push,
common/wire.py's encode_fragment; the server's snapshots, server/pull_parts.py; its logged
4-bit updates, server/fragment.py), and every consumer through the parser (common/codec.py's
decode, common/wire.py's decode_fragment and apply_updates, the server's push ingest,
server/ingest.py). The writer frames the payload and scales by hand in protobuf's encoding so
they pass through uncopied (a tensor's own bytes, a pull's shared snapshot); its bytes are
protobuf's own serialization of the same message (tests/unit/test_fragment_wire.py).

The parser checks everything but the values without decoding them: framing, tensor count, one
codec, shapes, lengths, checksum and NaN scale bytes, each with one message. The values
(finite) are checked by whoever reads them, with the words here (NOT_FINITE): codec.decode as
a whole, the ingest a chunk at a time into the round's sum.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from google.protobuf.message import DecodeError

from common.checksum import crc32
from common.errors import InvalidArgument
from common.generated.diloco.v1 import aggregator_pb2 as pb
from common.sparse_wire import (
    SPARSE_CODECS,
    check_k,
    check_scales,
    sparse_entries,
    sparse_sizes,
)

if TYPE_CHECKING:
    import torch

CODECS = {
    "fp32": pb.CODEC_FP32,
    "bf16": pb.CODEC_BF16,
    "fp4_e2m1": pb.CODEC_FP4_E2M1,
    "fp4_e3m0": pb.CODEC_FP4_E3M0,
    "sparse_2bit": pb.CODEC_SPARSE_2BIT,
    "sparse_fp4": pb.CODEC_SPARSE_FP4,
}
CODEC_NAMES = {value: name for name, value in CODECS.items()}
FP4_CODECS = (pb.CODEC_FP4_E2M1, pb.CODEC_FP4_E3M0)
FP4_BLOCK = 32  # values sharing one scale byte
E8M0_NAN = 255  # the scale byte that means NaN: never valid on the wire

# The refusals of bad values, in the words of every reader.
NOT_FINITE = "tensor holds NaN or infinite values"
NAN_SCALE = "FP4 block scale is NaN (E8M0 byte 255)"

_LENGTH_DELIMITED = 2


def encoded_sizes(codec: int, numel: int, sparse_k: int = 0) -> tuple[int, int]:
    """Exact (payload, scales) byte lengths of a tensor of `numel` elements in `codec`
    (sparse codecs: keeping `sparse_k` values per chunk, common/sparse_wire.py)."""
    if codec == pb.CODEC_FP32:
        return 4 * numel, 0
    if codec == pb.CODEC_BF16:
        return 2 * numel, 0
    if codec in FP4_CODECS:
        return (numel + 1) // 2, (numel + FP4_BLOCK - 1) // FP4_BLOCK
    if codec in SPARSE_CODECS:
        return sparse_sizes(codec, numel, sparse_k)
    raise InvalidArgument(f"unknown codec {codec}")


def tensor_crc32(payload: Part, scales: Part, sparse_k: int = 0) -> int:
    """The checksum a tensor carries: CRC32 of its payload followed by its scales, and for a
    sparse tensor its `sparse_k` (4 bytes, little-endian), which sizes and places them."""
    crc = crc32(_buffer(scales), crc32(_buffer(payload)))
    return crc32(sparse_k.to_bytes(4, "little"), crc) if sparse_k else crc


# ---- The writer --------------------------------------------------------------------------


class SharedBytes(Protocol):
    """Bytes passed through without a copy that are not a buffer themselves (a parameter's
    bytes read in place, server/pull_parts.TensorBytes): a length, slices, and the whole as
    a buffer for the checksum."""

    def __len__(self) -> int: ...

    def __getitem__(self, key: slice) -> bytes: ...

    def buffer(self) -> memoryview | bytes: ...


# A piece of serialized output: bytes, a memoryview of a byte buffer, or SharedBytes.
Part = bytes | memoryview | SharedBytes


def tensor_parts(
    codec: int, shape: Sequence[int], payload: Part, scales: Part, sparse_k: int = 0
) -> list[Part]:
    """One `tensors` entry of a serialized EncodedFragment, with its field tag, as
    [framing, payload, framing, scales, framing]: payload and scales pass through uncopied."""
    head, middle, tail = _tensor_framing(codec, shape, payload, scales, sparse_k)
    size = len(head) + _nbytes(payload) + len(middle) + _nbytes(scales) + len(tail)
    return [_field_header(1, size) + head, payload, middle, scales, tail]


def fragment_parts(tensors: Iterable[tuple]) -> list[Part]:
    """A serialized EncodedFragment of (codec, shape, payload, scales[, sparse_k]) tensors,
    in parts whose concatenation is the message (tensor_parts, one after the other)."""
    return [part for tensor in tensors for part in tensor_parts(*tensor)]


def tensor_message(
    codec: int, shape: Sequence[int], payload: Part, scales: Part, sparse_k: int = 0
) -> pb.EncodedTensor:
    """One EncodedTensor message, read back from the writer's own bytes (one writer)."""
    head, middle, tail = _tensor_framing(codec, shape, payload, scales, sparse_k)
    body = b"".join((head, _buffer(payload), middle, _buffer(scales), tail))
    return pb.EncodedTensor.FromString(body)


def chain_parts(from_version: int, updates: Iterable[bytes]) -> tuple[bytes, ...]:
    """The serialized FragmentUpdates(from_version, updates) in parts, each update being the
    bytes of a serialized EncodedFragment (shared, not copied)."""
    parts = [pb.FragmentUpdates(from_version=from_version).SerializeToString()]
    for data in updates:
        parts += (_field_header(2, len(data)), data)
    return tuple(part for part in parts if part)


def _tensor_framing(
    codec: int, shape: Sequence[int], payload: Part, scales: Part, sparse_k: int = 0
) -> tuple[bytes, bytes, bytes]:
    """The EncodedTensor bytes before the payload, between payload and scales, and after the
    scales. Fields go in number order (codec, shape | payload | scales | crc32, sparse_k)
    and empty ones are left out, as protobuf serializes them."""
    n_payload, n_scales = _nbytes(payload), _nbytes(scales)
    head = pb.EncodedTensor(codec=codec, shape=list(shape)).SerializeToString()
    if n_payload:
        head += _field_header(3, n_payload)
    middle = _field_header(4, n_scales) if n_scales else b""
    crc = tensor_crc32(payload, scales, sparse_k)
    tail = pb.EncodedTensor(crc32=crc, sparse_k=sparse_k).SerializeToString()
    return head, middle, tail


def _buffer(part: Part) -> memoryview | bytes:
    return part if isinstance(part, (bytes, memoryview)) else part.buffer()


def _nbytes(part: Part) -> int:
    return memoryview(_buffer(part)).nbytes


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


# ---- The parser --------------------------------------------------------------------------


@dataclass(frozen=True)
class WireTensor:
    """One tensor whose shape, lengths, checksum and scale bytes are checked; its values are
    still in their wire encoding (not yet known to be finite)."""

    codec: int
    shape: tuple[int, ...]
    numel: int
    payload: bytes
    scales: bytes
    sparse_k: int = 0
    # Sparse codecs: the kept entries' flat positions (int64) and float32 values, checked
    # (common/sparse_wire.py); their size is in proportion to the payload's.
    entries: tuple[torch.Tensor, torch.Tensor] | None = None


def check_tensor(msg: pb.EncodedTensor, expected_shape: Sequence[int] | None = None) -> WireTensor:
    """Check a tensor's header, lengths, checksum and scale bytes, decoding nothing and
    allocating nothing in proportion to the size it claims; raises InvalidArgument."""
    shape = tuple(msg.shape)
    if any(dim < 0 for dim in shape):
        raise InvalidArgument(f"negative dimension in shape {shape}")
    if expected_shape is not None and shape != tuple(expected_shape):
        raise InvalidArgument(f"shape {shape} does not match expected {tuple(expected_shape)}")
    numel = math.prod(shape)
    check_k(msg.codec, msg.sparse_k)
    payload_len, scales_len = encoded_sizes(msg.codec, numel, msg.sparse_k)
    payload, scales = msg.payload, msg.scales  # each read copies out of the message: once
    if len(payload) != payload_len or len(scales) != scales_len:
        raise InvalidArgument(
            f"{CODEC_NAMES.get(msg.codec)} tensor of shape {shape} needs {payload_len} payload "
            f"and {scales_len} scale bytes, got {len(payload)} and {len(scales)}"
        )
    if tensor_crc32(payload, scales, msg.sparse_k) != msg.crc32:
        raise InvalidArgument("tensor checksum mismatch")
    if msg.codec in SPARSE_CODECS:
        check_scales(msg.codec, scales)
        entries = sparse_entries(msg.codec, payload, scales, numel, msg.sparse_k)
        return WireTensor(msg.codec, shape, numel, payload, scales, msg.sparse_k, entries)
    if E8M0_NAN in scales:
        raise InvalidArgument(NAN_SCALE)
    return WireTensor(msg.codec, shape, numel, payload, scales)


def parse_fragment(
    data: bytes | bytearray, shapes: Sequence[Sequence[int]], release: bool = False
) -> Iterator[WireTensor]:
    """The checked tensors of a serialized EncodedFragment with these shapes; raises
    InvalidArgument. See check_fragment for when each check is made.

    With `release`, a bytearray `data` is emptied once protobuf has parsed (copied) it, so a
    caller's reference does not keep a second copy of the payload alive."""
    try:
        msg = pb.EncodedFragment.FromString(data)
    except DecodeError as err:
        raise InvalidArgument(f"fragment payload is not a valid EncodedFragment: {err}") from err
    finally:
        if release and isinstance(data, bytearray):
            data.clear()
    return check_fragment(msg, shapes)


def check_fragment(
    msg: pb.EncodedFragment, shapes: Sequence[Sequence[int]]
) -> Iterator[WireTensor]:
    """The tensor count and codec are checked now; each tensor (check_tensor) when the
    iterator reaches it. A reader that checks a tensor's values before taking the next one
    thus refuses a payload for its first fault in payload order, as every reader does."""
    if len(msg.tensors) != len(shapes):
        raise InvalidArgument(f"fragment has {len(msg.tensors)} tensors, expected {len(shapes)}")
    if len({t.codec for t in msg.tensors}) > 1:
        raise InvalidArgument("all tensors of a fragment must use one codec")
    return (check_tensor(t, shape) for t, shape in zip(msg.tensors, shapes, strict=True))


def parse_updates(data: bytes, have_version: int) -> list[pb.EncodedFragment]:
    """The fragments of a serialized FragmentUpdates that starts at `have_version` (each to
    be checked with check_fragment); raises InvalidArgument."""
    try:
        chain = pb.FragmentUpdates.FromString(data)
    except DecodeError as err:
        raise InvalidArgument(f"update chain is not a valid FragmentUpdates: {err}") from err
    if chain.from_version != have_version:
        raise InvalidArgument(
            f"update chain starts at version {chain.from_version}, replica is at {have_version}"
        )
    return list(chain.updates)
