"""A fragment on the wire: its tensors <-> one serialized EncodedFragment, the chain of
updates a replica applies, and the server's shared answers.

    payload = encode_fragment(tensors, "fp4_e2m1")       # a push (learner)
    tensors = decode_fragment(payload, shapes)           # checked, every value finite
    version = apply_updates(replica, chain, version)     # a pulled chain of 4-bit updates
    parts = snapshot_parts(params)                       # the server's fp32 answer, shared

A fragment's tensors travel as one serialized `EncodedFragment`, cut into chunks of at most
`CHUNK_BYTES` so that gRPC never holds a large message at once; the receiver checks the
announced size against the most the fragment can take (max_fragment_bytes) before it buffers
anything. Tensors are checked by tensor.py's parser and framed by framing.py's writer.

The server answers every pull of a version with the same bytes: its snapshot's big parts are
TensorBytes, the parameters' bytes read in place (copied whole only if the parameters change
while a pull still streams them), and a chain is the logged updates' own bytes with a few
bytes of framing. Serializing a message per answer instead made the server's RSS grow with
the number of learners (bench/load.py, 4 MiB model: 0.7 GB at 64 learners with about
0.16 GB of live heap). An outer update is encoded a chunk at a time (UpdateEncoder) so that
the server never holds a model-sized temporary; the bytes of a chunk are the bytes of that
range of the whole tensor's encoding (fp4 blocks of 32 values, sparse chunks of 4096 whose
indices and codes end on byte boundaries every 32 chunks: ALIGN_VALUES).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator, Sequence

import torch

from common.checksum import crc32
from common.codec.fp4 import FP4_BLOCK, all_finite, dequantize_fp4, quantize_fp4
from common.codec.framing import Part, fragment_parts
from common.codec.sparse import (
    DEFAULT_TOPK_FRACTION,
    SPARSE_CHUNK,
    SPARSE_CODECS,
    encode_sparse,
    topk_k,
)
from common.codec.tensor import (
    WireTensor,
    check_fragment,
    codec_id,
    decode_values,
    encode_values,
    encoded_sizes,
    parse_fragment,
    parse_updates,
)
from common.generated.diloco.v1 import aggregator_pb2 as pb

CHUNK_BYTES = 1 << 20
DEFAULT_SPARSE_K = topk_k(DEFAULT_TOPK_FRACTION)
# Per-tensor protobuf framing (tags, lengths, codec, shape, crc) stays far below this.
_FRAMING_BYTES_PER_TENSOR = 64
# An update encoded a chunk at a time starts each chunk at a multiple of this many values:
# 32 sparse chunks, where the indices' and codes' bytes both end on a byte boundary.
ALIGN_VALUES = 32 * SPARSE_CHUNK
# Snapshot payloads smaller than this are copied.
COPY_BELOW_BYTES = 64 << 10


def encode_fragment(
    tensors: Sequence[torch.Tensor], codec: str | int, sparse_k: int = DEFAULT_SPARSE_K
) -> bytes:
    """Serialize the tensors of one fragment with `codec` (a sparse one keeping `sparse_k`
    values per chunk, without error feedback: fragment_with_feedback keeps the
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


def fragment_with_feedback(
    tensors: Sequence[torch.Tensor],
    codec: str | int,
    k: int,
    residuals: list[torch.Tensor],
    decay: float = 1.0,
) -> bytes:
    """The serialized sparse EncodedFragment of tensors + decay·residuals, updating each
    residual in place to what the message leaves out ((t + decay·e) − decoded): with decay
    < 1 the residual is SparseLoCo's momentum-like accumulator, not only a carry. Residuals
    live on the tensors' devices; the caller starts them at zeros. Raises ValueError on
    non-finite values."""
    codec = codec_id(codec) if isinstance(codec, str) else codec
    encoded = []
    for t, residual in zip(tensors, residuals, strict=True):
        if decay != 1.0:
            residual.mul_(decay)
        flat = (t.detach().reshape(-1).to(torch.float32) + residual.view(-1)).contiguous()
        if not all_finite(flat):
            raise ValueError("cannot encode a tensor with NaN or infinite values")
        enc = encode_sparse(flat, codec, k)
        torch.sub(flat, enc.dense(flat.numel()), out=residual.view(-1))
        payload = memoryview(enc.payload().cpu().numpy()).cast("B")
        scales = memoryview(enc.scales.cpu().contiguous().numpy()).cast("B")
        encoded.append((codec, tuple(t.shape), payload, scales, k))
    return b"".join(fragment_parts(encoded))


# ---- The server's answers ----------------------------------------------------------------


class UpdateEncoder:
    """Collects one update's encoded chunks, tensor by tensor, in order."""

    def __init__(self, codec: int, shapes: Sequence[tuple[int, ...]], sparse_k: int) -> None:
        self.codec, self.shapes, self.sparse_k = codec, list(shapes), sparse_k
        self.sparse = codec in SPARSE_CODECS
        if self.sparse:  # per tensor: lists of index bytes, code bytes, scale bytes
            self._pieces: list[tuple[list, list, list]] = [([], [], []) for _ in self.shapes]
        else:
            sizes = [encoded_sizes(codec, math.prod(shape)) for shape in self.shapes]
            self._codes = [torch.empty(n, dtype=torch.uint8) for n, _ in sizes]
            self._scales = [torch.empty(n, dtype=torch.uint8) for _, n in sizes]

    def add(self, i: int, start: int, values: torch.Tensor) -> torch.Tensor:
        """Encode values [start, start + len) of tensor `i` (finite float32, start a multiple
        of ALIGN_VALUES); returns their decoded float32 values."""
        if self.sparse:
            enc = encode_sparse(values, self.codec, self.sparse_k)
            for pieces, part in zip(
                self._pieces[i], (enc.indices, enc.codes, enc.scales), strict=True
            ):
                pieces.append(part)
            return enc.dense(values.numel())
        packed, scale_bytes = quantize_fp4(values, self.codec)
        self._codes[i][start // 2 : start // 2 + packed.numel()] = packed
        first_block = start // FP4_BLOCK
        self._scales[i][first_block : first_block + scale_bytes.numel()] = scale_bytes
        return dequantize_fp4(packed, scale_bytes, values.numel(), self.codec)

    def serialized(self) -> bytes:
        """The serialized EncodedFragment of every chunk added (framing.py)."""
        if self.sparse:
            tensors = []
            for shape, (indices, codes, scales) in zip(self.shapes, self._pieces, strict=True):
                payload = (
                    torch.cat(indices + codes) if indices else torch.empty(0, dtype=torch.uint8)
                )
                scale_bytes = torch.cat(scales) if scales else torch.empty(0, dtype=torch.uint8)
                tensors.append(
                    (self.codec, shape, _view(payload), _view(scale_bytes), self.sparse_k)
                )
        else:
            tensors = [
                (self.codec, shape, _view(c), _view(s))
                for shape, c, s in zip(self.shapes, self._codes, self._scales, strict=True)
            ]
        return b"".join(fragment_parts(tensors))


def _view(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().numpy()).cast("B")


def snapshot_parts(
    params: Sequence[torch.Tensor], lock: threading.Lock | None = None
) -> tuple[Part, ...]:
    """The serialized fp32 EncodedFragment of `params` (encode_fragment's bytes), in parts
    whose payloads are the parameters' own bytes, read in place (TensorBytes): no copy of
    the parameters is made unless they change while a pull still streams them. Raises
    ValueError for a non-finite value, as tensor.encode does."""
    lock = lock or threading.Lock()
    tensors = ((pb.CODEC_FP32, tuple(t.shape), _payload(t, lock), b"") for t in params)
    return tuple(part for part in fragment_parts(tensors) if len(part))


def _payload(t: torch.Tensor, lock: threading.Lock) -> Part:
    """The tensor's bytes read in place, or a plain copy when small (a pull joins small parts
    with their framing anyway)."""
    payload = TensorBytes(t, lock)
    return bytes(payload) if len(payload) < COPY_BELOW_BYTES else payload


class TensorBytes:
    """The float32 bytes of a contiguous CPU tensor as a pull part, read in place.

    Slicing returns a copy of the slice (what a pull sends, PULL_CHUNK_BYTES at a time). The
    owner of the tensor calls `freeze()`, under `lock`, before it changes the tensor: a pull
    still streaming this part then reads a copy of the old bytes, so every pull answer is
    one version's bytes. Why: a snapshot held as bytes cost one model copy from the first
    pull of a version to the next version, and one per version still being streamed.
    """

    def __init__(self, tensor: torch.Tensor, lock: threading.Lock) -> None:
        flat = tensor.detach().reshape(-1)
        if (
            flat.dtype != torch.float32
            or flat.device.type != "cpu"
            or flat.data_ptr() != (tensor.data_ptr())
        ):
            raise ValueError("TensorBytes needs a contiguous float32 CPU tensor")
        if not all_finite(flat):
            raise ValueError("cannot encode a tensor with NaN or infinite values")
        self._view: memoryview | None = memoryview(flat.numpy()).cast("B")
        self._frozen: bytes | None = None
        self._lock = lock

    def __len__(self) -> int:
        return len(self._frozen) if self._view is None else self._view.nbytes

    def __getitem__(self, key: slice) -> bytes:
        with self._lock:
            if self._view is None:
                return self._frozen[key]
            return self._view[key].tobytes()

    def __bytes__(self) -> bytes:
        return self[:]

    def buffer(self) -> memoryview | bytes:
        """The bytes without a copy, for a checksum (call while the tensor cannot change)."""
        return self._frozen if self._view is None else self._view

    def freeze(self) -> None:
        """Keep a copy of the bytes, to serve after the tensor changes; call under the lock."""
        if self._view is not None:
            self._frozen, self._view = self._view.tobytes(), None
