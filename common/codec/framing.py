"""The wire bytes that are written and read by hand: the one module that knows protobuf's
encoding. Everything else goes through the protobuf library (common/codec/tensor.py).

    parts = tensor_parts(codec, shape, payload, scales)  # one `tensors` entry, zero-copy
    fields = scan_fragment(view)                         # tensors as views of `view`, or None
    message = parse_push_request(data)                   # a chunk as a view, or the message

Three pieces, each kept because bench/wire.py measures it against the library beside it
(docs/RESULTS.md, "Wire codec: hand-written framing against protobuf"):

- The writer frames a tensor's payload and scales (tag and length) around their own bytes,
  so a push's encoding, a pull's shared snapshot (the parameters read in place) and a logged
  update pass through uncopied; protobuf's serializer copies each bytes field into the
  message and the message into its serialization. Its bytes are protobuf's own
  serialization of the same message (tests/unit/test_fragment_wire.py).
- The scanner reads a serialized EncodedFragment in the writer's layout (fields in number
  order, each once, no unknown ones, shapes packed) as views of a push's receive buffer;
  anything else returns None and goes to protobuf's parser, so what is accepted and refused
  stays protobuf's rule.
- A PushFragment chunk message (field 2, length-delimited, nothing else) is recognised by
  its first bytes and its length adding up, and read as a view; anything else goes to
  protobuf's parser.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from common.checksum import crc32
from common.generated.diloco.v1 import aggregator_pb2 as pb

_LENGTH_DELIMITED = 2
# Field 2 (`chunk`) of PushFragmentRequest with wire type 2 (length-delimited).
CHUNK_TAG = (2 << 3) | _LENGTH_DELIMITED
# protobuf refuses a length longer than this encoding or this value: those go to its parser.
_MAX_LENGTH_BYTES, _MAX_LENGTH = 5, (1 << 31) - 1


# ---- The writer --------------------------------------------------------------------------


class SharedBytes(Protocol):
    """Bytes passed through without a copy that are not a buffer themselves (a parameter's
    bytes read in place, common/codec/fragment.py's TensorBytes): a length, slices, and the whole as
    a buffer for the checksum."""

    def __len__(self) -> int: ...

    def __getitem__(self, key: slice) -> bytes: ...

    def buffer(self) -> memoryview | bytes: ...


# A piece of serialized output: bytes, a memoryview of a byte buffer, or SharedBytes.
Part = bytes | memoryview | SharedBytes


def tensor_crc32(payload: Part, scales: Part, sparse_k: int = 0) -> int:
    """The checksum a tensor carries: CRC32 of its payload followed by its scales, and for a
    sparse tensor its `sparse_k` (4 bytes, little-endian), which sizes and places them."""
    crc = crc32(_buffer(scales), crc32(_buffer(payload)))
    return crc32(sparse_k.to_bytes(4, "little"), crc) if sparse_k else crc


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


def chain_parts(from_version: int, updates: Iterable[bytes]) -> tuple[bytes, ...]:
    """The serialized FragmentUpdates(from_version, updates) in parts, each update being the
    bytes of a serialized EncodedFragment (shared, not copied)."""
    parts = [pb.FragmentUpdates(from_version=from_version).SerializeToString()]
    for data in updates:
        parts += (_field_header(2, len(data)), data)
    return tuple(part for part in parts if part)


def tensor_message(
    codec: int, shape: Sequence[int], payload: Part, scales: Part, sparse_k: int = 0
) -> pb.EncodedTensor:
    """One EncodedTensor message, read back from the writer's own bytes (one writer)."""
    head, middle, tail = _tensor_framing(codec, shape, payload, scales, sparse_k)
    body = b"".join((head, _buffer(payload), middle, _buffer(scales), tail))
    return pb.EncodedTensor.FromString(body)


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


# ---- The readers -------------------------------------------------------------------------


# (codec, shape, payload, scales, crc32) of one EncodedTensor, as tensor.py checks them.
_Fields = tuple[int, tuple[int, ...], memoryview, memoryview, int]


def scan_fragment(data: memoryview) -> list[_Fields] | None:
    """The tensors of a serialized EncodedFragment in the writer's layout, as views of
    `data`; None for anything else (another valid encoding, or not a message at all)."""
    tensors, pos, end = [], 0, len(data)
    while pos < end:
        tag, pos = _read_varint(data, pos)
        if tag != (1 << 3 | _LENGTH_DELIMITED) or pos < 0:
            return None
        size, pos = _read_varint(data, pos)
        if pos < 0 or pos + size > end:
            return None
        fields = _scan_tensor(data[pos : pos + size])
        if fields is None:
            return None
        tensors.append(fields)
        pos += size
    return tensors


def _scan_tensor(data: memoryview) -> _Fields | None:
    codec, shape, crc, empty = 0, (), 0, data[:0]
    payload = scales = empty
    pos, end, last = 0, len(data), 0
    while pos < end:
        tag, pos = _read_varint(data, pos)
        number, kind = tag >> 3, tag & 7
        if pos < 0 or number <= last or number > 5:
            return None  # out of order, repeated, unknown or malformed
        last = number
        if number in (1, 5):
            if kind != 0:
                return None
            value, pos = _read_varint(data, pos)
            # protobuf truncates a larger varint to the field's width: leave that to it.
            if pos < 0 or value >= (1 << 31 if number == 1 else 1 << 32):
                return None
            codec, crc = (value, crc) if number == 1 else (codec, value)
            continue
        if kind != _LENGTH_DELIMITED:
            return None
        size, pos = _read_varint(data, pos)
        if pos < 0 or pos + size > end:
            return None
        value_bytes, pos = data[pos : pos + size], pos + size
        if number == 2:
            shape = _packed_int64(value_bytes)
            if shape is None:
                return None
        elif number == 3:
            payload = value_bytes
        else:
            scales = value_bytes
    return codec, shape, payload, scales, crc


def _packed_int64(data: memoryview) -> tuple[int, ...] | None:
    values, pos = [], 0
    while pos < len(data):
        value, pos = _read_varint(data, pos)
        if pos < 0:
            return None
        values.append(value - (1 << 64) if value >= 1 << 63 else value)
    return tuple(values)


def _read_varint(data: memoryview, pos: int) -> tuple[int, int]:
    """(value, position after it); position -1 for a truncated or over-long varint."""
    value, shift = 0, 0
    while pos < len(data) and shift < 64:
        byte = data[pos]
        value |= (byte & 0x7F) << shift
        pos += 1
        if byte < 0x80:
            return (value, pos) if value < 1 << 64 else (0, -1)
        shift += 7
    return 0, -1


def parse_push_request(data: bytes) -> pb.PushFragmentRequest | memoryview:
    """A serialized PushFragmentRequest: the chunk's bytes as a view of `data` when the
    message is exactly one chunk field, else the message as protobuf parses it."""
    if len(data) > 1 and data[0] == CHUNK_TAG:
        length, offset = _read_varint(data, 1)
        short = 0 < offset <= 1 + _MAX_LENGTH_BYTES
        if short and length <= _MAX_LENGTH and offset + length == len(data):
            return memoryview(data)[offset:]
    return pb.PushFragmentRequest.FromString(data)
