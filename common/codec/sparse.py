"""The top-k sparse codec, sparse_2bit: the format, its checks and decoding, and the encoder.

    k = topk_k(1 / 64)                                   # 64 values of every 4096
    enc = encode_sparse(flat, pb.CODEC_SPARSE_2BIT, k)   # indices, codes, scales (uint8)
    n_payload, n_scales = sparse_sizes(codec, numel, k)
    positions, values = sparse_entries(codec, payload, scales, numel, k)  # checked

A sparse tensor is cut, flattened, into chunks of `SPARSE_CHUNK` = 4096 values. Each full
chunk keeps `k` values (1 <= k <= 4096, the tensor's `sparse_k` field); a last, shorter chunk
of `n` values keeps ceil(k·n / 4096). The kept entries are listed chunk by chunk, in
increasing index order within a chunk, so their flat positions increase strictly.

    payload = indices | codes
      indices: each entry's index within its chunk in 12 bits, two entries in three bytes
               (a & 0xFF, a >> 8 | (b & 0xF) << 4, b >> 4); an odd count drops the last byte
      codes:   each entry's value code in 2 bits, 4 per byte, entry 0 in the lowest bits;
               the last byte zero-padded
    scales  = per chunk, two bfloat16 magnitudes (lower, upper), little-endian, 4 bytes

A code's bit 0 picks the upper magnitude, bit 1 is the sign. With k = 64: 12 + 2 bits per kept
value and 32 scale bits per chunk, 0.227 bits per parameter.

Why these choices: 12-bit local indices keep every chunk's bytes at a fixed offset (a chunk
range decodes without reading the rest, and the server encodes a chunk range at a time); the
entropy of choosing 64 of 4096 is about 7.4 bits per index, so a variable-length code could
save ~0.07 bits per parameter at the price of sequential decoding. The 2-bit magnitudes are
order statistics of the kept values (exact, no float sums), so an encoder gives the same
bytes on every machine and a server's replay from its state dir is bit-identical.

The checks here run before anything is applied (tensor.py's check_tensor):
lengths, scale bytes (no NaN or infinity, no negative magnitude), positions strictly
increasing and inside the tensor, decoded values finite. Memory is in proportion to the
payload's length, never to the size a sender claims: the payload must hold 14 bits for
every kept entry before an entry is unpacked.

The encoder keeps, in every chunk, the k largest magnitudes (among equal magnitudes at the
boundary the lowest indices), listed in index order, and quantizes them to 2 bits: the sign,
and the lower or upper of two magnitudes per chunk, the kept magnitudes of rank k/4 and 3k/4
rounded to bfloat16. The selection runs in C on CPU tensors (topk_kernel.c: a radix select
per chunk, bit-identical to the torch path; tests/unit/test_sparse.py checks it) and as
torch.topk elsewhere; the rest is vectorized torch over the kept entries (bench/perf.py
measures the encoder against clone()).

Error feedback (SparseLoCo, arXiv 2508.15706): what a sparse message leaves out is not lost.
The sender keeps a residual e per tensor, sends S(x + e) and keeps e ← (x + e) − decode(S(x +
e)); the dropped entries and the rounding error join the next message. The learner does this
for its pushes (fragment.fragment_with_feedback), decaying e by β before adding x
(SparseLoCo's e ← β·e + x, learner --push-feedback-decay), which makes e the outer momentum:
the server then takes plain averaged steps. The server does it for its pulls, a chunk range at
a time (fragment.UpdateEncoder), applying exactly the decoded values it sends, so the replicas
that learners rebuild from the updates are bit-identical to the server's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.codec import native
from common.codec.fp4 import BF16_MAX, NOT_FINITE, all_finite
from common.errors import InvalidArgument
from common.generated.diloco.v1 import aggregator_pb2 as pb

SPARSE_CHUNK = 4096
INDEX_BITS = 12
SPARSE_CODECS = (pb.CODEC_SPARSE_2BIT,)
VALUE_BITS = 2  # a value's code
SCALE_BYTES = 4  # a chunk's two bfloat16 magnitudes
_BF16_EXPONENT, _BF16_SIGN = 0x7F80, 0x8000


def kept_counts(numel: int, k: int) -> tuple[int, int, int]:
    """(full chunks, values of the last short chunk (0: none), entries that chunk keeps)."""
    full, tail = divmod(numel, SPARSE_CHUNK)
    return full, tail, (k * tail + SPARSE_CHUNK - 1) // SPARSE_CHUNK


def kept_total(numel: int, k: int) -> int:
    """The number of entries a tensor of `numel` values keeps with `k` per chunk."""
    full, _, k_tail = kept_counts(numel, k)
    return full * k + k_tail


def sparse_sizes(codec: int, numel: int, k: int) -> tuple[int, int]:
    """Exact (payload, scales) byte lengths of a sparse tensor."""
    n = kept_total(numel, k)
    chunks = (numel + SPARSE_CHUNK - 1) // SPARSE_CHUNK
    return _index_bytes(n) + _code_bytes(n, VALUE_BITS), chunks * SCALE_BYTES


def _index_bytes(n: int) -> int:
    return (3 * n + 1) // 2


def _code_bytes(n: int, bits: int) -> int:
    return (n * bits + 7) // 8


def check_k(codec: int, k: int) -> None:
    """Refuse a `sparse_k` out of range for the codec (0 for dense codecs)."""
    if codec in SPARSE_CODECS and not 1 <= k <= SPARSE_CHUNK:
        raise InvalidArgument(f"sparse tensor keeps {k} values per chunk, not in 1..{SPARSE_CHUNK}")
    if codec not in SPARSE_CODECS and k != 0:
        raise InvalidArgument(f"sparse_k is {k} on a dense tensor: it must be 0")


# ---- Bit packing (any device) ------------------------------------------------------------


def pack_indices(local: torch.Tensor) -> torch.Tensor:
    """12-bit indices (int64, each < 4096) packed two per three bytes (uint8)."""
    n = local.numel()
    if n % 2:
        local = torch.cat([local, local.new_zeros(1)])
    a, b = local[0::2], local[1::2]
    packed = torch.stack([a & 0xFF, (a >> 8) | ((b & 0xF) << 4), b >> 4], dim=1)
    return packed.reshape(-1)[: _index_bytes(n)].to(torch.uint8)


def unpack_indices(data: torch.Tensor, n: int) -> torch.Tensor:
    """The `n` int64 indices of pack_indices' bytes (`data`: uint8, _index_bytes(n) long)."""
    wide = data.to(torch.int64)
    if n % 2:
        wide = torch.cat([wide, wide.new_zeros(1)])
    triples = wide.view(-1, 3)
    a = triples[:, 0] | ((triples[:, 1] & 0xF) << 8)
    b = (triples[:, 1] >> 4) | (triples[:, 2] << 4)
    return torch.stack([a, b], dim=1).reshape(-1)[:n]


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """`bits`-bit codes (uint8) packed 8/bits per byte, entry 0 in the lowest bits."""
    per = 8 // bits
    n = codes.numel()
    padded = torch.zeros(-(-n // per) * per, dtype=torch.uint8, device=codes.device)
    padded[:n] = codes
    groups = padded.view(-1, per)
    out = groups[:, 0].clone()
    for j in range(1, per):
        out |= groups[:, j] << (bits * j)
    return out


def unpack_codes(data: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    """The `n` codes (uint8) of pack_codes' bytes."""
    mask = (1 << bits) - 1
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=data.device)
    return ((data.unsqueeze(1) >> shifts) & mask).reshape(-1)[:n]


# ---- Checks and decoding -----------------------------------------------------------------


def check_scales(scales: bytes) -> None:
    """Refuse a NaN or infinite scale, or a negative magnitude."""
    halves = _byte_tensor(scales).view(torch.int16).to(torch.int32) & 0xFFFF
    if bool(((halves & _BF16_EXPONENT) == _BF16_EXPONENT).any()):
        raise InvalidArgument("sparse 2-bit chunk magnitude is NaN or infinite")
    if bool((halves & _BF16_SIGN).any()):
        raise InvalidArgument("sparse 2-bit chunk magnitude is negative")


def sparse_entries(
    codec: int, payload: bytes, scales: bytes, numel: int, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(flat positions int64, float32 values) of a sparse tensor whose lengths match
    sparse_sizes; raises InvalidArgument for positions out of order or out of range, or a
    value that is not finite. Allocates in proportion to the payload's length."""
    n = kept_total(numel, k)
    raw = _byte_tensor(payload)
    split = _index_bytes(n)
    local = unpack_indices(raw[:split], n)
    chunk_of = torch.arange(n, dtype=torch.int64) // k
    positions = chunk_of * SPARSE_CHUNK + local
    if n and not (bool((positions[1:] > positions[:-1]).all()) and int(positions[-1]) < numel):
        raise InvalidArgument(
            "sparse indices must increase strictly within each chunk and stay inside it"
        )
    codes = unpack_codes(raw[split:], n, VALUE_BITS)
    values = decode_codes(codes, scales, chunk_of)
    if not all_finite(values):
        raise InvalidArgument(NOT_FINITE)
    return positions, values


def decode_codes(
    codes: torch.Tensor, scales: bytes | torch.Tensor, chunk_of: torch.Tensor
) -> torch.Tensor:
    """The float32 values of value codes, each in chunk `chunk_of` (same device as codes)."""
    scale_bytes = scales if isinstance(scales, torch.Tensor) else _byte_tensor(scales)
    scale_bytes = scale_bytes.to(codes.device)
    chunk_of = chunk_of.to(codes.device)
    levels = scale_bytes.view(torch.bfloat16).float().view(-1, 2)  # (chunks, lower/upper)
    magnitudes = levels[chunk_of, (codes & 1).long()]
    return torch.where((codes & 2) != 0, -magnitudes, magnitudes)


def dense(positions: torch.Tensor, values: torch.Tensor, numel: int) -> torch.Tensor:
    """A float32 tensor of `numel` zeros with `values` at `positions` (values' device)."""
    out = torch.zeros(numel, dtype=torch.float32, device=values.device)
    out[positions.to(values.device)] = values
    return out


def _byte_tensor(data: bytes) -> torch.Tensor:
    """A uint8 tensor of a copy of `data` (torch.frombuffer refuses an empty buffer)."""
    if not data:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


# ---- The encoder -------------------------------------------------------------------------


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
    kernel = native.load() if flat.device.type == "cpu" else None
    for first_chunk, rows, kk in groups:
        idx = _select(rows, kk, kernel)
        values = rows.gather(1, idx)
        ranked = values.abs().sort(dim=1, descending=True).values
        row_codes, row_scales = _quantize(values, ranked)
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
        codes=pack_codes(codes_all, VALUE_BITS),
        scales=scales_all,
        positions=chunks * SPARSE_CHUNK + local_all,
        values=decode_codes(codes_all, scales_all, chunks),
    )


def _select(rows: torch.Tensor, kk: int, kernel: native.Kernel | None) -> torch.Tensor:
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


def _quantize(values: torch.Tensor, ranked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (uint8, values' shape) and per-row scale bytes (uint8, (rows, scale bytes)) of
    the kept values (rows, kk), given their magnitudes in descending order."""
    kk = values.shape[1]
    # Two magnitudes per chunk: order statistics, exact on every machine (no float sums).
    levels = torch.stack([ranked[:, (3 * kk) // 4], ranked[:, kk // 4]], dim=1)
    levels = levels.clamp(max=BF16_MAX).to(torch.bfloat16)
    lower, upper = levels.float().unbind(dim=1)
    midpoint = ((lower + upper) / 2).unsqueeze(1)
    codes = (values.abs() > midpoint).to(torch.uint8) | ((values < 0).to(torch.uint8) << 1)
    scale_bytes = levels.contiguous().view(torch.uint8).view(values.shape[0], 4)
    return codes, scale_bytes
