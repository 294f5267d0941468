"""Push ingest whose memory is bounded by a fixed number of slots, never by the learners.

    slots = IngestSlots(count=4)
    with slots.take() as slot:                      # at most `count` pushes at a time
        body = slot.parse(payload, shapes)          # validated; norm and max |value| known
        aggregator.push(session, fid, base, body)   # adds Σ w·Δ a chunk at a time

Why: decoding a whole push to float32 and then adding it to the round's sum kept one full
float32 copy per learner alive (plus about ten temporaries of the same size in the decoder),
and those copies waited on the aggregator lock, so the server's memory grew with the number
of learners (bench/load.py: 1.6 GB for a 4 MiB model at 64 learners). Here a push stays in its
wire encoding (4 bits per value for fp4) and is read twice: once before the lock, to check
every value and compute the norm the NormGuard needs, and once straight into the round's sum
(under the lock, or after it for a push added with the deferred ones: round.py).

fp4 pushes take the C kernel (fp4_stats.c, fp4_accumulate.c in common/codec), one pass over
the packed codes each, reading the wire bytes in place, with the GIL released so that pushes
in other slots proceed in parallel. Profiled (bench/ingest.py --quick, py-spy), the torch
chunk path spends ~27 ms per 4 M-value push on the checks and ~17 ms under the lock on the
add, so the lock caps ingest near 2 MiB / 17 ms; the kernel takes ~0.3 ms (AVX2 table
lookups) and ~0.7 ms (the decode in registers; the sum's 16 MB read and write make it
memory bound on a busy machine). A push's bytes come from its receive buffer
(server/rpc/receive.py), read in place.
The add is bit-identical to torch's `add_(values, alpha=w)`, whose rounding differs by CPU
(one FMA in its AVX2/AVX512 kernels, a multiply then an add in its baseline ones): the
kernel's mode is chosen by measuring torch in this process (Kernel.torch_add_mode), and where
neither mode matches, or there is no kernel (DILOCO_FP4_KERNEL=torch), the torch path below
runs. The kernel's norm sums the squares exactly per scale (in integers), so it can differ
from the torch path's float64 dot product in the last bits; max |value| is exact.

A round's sum is float32 and a large fragment's does not fit in any cache, so an add also
moves the whole sum through memory. Pushes are therefore added a few at a time: a round may
hold back up to round.DEFERRED_PUSHES accepted fp4 pushes (their receive buffers
held, PushBody.defer) and add them with the next one in a single pass (add_in_turn), the
kernel adding every push to one cache-sized tile of the sum before the next tile; the
per-element operations and their order are those of one add after another, so the sum is
bit-identical. bench/ingest.py (server_paths) measures it against one add per push:
1.06-1.5x faster over runs at 16 M values here, 1.1-1.3x at 4 M.

Sparse pushes were decoded by the parser into their kept entries (a fraction of the values,
in proportion to the payload): the norm reads those, and the add scatters them into a zeroed
chunk. Other codecs (and the torch path) decode `CHUNK_VALUES` at a time: a chunk of float32
stays in the CPU cache between the decode and the add, so the second decode costs less than the
memory traffic of a full copy.

A push is read through the wire format's one parser (common/codec/tensor.py parse_fragment),
as decode_fragment reads it, so both refuse the same payloads with the same words
(tests/unit/test_ingest.py). Only the values are checked here, a chunk at a time, with
decode_values' words; they are bit-identical to decode's: chunks are decoded by
`dequantize_fp4` itself, and an element-wise add over a slice gives the same
float32 as over the whole tensor.
"""

from __future__ import annotations

import contextlib
import math
import queue
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch

from common.codec import native
from common.codec.fp4 import FP4_BLOCK, FP4_GRIDS, NOT_FINITE, dequantize_fp4
from common.codec.tensor import WireTensor, parse_fragment, parse_fragment_view
from common.errors import InvalidArgument
from common.generated.diloco.v1 import aggregator_pb2 as pb

# Keeps a push's receive buffer past its call: the buffer's release, or None if it may not.
Hold = Callable[[], Callable[[], None] | None]

# Values decoded at a time: 512 KiB of float32, small enough to stay in cache from the decode
# to the add, large enough that the per-chunk Python overhead (~30 µs) stays a few percent.
CHUNK_VALUES = 1 << 17


