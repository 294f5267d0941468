"""One tensor on the wire: the codecs' names and sizes, the validating parser that every
reader uses, and the encode and decode of a tensor's values.

    wire = encode(torch.randn(3, 100), "fp4_e2m1")       # an EncodedTensor message
    approx = decode(wire)                                 # float32, shape (3, 100)
    for t in parse_fragment(data, shapes):                # checked, still in wire encoding
        ...                                               # decode, or read values in place

A fragment travels as a serialized `EncodedFragment`: one `EncodedTensor` per parameter, in
the fragment's order, all in one codec. A tensor is its codec, its shape, the payload (the
values: 4 bytes each for fp32, 2 for bf16, two 4-bit codes per byte for fp4, kept entries for
the sparse codecs), the scale bytes (fp4: one E8M0 byte per block of 32 values; sparse: per
chunk), the CRC32 of payload then scales (and a sparse tensor's `sparse_k`), and `sparse_k`.
Pulls of 4-bit or sparse updates send a `FragmentUpdates`: the logged fragments from a
version on. The values' formats are common/codec/fp4.py's and common/codec/sparse.py's.

Every consumer reads through the parser here (decode, the learner's replicas, the server's
push ingest), which checks everything but the values without decoding them: framing, tensor
count, one codec, shapes, lengths, checksum and scale bytes, each with one message, and
allocates nothing in proportion to the size a sender claims. The values (finite) are checked
by whoever reads them, with fp4.NOT_FINITE's words: decode as a whole, the server's ingest a
chunk at a time into the round's sum. protobuf parses the messages; a push's payload in the
writer's own layout is read in place instead (framing.scan_fragment), and both accept and
refuse the same payloads with the same words (tests/unit/test_fragment_wire.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from google.protobuf.message import DecodeError

from common.codec.fp4 import (
    BF16_MAX,
    E8M0_NAN,
    FP4_BLOCK,
    FP4_GRIDS,
    NAN_SCALE,
    NOT_FINITE,
    ROUNDINGS,
    all_finite,
    dequantize_fp4,
    quantize_fp4,
)
from common.codec.framing import scan_fragment, tensor_crc32, tensor_message
from common.codec.sparse import (
    SPARSE_CODECS,
    check_k,
    check_scales,
    dense,
    encode_sparse,
    sparse_entries,
    sparse_sizes,
)
from common.errors import InvalidArgument
from common.generated.diloco.v1 import aggregator_pb2 as pb

CODECS = {
    "fp32": pb.CODEC_FP32,
    "bf16": pb.CODEC_BF16,
    "fp4_e2m1": pb.CODEC_FP4_E2M1,
    "fp4_e3m0": pb.CODEC_FP4_E3M0,
    "sparse_2bit": pb.CODEC_SPARSE_2BIT,
}
CODEC_NAMES = {value: name for name, value in CODECS.items()}
FP4_CODECS = (pb.CODEC_FP4_E2M1, pb.CODEC_FP4_E3M0)


def codec_id(name: str) -> int:
    """The wire enum of a codec name; raises ValueError naming the valid choices."""
    if name not in CODECS:
        raise ValueError(f"unknown codec {name!r}; choose one of {', '.join(CODECS)}")
    return CODECS[name]


def is_sparse(name: str) -> bool:
    """Whether the codec name is one of the top-k sparse codecs (False for unknown names)."""
    return name in CODECS and CODECS[name] in SPARSE_CODECS


def encoded_sizes(codec: int, numel: int, sparse_k: int = 0) -> tuple[int, int]:
    """Exact (payload, scales) byte lengths of a tensor of `numel` elements in `codec`
    (sparse codecs: keeping `sparse_k` values per chunk, sparse.py)."""
    if codec == pb.CODEC_FP32:
        return 4 * numel, 0
    if codec == pb.CODEC_BF16:
        return 2 * numel, 0
    if codec in FP4_CODECS:
        return (numel + 1) // 2, (numel + FP4_BLOCK - 1) // FP4_BLOCK
    if codec in SPARSE_CODECS:
        return sparse_sizes(codec, numel, sparse_k)
    raise InvalidArgument(f"unknown codec {codec}")


# ---- The parser --------------------------------------------------------------------------


@dataclass(frozen=True)
class WireTensor:
    """One tensor whose shape, lengths, checksum and scale bytes are checked; its values are
    still in their wire encoding (not yet known to be finite). `payload` and `scales` are
    bytes, or views of the buffer a push was received into (parse_fragment_view)."""

    codec: int
    shape: tuple[int, ...]
    numel: int
    payload: bytes | memoryview
    scales: bytes | memoryview
    sparse_k: int = 0
    # Sparse codecs: the kept entries' flat positions (int64) and float32 values, checked
    # (sparse.py); their size is in proportion to the payload's.
    entries: tuple[torch.Tensor, torch.Tensor] | None = None


def check_tensor(msg: pb.EncodedTensor, expected_shape: Sequence[int] | None = None) -> WireTensor:
    """Check a tensor's header, lengths, checksum and scale bytes, decoding nothing and
    allocating nothing in proportion to the size it claims; raises InvalidArgument."""
    # Each read of payload or scales copies out of the message: once.
    fields = (msg.codec, tuple(msg.shape), msg.payload, msg.scales, msg.crc32, msg.sparse_k)
    return _check_fields(*fields, expected_shape)


def _check_fields(
    codec: int,
    shape: tuple[int, ...],
    payload: bytes | memoryview,
    scales: bytes | memoryview,
    crc: int,
    sparse_k: int,
    expected_shape: Sequence[int] | None,
) -> WireTensor:
    if any(dim < 0 for dim in shape):
        raise InvalidArgument(f"negative dimension in shape {shape}")
    if expected_shape is not None and shape != tuple(expected_shape):
        raise InvalidArgument(f"shape {shape} does not match expected {tuple(expected_shape)}")
    numel = math.prod(shape)
    check_k(codec, sparse_k)
    payload_len, scales_len = encoded_sizes(codec, numel, sparse_k)
    if len(payload) != payload_len or len(scales) != scales_len:
        raise InvalidArgument(
            f"{CODEC_NAMES.get(codec)} tensor of shape {shape} needs {payload_len} payload "
            f"and {scales_len} scale bytes, got {len(payload)} and {len(scales)}"
        )
    if tensor_crc32(payload, scales, sparse_k) != crc:
        raise InvalidArgument("tensor checksum mismatch")
    if codec in SPARSE_CODECS:
        payload, scales = bytes(payload), bytes(scales)  # small: a fraction of the values
        check_scales(scales)
        entries = sparse_entries(codec, payload, scales, numel, sparse_k)
        return WireTensor(codec, shape, numel, payload, scales, sparse_k, entries)
    if _has_nan_scale(scales):
        raise InvalidArgument(NAN_SCALE)
    return WireTensor(codec, shape, numel, payload, scales)


def _has_nan_scale(scales: bytes | memoryview) -> bool:
    if isinstance(scales, bytes):
        return E8M0_NAN in scales  # memchr
    # 255 is the largest byte: a view holds it exactly when that is its maximum.
    return len(scales) > 0 and int(np.frombuffer(scales, dtype=np.uint8).max()) == E8M0_NAN


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


def parse_fragment_view(data: memoryview, shapes: Sequence[Sequence[int]]) -> Iterator[WireTensor]:
    """parse_fragment without a copy: the tensors' payloads and scales are views of `data`
    (valid while it is). Reads the writer's own layout (fields in number order, each once,
    no unknown ones, shapes packed); any other valid protobuf encoding of the message goes
    through protobuf as parse_fragment, so both accept and refuse the same payloads with the
    same words (tests/unit/test_fragment_wire.py)."""
    tensors = scan_fragment(data)
    if tensors is None:
        return parse_fragment(bytes(data), shapes)
    if len(tensors) != len(shapes):
        raise InvalidArgument(f"fragment has {len(tensors)} tensors, expected {len(shapes)}")
    if len({fields[0] for fields in tensors}) > 1:
        raise InvalidArgument("all tensors of a fragment must use one codec")
    return (_check_fields(*fields, 0, shape) for fields, shape in zip(tensors, shapes, strict=True))


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


# ---- Values ------------------------------------------------------------------------------


def encode(
    tensor: torch.Tensor,
    codec: str | int,
    rounding: str = "nearest",
    generator: torch.Generator | None = None,
    sparse_k: int = 64,
) -> pb.EncodedTensor:
    """Encode a floating-point tensor of any shape; raises ValueError on non-finite values.

    `rounding` applies to the 4-bit codecs; "stochastic" draws from `generator`. The sparse
    codecs keep `sparse_k` values of every chunk of 4096 (no error feedback here).
    """
    codec = codec_id(codec) if isinstance(codec, str) else codec
    if codec in SPARSE_CODECS:
        flat = tensor.detach().reshape(-1).to(torch.float32)
        if not all_finite(flat):
            raise ValueError("cannot encode a tensor with NaN or infinite values")
        enc = encode_sparse(flat, codec, sparse_k)
        payload, scales = _host_bytes(enc.payload()), _host_bytes(enc.scales)
        return tensor_message(codec, tensor.shape, payload, scales, sparse_k)
    payload, scales = encode_values(tensor, codec, rounding, generator)
    return tensor_message(codec, tensor.shape, payload, scales)


def encode_values(
    tensor: torch.Tensor,
    codec: int,
    rounding: str = "nearest",
    generator: torch.Generator | None = None,
) -> tuple[memoryview, memoryview]:
    """The (payload, scales) wire bytes of a tensor's values in `codec`, as encode makes them;
    raises ValueError on non-finite values. The buffers may be the tensor's own memory: use
    them before the tensor changes."""
    flat = tensor.detach().reshape(-1).to(torch.float32)
    if not all_finite(flat):
        raise ValueError("cannot encode a tensor with NaN or infinite values")
    if codec == pb.CODEC_FP32:
        return _host_bytes(flat), memoryview(b"")
    if codec == pb.CODEC_BF16:
        # Saturate: float32 values above bfloat16's largest would round to infinity.
        rounded = flat.clamp(-BF16_MAX, BF16_MAX).to(torch.bfloat16)
        # bfloat16 has no numpy dtype: reinterpret the rounded bits as int16 to serialize.
        return _host_bytes(rounded.view(torch.int16)), memoryview(b"")
    if codec in FP4_GRIDS:
        if rounding not in ROUNDINGS:
            raise ValueError(f"rounding must be one of {', '.join(ROUNDINGS)}, got {rounding!r}")
        packed, scale_bytes = quantize_fp4(flat, codec, rounding == "stochastic", generator)
        return _host_bytes(packed), _host_bytes(scale_bytes)
    if codec in SPARSE_CODECS:
        raise ValueError("sparse codecs are encoded whole: use encode, or common.codec.sparse")
    raise ValueError(f"unknown codec {codec}")


def _host_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a 1-D tensor, read in place where it is a contiguous CPU tensor already."""
    return memoryview(tensor.cpu().contiguous().numpy()).cast("B")


