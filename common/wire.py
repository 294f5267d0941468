"""Fragments on the wire: a list of tensors <-> one serialized EncodedFragment, in chunks.

A fragment's tensors travel as one serialized `EncodedFragment` message, cut into chunks of
at most `CHUNK_BYTES` so that gRPC never has to hold a large message at once. The receiver
checks the announced size against the most the fragment can take before it buffers anything.
The bytes are written and checked by common/fragment_wire.py, the values encoded and decoded
by common/codec.py; here they meet, a tensor at a time.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from common.checksum import crc32
from common.codec import codec_id, decode_values, encode_values
from common.fragment_wire import (
    WireTensor,
    check_fragment,
    encoded_sizes,
    fragment_parts,
    parse_fragment,
    parse_updates,
)
from common.sparse import DEFAULT_TOPK_FRACTION, fragment_with_feedback, topk_k
from common.sparse_wire import SPARSE_CODECS

CHUNK_BYTES = 1 << 20
DEFAULT_SPARSE_K = topk_k(DEFAULT_TOPK_FRACTION)
# Per-tensor protobuf framing (tags, lengths, codec, shape, crc) stays far below this.
_FRAMING_BYTES_PER_TENSOR = 64


def encode_fragment(
    tensors: Sequence[torch.Tensor], codec: str | int, sparse_k: int = DEFAULT_SPARSE_K
) -> bytes:
    """Serialize the tensors of one fragment with `codec` (a sparse one keeping `sparse_k`
    values per chunk, without error feedback: common.sparse.fragment_with_feedback keeps the
    residual); raises ValueError on non-finite values."""
    codec = codec_id(codec) if isinstance(codec, str) else codec
    if codec in SPARSE_CODECS:
        residuals = [torch.zeros(t.shape, device=t.device) for t in tensors]
        return fragment_with_feedback(tensors, codec, sparse_k, residuals)
    encoded = [(codec, t.shape, *encode_values(t, codec)) for t in tensors]
    return b"".join(fragment_parts(encoded))


def max_fragment_bytes(shapes: Sequence[tuple[int, ...]], codec: int) -> int:
    """An upper bound on the serialized size of a fragment with these shapes and codec."""
    total = 0
    for shape in shapes:
        numel = 1
        for dim in shape:
            numel *= dim
        payload, scales = encoded_sizes(codec, numel)
        total += payload + scales + _FRAMING_BYTES_PER_TENSOR + 11 * len(shape)
    return total


def decode_fragment(data: bytes, shapes: Sequence[tuple[int, ...]]) -> list[torch.Tensor]:
    """Parse and decode a fragment, checking the tensor count, every shape and every value;
    raises InvalidArgument."""
    return [decode_values(t) for t in parse_fragment(data, shapes)]


def chunks(data: bytes, size: int = CHUNK_BYTES) -> Iterator[bytes]:
    """Split `data` into pieces of at most `size` bytes (none for empty data)."""
    for start in range(0, len(data), size):
        yield data[start : start + size]


def params_crc32(tensors: Sequence[torch.Tensor]) -> int:
    """Checksum of the float32 bytes of `tensors`, to check that a replica is bit-identical."""
    crc = 0
    for t in tensors:
        # crc32 reads the array's buffer in place: no bytes copy of the parameters.
        crc = crc32(t.detach().to("cpu", torch.float32).contiguous().numpy(), crc)
    return crc


def apply_updates(params: Sequence[torch.Tensor], data: bytes, have_version: int) -> int:
    """Apply a serialized FragmentUpdates chain to a replica in place; returns the new version.

    Every update is decoded and checked before the first one is applied, so a bad chain
    leaves the replica untouched. The additions are the server's own (θ += decode(update)).
    Sparse updates are checked whole by the parser and expanded to float32 one at a time as
    they are added, so a long chain costs its kept entries, not a model copy per update.
    """
    shapes = [tuple(p.shape) for p in params]
    checked = [
        [t if t.entries is not None else decode_values(t) for t in check_fragment(update, shapes)]
        for update in parse_updates(data, have_version)
    ]
    for update in checked:
        for p, q in zip(params, update, strict=True):
            p.add_(decode_values(q) if isinstance(q, WireTensor) else q)
    return have_version + len(checked)