class _Scratch:
    """Fixed-size buffers for decoding one chunk (one per slot, reused for every push)."""

    def __init__(self) -> None:
        self.raw = torch.empty(4 * CHUNK_VALUES, dtype=torch.uint8)  # fp32 chunk, the widest
        self.scales = torch.empty(CHUNK_VALUES // FP4_BLOCK, dtype=torch.uint8)
        self.wide = torch.empty(CHUNK_VALUES, dtype=torch.float64)  # for the sum of squares
        self._raw_np, self._scales_np = self.raw.numpy(), self.scales.numpy()

    def chunk(self, t: WireTensor, start: int, stop: int) -> torch.Tensor:
        """Values [start, stop) of `t` as float32 (start a multiple of CHUNK_VALUES); valid
        until the next call. Raises InvalidArgument for a value that is not finite."""
        n = stop - start
        if t.entries is not None:  # sparse: zeros but for the kept entries in the range
            values = self.raw[: 4 * n].view(torch.float32).zero_()
            positions, kept = t.entries
            first, last = torch.searchsorted(positions, torch.tensor([start, stop])).tolist()
            values[positions[first:last] - start] = kept[first:last]
            return values  # the parser checked the kept values are finite
        if t.codec == pb.CODEC_FP32:
            self._copy(self._raw_np, t.payload, 4 * start, 4 * n)
            values = self.raw[: 4 * n].view(torch.float32)
        elif t.codec == pb.CODEC_BF16:
            self._copy(self._raw_np, t.payload, 2 * start, 2 * n)
            values = self.raw[: 2 * n].view(torch.bfloat16).float()
        else:
            n_bytes, n_scales = (n + 1) // 2, (n + FP4_BLOCK - 1) // FP4_BLOCK
            self._copy(self._raw_np, t.payload, start // 2, n_bytes)
            self._copy(self._scales_np, t.scales, start // FP4_BLOCK, n_scales)
            # Refuses a value that decodes to infinity, as codec.decode_values does.
            return dequantize_fp4(self.raw[:n_bytes], self.scales[:n_scales], n, t.codec)
        low, high = torch.aminmax(values)  # NaN and infinities propagate to the extremes
        if not (math.isfinite(float(low)) and math.isfinite(float(high))):
            raise InvalidArgument(NOT_FINITE)
        return values

    @staticmethod
    def _copy(dest: np.ndarray, source: bytes, offset: int, count: int) -> None:
        dest[:count] = np.frombuffer(source, dtype=np.uint8, count=count, offset=offset)


class PushBody:
    """A validated push: its tensors in wire encoding, their norm and largest magnitude.

    `add_to` decodes it into a round's sums; it uses the slot's scratch, so it is valid only
    while the slot that parsed it is held.
    """

    def __init__(
        self,
        tensors: list[WireTensor],
        scratch: _Scratch,
        squares: float,
        max_abs: float,
        kernel: native.Kernel | None = None,
        hold: Hold | None = None,
    ) -> None:
        self._tensors, self._scratch, self._kernel = tensors, scratch, kernel
        self.shapes = [t.shape for t in tensors]
        self.norm = math.sqrt(squares)  # float64 sum of squares, as the NormGuard wants
        self.max_abs = max_abs
        self._hold, self._release = hold, None

    def sent_positions(self) -> list[torch.Tensor | None]:
        """Per tensor, the flat positions of the values it sent (a sparse tensor's nonzero
        kept values), or None for a dense tensor's every value (round.SenderWeights)."""
        entries = [t.entries for t in self._tensors]
        return [None if e is None else e[0][e[1] != 0] for e in entries]

    def defer(self) -> bool:
        """Keep this push's bytes past its call, to be added later with others in one pass
        (add_in_turn); False when it cannot be: not all fp4 through the kernel, or its
        receive buffer may not be held (server/rpc/receive.py PushBudget.hold). A deferred
        body is valid until add_in_turn releases it."""
        if self._hold is None or self._release is not None or not self.combinable():
            return False
        self._release = self._hold()
        return self._release is not None

    def combinable(self) -> bool:
        """Whether the kernel can add it together with others (Kernel.accumulate_many)."""
        return (
            self._kernel is not None
            and self._kernel.torch_add_mode() is not None
            and all(t.codec in FP4_GRIDS for t in self._tensors)
        )

    def kernel_adds(self, scale: float) -> list[native.FP4Add]:
        """Per tensor, what Kernel.accumulate_many adds of it (a combinable body)."""
        assert self._kernel is not None  # combinable() checked
        mode = self._kernel.torch_add_mode()
        assert mode is not None
        return [
            native.FP4Add(t.payload, t.scales, FP4_GRIDS[t.codec], scale, mode)
            for t in self._tensors
        ]

    def release(self) -> None:
        """Give a deferred body's receive buffer back (nothing for one not deferred)."""
        if self._release is not None:
            self._release()
            self._release = None

    def add_to(
        self, sums: list[torch.Tensor] | None, scale: float, overwrite: bool = False
    ) -> list[torch.Tensor]:
        """sums += scale·Δ (sums = scale·Δ with `overwrite`, in new tensors when None), the
        same float32 operations as `clone().mul_(scale)` and `add_(Δ, alpha=scale)` on whole
        tensors. `sums` must be contiguous."""
        first = sums is None or overwrite
        if sums is None:
            sums = [torch.empty(t.shape, dtype=torch.float32) for t in self._tensors]
        flats = {id(t): s.view(-1) for t, s in zip(self._tensors, sums, strict=True)}
        done = self._add_fp4_natively(flats, scale, first)
        for t, start, stop in self._chunks():
            if id(t) in done:
                continue
            values = self._scratch.chunk(t, start, stop)
            target = flats[id(t)][start:stop]
            if first:
                target.copy_(values)
                if scale != 1.0:
                    target.mul_(scale)
            else:
                target.add_(values, alpha=scale)
        return sums

    def _add_fp4_natively(
        self, flats: dict[int, torch.Tensor], scale: float, first: bool
    ) -> set[int]:
        """Add the fp4 tensors with the kernel where it matches torch bit for bit; returns
        the ids of the tensors it added (the others take the torch path)."""
        add_mode = self._kernel.torch_add_mode() if self._kernel is not None else None
        if add_mode is None:
            return set()
        mode, done = (native.ACC_SET if first else add_mode), set()
        for t in self._tensors:
            if t.codec in FP4_GRIDS and t.numel:
                grid = FP4_GRIDS[t.codec]
                status = self._kernel.accumulate(
                    t.payload, t.scales, t.numel, grid, scale, mode, flats[id(t)]
                )
                if status != 0:  # parse() checked these very bytes: a bug, not bad input
                    raise RuntimeError(f"fp4 accumulate failed on checked bytes ({status})")
                done.add(id(t))
        return done

    def _chunks(self) -> Iterator[tuple[WireTensor, int, int]]:
        for t in self._tensors:
            for start, stop in _spans(t.numel):
                yield t, start, stop


def add_in_turn(pushes: Sequence[tuple[PushBody | DenseBody, float]], sums: list[torch.Tensor]):
    """sums += scale·Δ for each (body, scale) in order, bit-identical to their add_to one
    after another, then release the deferred ones' buffers. Consecutive fp4 pushes go
    through the kernel in one pass over each sum (Kernel.accumulate_many; see the module
    docstring)."""
    try:
        start = 0
        while start < len(pushes):
            stop = start + 1
            if pushes[start][0].combinable():
                while stop < len(pushes) and pushes[stop][0].combinable():
                    stop += 1
            if stop - start == 1:
                body, scale = pushes[start]
                body.add_to(sums, scale)
            else:
                _add_together(pushes[start:stop], sums)  # type: ignore[arg-type]
            start = stop
    finally:  # the budget gets the buffers back even if an add failed
        for body, _ in pushes:
            body.release()


def _add_together(pushes: Sequence[tuple[PushBody, float]], sums: list[torch.Tensor]):
    kernel = native.load()
    assert kernel is not None  # combinable() bodies were parsed with it
    per_push = [body.kernel_adds(scale) for body, scale in pushes]
    for i, target in enumerate(sums):
        parts = [adds[i] for adds in per_push]
        status = kernel.accumulate_many(parts, target.numel(), target.view(-1))
        if status != 0:  # parse() checked these very bytes: a bug, not bad input
            raise RuntimeError(f"fp4 accumulate failed on checked bytes ({status})")


def _spans(numel: int) -> Iterator[tuple[int, int]]:
    for start in range(0, numel, CHUNK_VALUES):
        yield start, min(start + CHUNK_VALUES, numel)


def _value_stats(
    t: WireTensor, scratch: _Scratch, kernel: native.Kernel | None
) -> tuple[float, float]:
    """(sum of squares in float64, largest magnitude) of a checked tensor's values, in one
    kernel pass for fp4 or else a chunk at a time; raises InvalidArgument for a value that is
    not finite."""
    if kernel is not None and t.codec in FP4_GRIDS:
        status, squares, max_abs = kernel.stats(t.payload, t.scales, t.numel, FP4_GRIDS[t.codec])
        if status < 0:  # parse_fragment refused NaN scales: a bug, not bad input
            raise RuntimeError(f"fp4 stats failed on checked scales ({status})")
        if status > 0:
            raise InvalidArgument(NOT_FINITE)
        return squares, max_abs
    if t.entries is not None:  # sparse: only the kept values count
        kept = t.entries[1]
        if not kept.numel():
            return 0.0, 0.0
        return float(kept.double().square().sum()), float(kept.abs().max())
    squares, max_abs = 0.0, 0.0
    for start, stop in _spans(t.numel):
        values = scratch.chunk(t, start, stop)
        low, high = torch.aminmax(values)
        max_abs = max(max_abs, -float(low), float(high))
        wide = scratch.wide[: stop - start]
        wide.copy_(values)
        squares += float(torch.dot(wide, wide))
    return squares, max_abs


class IngestSlot:
    """Scratch for one push at a time; see IngestSlots."""

    def __init__(self) -> None:
        self._scratch = _Scratch()

    def parse(
        self,
        data: bytes | bytearray | memoryview,
        shapes: Sequence[tuple[int, ...]],
        release: bool = False,
        hold: Hold | None = None,
    ) -> PushBody:
        """Check a serialized EncodedFragment against the fragment's shapes and read its norm
        and largest magnitude; raises InvalidArgument as decode_fragment does.

        A memoryview (a receive buffer, server/rpc/receive.py) is read in place: the body's
        tensors are views of it, valid while it is. With `release`, a bytearray `data` is
        emptied once protobuf has parsed (copied) it. `hold` keeps `data` valid past the
        call for a deferred add (PushBody.defer)."""
        kernel = native.load()
        tensors, squares, max_abs = [], 0.0, 0.0
        checked = (
            parse_fragment_view(data, shapes)
            if isinstance(data, memoryview)
            else parse_fragment(data, shapes, release=release)
        )
        for t in checked:
            # Its values before the next tensor is checked, as decode_fragment reads them.
            tensor_squares, tensor_max = _value_stats(t, self._scratch, kernel)
            tensors.append(t)
            squares, max_abs = squares + tensor_squares, max(max_abs, tensor_max)
        return PushBody(tensors, self._scratch, squares, max_abs, kernel, hold)


class IngestSlots:
    """At most `count` pushes are received, checked and added at once; the rest wait for a
    slot before reading their payload, so what the server buffers is bounded by `count`
    payloads (plus gRPC's flow-control window per waiting stream), not by the learners."""

    def __init__(self, count: int) -> None:
        if count < 1:
            raise ValueError(f"ingest slot count must be >= 1, got {count}")
        self.count = count
        self._free: queue.SimpleQueue[IngestSlot] = queue.SimpleQueue()
        for _ in range(count):
            self._free.put(IngestSlot())

    @contextlib.contextmanager
    def take(self) -> Iterator[IngestSlot]:
        slot = self._free.get()
        try:
            yield slot
        finally:
            self._free.put(slot)


class DenseBody:
    """A push already decoded to tensors (in-process callers, tests): the same interface as
    PushBody, with the norm and magnitude computed on the whole tensors. `sparse`: a sparse
    push decoded, whose values count as sent where they are not zero."""

    def __init__(self, tensors: Sequence[torch.Tensor], sparse: bool = False) -> None:
        self._tensors, self._sparse = list(tensors), sparse
        self.shapes = [tuple(t.shape) for t in self._tensors]
        self.max_abs = 0.0
        for t in self._tensors:
            largest = float(t.abs().max()) if t.numel() else 0.0
            if largest > self.max_abs:  # a NaN never wins: the norm check refuses it
                self.max_abs = largest
        self.norm = math.sqrt(sum(float(t.double().square().sum()) for t in self._tensors))

    def sent_positions(self) -> list[torch.Tensor | None]:
        """As PushBody.sent_positions."""
        return [t.reshape(-1).nonzero().view(-1) if self._sparse else None for t in self._tensors]

    def defer(self) -> bool:
        """Always False: a dense body is added as it comes (see PushBody.defer)."""
        return False

    def combinable(self) -> bool:
        return False

    def release(self) -> None:
        """Nothing to give back (see PushBody.release)."""

    def add_to(
        self, sums: list[torch.Tensor] | None, scale: float, overwrite: bool = False
    ) -> list[torch.Tensor]:
        """sums += scale·Δ (sums = scale·Δ with `overwrite`, in new tensors when None)."""
        if sums is None or overwrite:
            if sums is None:
                sums = [torch.empty(t.shape, dtype=torch.float32) for t in self._tensors]
            for acc, t in zip(sums, self._tensors, strict=True):
                acc.copy_(t.detach())
                if scale != 1.0:
                    acc.mul_(scale)
            return sums
        for acc, t in zip(sums, self._tensors, strict=True):
            acc.add_(t, alpha=scale)
        return sums