def decode(
    msg: pb.EncodedTensor,
    expected_shape: tuple[int, ...] | None = None,
    device: str | torch.device = "cpu",
) -> torch.Tensor:
    """Decode to float32 on `device` after checking codec, shape, lengths, checksum and scales
    (check_tensor) and then the values.

    Raises InvalidArgument (nothing allocated in proportion to the claimed size) when any
    field is inconsistent, so a decoder fed garbage fails cleanly.
    """
    return decode_values(check_tensor(msg, expected_shape), device)


def decode_values(tensor: WireTensor, device: str | torch.device = "cpu") -> torch.Tensor:
    """The float32 values of a checked tensor, on `device`, in its shape; raises
    InvalidArgument when one is not finite."""
    shape, numel = tensor.shape, tensor.numel
    if numel == 0:
        return torch.zeros(shape, dtype=torch.float32, device=device)
    if tensor.codec == pb.CODEC_FP32:
        flat = torch.frombuffer(bytearray(tensor.payload), dtype=torch.float32).to(device)
    elif tensor.codec == pb.CODEC_BF16:
        raw = torch.frombuffer(bytearray(tensor.payload), dtype=torch.bfloat16)
        flat = raw.to(device).float()
    elif tensor.entries is not None:  # sparse: the parser checked and decoded the entries
        positions, values = tensor.entries
        return dense(positions, values.to(device), numel).reshape(shape)
    else:
        packed = torch.frombuffer(bytearray(tensor.payload), dtype=torch.uint8).to(device)
        scales = torch.frombuffer(bytearray(tensor.scales), dtype=torch.uint8).to(device)
        flat = dequantize_fp4(packed, scales, numel, tensor.codec)
        return flat.reshape(shape)  # dequantize_fp4 has checked the values are finite
    if not all_finite(flat):
        raise InvalidArgument(NOT_FINITE)
    return flat.reshape(shape)
