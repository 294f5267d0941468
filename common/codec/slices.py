"""A slice of a fragment: what one rank of a sharded island (FSDP) holds of each tensor,
and the wire answers cut to it.

    cut = SliceCut(shapes, index=1, count=2)     # the fragment's full shapes
    cut.shapes                                   # each tensor's slice: rows of dim 0
    cut.of(tensor, i)                            # the slice's view of full tensor i
    update = cut.update(logged)                  # server: a logged update cut to the slice
    version = cut.apply_updates(slices, chain, have_version)   # learner: add the cut chain

Slice `index` of `count` holds rows [index·c, min((index+1)·c, rows)) of every tensor's
first dimension, c = ceil(rows / count): the cut torch.chunk makes, which is the local shard
FSDP2 (fully_shard, Shard(0)) gives each rank. So a rank sends and pulls what it holds, with
no collective and no whole fragment anywhere on the island (late ranks may hold no rows).

An update is quantized in blocks of FP4_BLOCK values from its tensor's start, so a slice
that does not start or end on a block edge is sent the whole blocks covering it: at most one
block more at each end, decoded whole on the learner and trimmed. A block decodes alone, so
the slice's values are those of the whole update's decode, bit for bit. Sparse codecs keep
their top-k per chunk of 4096 values and pack indices across chunks: they cannot be cut
this way, and a slice of a server with a sparse pull codec is refused (fp32 pulls are
snapshots, which any slice takes).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from common.codec.fp4 import FP4_BLOCK
from common.codec.framing import fragment_parts, scan_fragment
from common.codec.tensor import (
    CODEC_NAMES,
    FP4_CODECS,
    check_tensor,
    decode_values,
    encoded_sizes,
    parse_updates,
)
from common.errors import InvalidArgument

# The most slices a fragment may be cut in (ranks of one island).
MAX_SLICES = 4096


def slice_rows(rows: int, index: int, count: int) -> tuple[int, int]:
    """The rows [start, stop) of a dimension of `rows` that slice `index` of `count` holds."""
    per_slice = -(-rows // count)
    start = min(index * per_slice, rows)
    return start, min(start + per_slice, rows)


def is_sliced(count: int) -> bool:
    """Whether a wire field's slice_count asks for a slice (0 and 1: the whole fragment)."""
    return count > 1


class SliceCut:
    """Slice `index` of `count` of every tensor of a fragment with these (full) shapes."""

    def __init__(self, shapes: Sequence[Sequence[int]], index: int, count: int) -> None:
        """Raises InvalidArgument for a slice that does not exist or a tensor without rows."""
        if not 1 <= count <= MAX_SLICES or not 0 <= index < count:
            raise InvalidArgument(
                f"slice {index} of {count} does not exist (at most {MAX_SLICES} slices)"
            )
        if any(len(shape) == 0 for shape in shapes):
            raise InvalidArgument("a fragment with a 0-dimensional tensor cannot be sliced")
        self.index, self.count = index, count
        self.full_shapes = [tuple(int(d) for d in shape) for shape in shapes]
        self.rows = [slice_rows(shape[0], index, count) for shape in self.full_shapes]
        self.shapes = [
            (stop - start, *shape[1:])
            for (start, stop), shape in zip(self.rows, self.full_shapes, strict=True)
        ]
        # Flat [start, stop) of each slice in its tensor (rows are contiguous there).
        self.spans = [
            (start * math.prod(shape[1:]), stop * math.prod(shape[1:]))
            for (start, stop), shape in zip(self.rows, self.full_shapes, strict=True)
        ]

    @property
    def numel(self) -> int:
        return sum(stop - start for start, stop in self.spans)

    def of(self, tensor: torch.Tensor, i: int) -> torch.Tensor:
        """The slice's rows of full tensor `i`, as a view."""
        start, stop = self.rows[i]
        return tensor.narrow(0, start, stop - start)

    @staticmethod
    def check_codec(codec: int) -> None:
        """Raise InvalidArgument unless updates in `codec` can be cut (the fp4 ones; fp32
        pulls are snapshots, which any slice can take)."""
        if codec not in FP4_CODECS:
            raise InvalidArgument(
                f"{CODEC_NAMES.get(codec, codec)} updates cannot be cut into slices: a "
                "sharded island needs a server whose pull_codec is fp32, fp4_e2m1 or fp4_e3m0"
            )

    def covering(self, i: int, codec: int) -> tuple[int, int]:
        """The flat range of tensor `i`'s values that a cut in `codec` sends: the slice's,
        widened to whole blocks (and no further than the tensor)."""
        self.check_codec(codec)
        start, stop = self.spans[i]
        numel = math.prod(self.full_shapes[i])
        return start // FP4_BLOCK * FP4_BLOCK, min(-(-stop // FP4_BLOCK) * FP4_BLOCK, numel)

    def update(self, data: bytes) -> bytes:
        """A serialized EncodedFragment (a logged update, in the writer's layout) cut to
        the blocks covering the slice: each tensor 1-D, over covering()'s range."""
        fields = scan_fragment(memoryview(data))
        if fields is None or len(fields) != len(self.full_shapes):
            raise ValueError("a logged update is not an EncodedFragment of this fragment")
        tensors = []
        for i, (codec, _shape, payload, scales, _crc) in enumerate(fields):
            start, stop = self.covering(i, codec)
            (p0, s0), (p1, s1) = encoded_sizes(codec, start), encoded_sizes(codec, stop)
            tensors.append((codec, (stop - start,), payload[p0:p1], scales[s0:s1]))
        return b"".join(fragment_parts(tensors))  # type: ignore[arg-type]  # views, no copy

    def apply_updates(self, slices: Sequence[torch.Tensor], data: bytes, have_version: int) -> int:
        """Add a chain of cut updates (update()'s) to the slice's tensors in place; returns
        the new version. Every update is checked and decoded before the first is added, so
        a bad chain leaves the slices untouched (common/codec/fragment.py apply_updates)."""
        decoded = []
        for update in parse_updates(data, have_version):
            if len(update.tensors) != len(self.shapes):
                raise InvalidArgument(
                    f"update has {len(update.tensors)} tensors, expected {len(self.shapes)}"
                )
            values = []
            for i, msg in enumerate(update.tensors):
                start, stop = self.covering(i, msg.codec)
                whole = decode_values(check_tensor(msg, (stop - start,)))
                first = self.spans[i][0] - start
                values.append(whole[first : first + self.spans[i][1] - self.spans[i][0]])
            decoded.append(values)
        for values in decoded:
            for target, value in zip(slices, values, strict=True):
                target.add_(value.view(target.shape))
        return have_version + len(decoded)
