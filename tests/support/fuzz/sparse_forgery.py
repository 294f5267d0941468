"""Well-formed sparse tensors (sparse_2bit, a valid checksum) with one forgery.

Random bytes almost never get past a sparse tensor's index check, so the decoders' other
strategies rarely reach its scale and value checks. Here the encoder makes a real tensor and one
field is forged after it, the checksum recomputed so that only the sparse checks can refuse it:

- `repeat_index`, `swap_indices`: two entries of a chunk with the same index, or out of order;
- `past_end`: the last entry's index past the end of a short last chunk;
- `bad_scale`: a NaN, infinite or negative bfloat16 magnitude;
- `huge_scale`: a finite but huge scale (decoded values may overflow to infinity: refused or
  finite, either is fine);
- `recode`: every value code rewritten at random (any code is valid: must decode finite).
"""

from __future__ import annotations

import struct

import torch
from hypothesis import strategies as st

from common.codec.sparse import SPARSE_CHUNK, kept_counts, kept_total, pack_indices, unpack_indices
from common.codec.tensor import encode
from common.generated.diloco.v1 import aggregator_pb2 as pb
from tests.support.fuzz.strategies import with_crc

MUST_REFUSE = ("repeat_index", "swap_indices", "past_end", "bad_scale")
FORGERIES = (*MUST_REFUSE, "huge_scale", "recode")
# Sizes around the chunk of 4096: one short chunk, exactly one, two with a short last one.
SHAPES = st.sampled_from([(2,), (37,), (5, 9), (SPARSE_CHUNK,), (SPARSE_CHUNK + 5,), (3, 3000)])


@st.composite
def forged_sparse(draw) -> tuple[str, pb.EncodedTensor]:
    """(forgery, tensor): a sparse tensor with one forgery; see the module docstring."""
    shape = draw(SHAPES)
    values = torch.randn(shape, generator=torch.Generator().manual_seed(draw(st.integers(0, 99))))
    t = encode(values, "sparse_2bit", sparse_k=draw(st.sampled_from([1, 2, 64, 4096])))
    numel = values.numel()
    n = kept_total(numel, t.sparse_k)
    split = (3 * n + 1) // 2  # index bytes: 12 bits an entry
    local = unpack_indices(torch.frombuffer(bytearray(t.payload[:split]), dtype=torch.uint8), n)
    forgery = draw(st.sampled_from(FORGERIES))
    pairs = [j for j in range(n - 1) if (j + 1) % t.sparse_k]  # j and j+1 in one chunk
    _, last_len, _ = kept_counts(numel, t.sparse_k)
    if forgery in ("repeat_index", "swap_indices") and not pairs:
        forgery = "recode"  # one entry per chunk: no pair to forge
    if forgery == "past_end" and not 0 < last_len < SPARSE_CHUNK:
        forgery = "bad_scale"  # the last chunk is full: every 12-bit index is inside it
    if forgery in ("repeat_index", "swap_indices", "past_end"):
        if forgery == "past_end":
            local[-1] = draw(st.integers(last_len, SPARSE_CHUNK - 1))
        else:
            j = draw(st.sampled_from(pairs))
            a, b = int(local[j]), int(local[j + 1])
            local[j], local[j + 1] = (a, a) if forgery == "repeat_index" else (b, a)
        t.payload = bytes(pack_indices(local).numpy()) + t.payload[split:]
    elif forgery in ("bad_scale", "huge_scale"):
        t.scales = _forged_scales(draw, bytearray(t.scales), forgery == "bad_scale")
    else:
        codes = draw(st.binary(min_size=len(t.payload) - split, max_size=len(t.payload) - split))
        t.payload = t.payload[:split] + codes
    return forgery, with_crc(t)


def _forged_scales(draw, scales: bytearray, refusable: bool) -> bytes:
    """`scales` with one chunk's scale NaN, infinite or negative (refusable) or huge."""
    # Two little-endian bfloat16 magnitudes a chunk: NaN, +inf, or a negative finite value.
    bad = [0x7FC0, 0x7F80, 0xFFC0, 0x8000 | 0x3F80] if refusable else [0x7F7F]
    at = 2 * draw(st.integers(0, len(scales) // 2 - 1))
    scales[at : at + 2] = struct.pack("<H", draw(st.sampled_from(bad)))
    return bytes(scales)
