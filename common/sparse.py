"""The top-k sparse encoder (format: common/sparse_wire.py) and its error feedback.

    k = topk_k(1 / 64)                                   # 64 values of every 4096
    enc = encode_sparse(flat, pb.CODEC_SPARSE_2BIT, k)   # indices, codes, scales (uint8)
    payload = fragment_with_feedback(deltas, "sparse_2bit", k, residuals)

In every chunk of 4096 values the k largest in magnitude are kept (torch.topk; among equal
magnitudes at the boundary the lowest indices), listed in index order, and quantized: to 2
bits (sign, and the lower or upper of two magnitudes per chunk: the kept magnitudes of rank
k/4 and 3k/4, rounded to bfloat16), or to E2M1 with one E8M0 scale per chunk
(common.codec.fp4_block_codes, the fp4 codec's own rounding).

Error feedback (SparseLoCo, arXiv 2508.15706): what a sparse message leaves out is not lost.
The sender keeps a residual e per tensor, sends S(x + e) and keeps e ← (x + e) − decode(S(x +
e)); the dropped entries and the rounding error join the next message. The learner does this
for its pushes (fragment_with_feedback), decaying e by β before adding x (SparseLoCo's
e ← β·e + x, learner --push-feedback-decay), which makes e the outer momentum: the server
then takes plain averaged steps (server/outer_config.py). The server does it for its pulls, a
chunk range at a time (server/fragment.py), applying exactly the decoded values it sends,
so the replicas that learners rebuild from the updates are bit-identical to the server's.

The selection runs in C on CPU tensors (common/topk_kernel.c: topk_select, a radix select per
chunk, bit-identical to the torch path; tests/unit/test_sparse.py checks it) and as torch.topk
elsewhere; the rest is vectorized torch over the kept entries (bench/perf.py measures the
encoder against clone()).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from common import fp4_native
from common.codec import BF16_MAX, codec_id, fp4_block_codes
from common.fragment_wire import fragment_parts
from common.generated.diloco.v1 import aggregator_pb2 as pb
from common.sparse_wire import (
    E8M0_BIAS,
    SPARSE_CHUNK,
    SPARSE_CODECS,
    VALUE_BITS,
    decode_codes,
    dense,
    kept_counts,
    pack_codes,
    pack_indices,
)

DEFAULT_TOPK_FRACTION = 1 / 64  # SparseLoCo's 64 of every 4096
# The learner's push residual is multiplied by this before each sparse push (SparseLoCo's
# error-feedback decay): what stays unsent for long fades instead of piling up.
DEFAULT_FEEDBACK_DECAY = 0.95
# Whether the learner also keeps that residual in its local model (docs/RESULTS.md, the
# learner's unsent progress); off: SparseLoCo's rule, the residual apart from the model.
DEFAULT_FEEDBACK_IN_MODEL = False


def topk_k(fraction: float) -> int:
    """Values kept per chunk of 4096 for a kept fraction in (0, 1]; raises ValueError."""
    if not 0 < fraction <= 1:
        raise ValueError(f"topk fraction must be in (0, 1], got {fraction}")
    return max(1, min(SPARSE_CHUNK, round(fraction * SPARSE_CHUNK)))


@dataclass(frozen=True)
class SparseEncoding:
    """One tensor (or chunk-aligned range of one) in the sparse format: uint8 tensors of the
    packed indices and codes (payload = indices then codes) and the chunks' scale bytes,
    with the positions (within the range) and decoded float32 values of the kept entries."""

    indices: torch.Tensor
    codes: torch.Tensor
    scales: torch.Tensor
    positions: torch.Tensor
    values: torch.Tensor

    def payload(self) -> torch.Tensor:
        return torch.cat([self.indices, self.codes])

    def dense(self, numel: int) -> torch.Tensor:
        """The decoded values as a float32 tensor of `numel`, zeros where nothing was kept."""
        return dense(self.positions, self.values, numel)


def encode_sparse(flat: torch.Tensor, codec: int, k: int) -> SparseEncoding:
    """Encode a finite 1-D float32 tensor; a range of a longer tensor encodes to the same
    bytes as that range of the whole when it starts at a multiple of 32 chunks (the byte
    boundaries of both indices and codes fall there)."""
    if codec not in SPARSE_CODECS:
        raise ValueError(f"codec {codec} is not a sparse codec")
    numel = flat.numel()
    full, tail, k_tail = kept_counts(numel, k)
    groups = []  # (first chunk, rows of values, entries kept per row)
    if full:
        groups.append((0, flat[: full * SPARSE_CHUNK].view(full, SPARSE_CHUNK), k))
    if tail:
        groups.append((full, flat[full * SPARSE_CHUNK :].view(1, tail), k_tail))
    local, codes, scales, chunk_of = [], [], [], []
    kernel = fp4_native.load() if flat.device.type == "cpu" else None
    for first_chunk, rows, kk in groups:
        idx = _select(rows, kk, kernel)
        values = rows.gather(1, idx)
        ranked = values.abs().sort(dim=1, descending=True).values
        row_codes, row_scales = _quantize(codec, values, ranked)
        local.append(idx.reshape(-1))
        codes.append(row_codes.reshape(-1))
        scales.append(row_scales.reshape(-1))
        chunk = torch.arange(rows.shape[0], device=flat.device) + first_chunk
        chunk_of.append(chunk.repeat_interleave(kk))
    if not groups:
        empty = torch.empty(0, dtype=torch.uint8, device=flat.device)
        none = torch.empty(0, dtype=torch.int64, device=flat.device)
        return SparseEncoding(empty, empty, empty, none, none.float())
    local_all, codes_all, scales_all = torch.cat(local), torch.cat(codes), torch.cat(scales)
    chunks = torch.cat(chunk_of)
    return SparseEncoding(
        indices=pack_indices(local_all),
        codes=pack_codes(codes_all, VALUE_BITS[codec]),
        scales=scales_all,
        positions=chunks * SPARSE_CHUNK + local_all,
        values=decode_codes(codec, codes_all, scales_all, chunks),
    )


def _select(rows: torch.Tensor, kk: int, kernel: fp4_native.Kernel | None) -> torch.Tensor:
    """The kept indices of each row, ascending: the C kernel's radix select where it is
    built (one pass per level over a row in cache), else torch.topk and the tie rule."""
    if kernel is not None:
        return kernel.topk_select(rows.contiguous(), kk)
    magnitudes = rows.abs()
    ranked = magnitudes.topk(kk, dim=1)
    return _lowest_on_ties(magnitudes, ranked.values[:, -1:], ranked.indices.sort(dim=1).values)


def _lowest_on_ties(
    magnitudes: torch.Tensor, threshold: torch.Tensor, idx: torch.Tensor
) -> torch.Tensor:
    """The kept indices (rows, kk) by the format's rule: the kk largest magnitudes and, among
    those equal to the smallest kept one, the lowest indices. torch.topk picks among equal
    values as it likes; rows where it had a choice are redone here, so the bytes do not
    depend on its implementation (a server replaying its log elsewhere gets the same)."""
    kk = idx.shape[1]
    ties = (magnitudes >= threshold).sum(dim=1) != kk
    if not bool(ties.any()):
        return idx
    rows, bound = magnitudes[ties], threshold[ties]
    above = rows > bound
    equal = rows == bound
    room = kk - above.sum(dim=1, keepdim=True)
    keep = above | (equal & (equal.cumsum(dim=1) <= room))
    idx = idx.clone()
    idx[ties] = keep.nonzero()[:, 1].view(-1, kk)  # row-major: ascending within each row
    return idx


def _quantize(
    codec: int, values: torch.Tensor, ranked: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (uint8, values' shape) and per-row scale bytes (uint8, (rows, scale bytes)) of
    the kept values (rows, kk), given their magnitudes in descending order."""
    if codec == pb.CODEC_SPARSE_FP4:
        codes, exps = fp4_block_codes(values)
        return codes, (exps + E8M0_BIAS).to(torch.uint8).unsqueeze(1)
    kk = values.shape[1]
    # Two magnitudes per chunk: order statistics, exact on every machine (no float sums).
    levels = torch.stack([ranked[:, (3 * kk) // 4], ranked[:, kk // 4]], dim=1)
    levels = levels.clamp(max=BF16_MAX).to(torch.bfloat16)
    lower, upper = levels.float().unbind(dim=1)
    midpoint = ((lower + upper) / 2).unsqueeze(1)
    codes = (values.abs() > midpoint).to(torch.uint8) | ((values < 0).to(torch.uint8) << 1)
    scale_bytes = levels.contiguous().view(torch.uint8).view(values.shape[0], 4)
    return codes, scale_bytes


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
        if not bool(torch.isfinite(flat).all()):
            raise ValueError("cannot encode a tensor with NaN or infinite values")
        enc = encode_sparse(flat, codec, k)
        torch.sub(flat, enc.dense(flat.numel()), out=residual.view(-1))
        payload = memoryview(enc.payload().cpu().numpy()).cast("B")
        scales = memoryview(enc.scales.cpu().contiguous().numpy()).cast("B")
        encoded.append((codec, tuple(t.shape), payload, scales, k))
    return b"".join(fragment_parts(encoded))
