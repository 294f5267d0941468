"""One outer update in the pull codec, encoded a chunk at a time, as the log keeps it.

    encoder = UpdateEncoder(codec, shapes, sparse_k)
    for i, start, u in chunks:                    # chunk ranges of each tensor, in order
        quantized = encoder.add(i, start, u)      # float32: exactly what learners will add
    data = encoder.serialized()                   # the EncodedFragment of the whole update

The server's outer step (server/fragment.py) walks the update a chunk of `outer.CHUNK_VALUES`
values at a time so that it never holds a model-sized temporary; each chunk is encoded here
and its decoded values returned, so the server applies exactly what learners decode. The
bytes of a chunk are the bytes of that range of the whole tensor's encoding: fp4 blocks of 32
values, and sparse chunks of 4096 whose indices and codes end on byte boundaries every 32
chunks (131,072 values; tests/unit/test_sparse.py checks the two encodings are equal).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from common.codec import FP4_BLOCK, dequantize_fp4, quantize_fp4
from common.fragment_wire import encoded_sizes, fragment_parts
from common.sparse import encode_sparse
from common.sparse_wire import SPARSE_CHUNK, SPARSE_CODECS
from server.outer import CHUNK_VALUES

if CHUNK_VALUES % (32 * SPARSE_CHUNK):
    raise RuntimeError("outer chunks must hold a whole number of 32 sparse chunks")


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
        of CHUNK_VALUES); returns their decoded float32 values."""
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
        """The serialized EncodedFragment of every chunk added (common/fragment_wire.py)."""
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
