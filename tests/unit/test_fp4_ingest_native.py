"""The C kernel's ingest functions (fp4_stats, fp4_accumulate) against the torch path: the same
refusals, the same max |value|, the same norm up to summation order, and sums bit-identical to
torch's own `mul_` / `add_(alpha=)` in this process."""

import os
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

from common.codec import native
from common.codec.fp4 import E8M0_BIAS, FP4_GRIDS, dequantize_fp4
from common.codec.fragment import decode_fragment, encode_fragment
from common.codec.tensor import encode
from common.errors import InvalidArgument
from common.generated.diloco.v1 import aggregator_pb2 as pb
from server.rounds.ingest import CHUNK_VALUES, DenseBody, IngestSlot

ROOT = Path(__file__).resolve().parents[2]
CODECS = [pb.CODEC_FP4_E2M1, pb.CODEC_FP4_E3M0]
WEIGHTS = [1.0, 0.37, 0.3701, 1 / 3, 2.5e-7, 7.77e5]  # 0.37: exact products


@pytest.fixture(scope="module")
def kernel() -> native.Kernel:
    kernel = native.load()
    assert kernel is not None, "the C kernel must build on the CI machine"
    return kernel


def packed_values(numel: int, seed: int, scale_low: int = 0, scale_high: int = 253):
    """Random codes under random scale bytes in [scale_low, scale_high), as bytes and tensors."""
    gen = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, ((numel + 1) // 2,), generator=gen, dtype=torch.uint8)
    scales = torch.randint(scale_low, scale_high, ((numel + 31) // 32,), generator=gen)
    return packed, scales.to(torch.uint8)


def reference_values(packed: torch.Tensor, scales: torch.Tensor, numel: int, codec: int):
    """The decoded float32 values, computed independently of both implementations."""
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=1).reshape(-1)[:numel].long()
    magnitudes = FP4_GRIDS[codec][codes & 7]
    exps = (scales.long() - E8M0_BIAS).repeat_interleave(32)[:numel].float()
    return torch.ldexp(torch.where(codes >= 8, -magnitudes, magnitudes), exps)


def as_bytes(t: torch.Tensor) -> bytes:
    return t.numpy().tobytes()


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("numel", [1, 31, 32, 33, 1001, 18_001])
def test_stats_are_the_decoded_values_stats(kernel, codec: int, numel: int) -> None:
    # Every scale byte but NaN, so subnormal scales (byte 0) and overflowing blocks occur.
    packed, scales = packed_values(numel, numel, 0, 255)
    values = reference_values(packed, scales, numel, codec)
    status, squares, max_abs = kernel.stats(
        as_bytes(packed), as_bytes(scales), numel, FP4_GRIDS[codec]
    )
    assert status == int(torch.isinf(values).sum())
    finite = packed_values(numel, numel, 0, 253)  # byte 253 can overflow E2M1's top codes
    values = reference_values(*finite, numel, codec)
    assert torch.isfinite(values).all()
    status, squares, max_abs = kernel.stats(
        as_bytes(finite[0]), as_bytes(finite[1]), numel, FP4_GRIDS[codec]
    )
    assert status == 0
    assert max_abs == float(values.abs().max())  # exact, not approximately
    assert squares == pytest.approx(float(values.double().square().sum()), rel=1e-12)


def test_a_nan_scale_anywhere_wins_over_an_earlier_infinity(kernel) -> None:
    packed = torch.full((64,), 0x77, dtype=torch.uint8)  # codes 6.0: infinite at byte 254
    scales = torch.tensor([254, 120, 120, 255], dtype=torch.uint8)
    grid = FP4_GRIDS[pb.CODEC_FP4_E2M1]
    assert kernel.stats(as_bytes(packed), as_bytes(scales), 128, grid)[0] == -1
    assert kernel.stats(as_bytes(packed), as_bytes(scales[:3]), 96, grid)[0] == 32
    out = torch.zeros(128)
    status = kernel.accumulate(as_bytes(packed), as_bytes(scales), 128, grid, 1.0, 1, out)
    assert status == -1 and not out.any()


@pytest.mark.parametrize("kind", ["native", "torch"])
def test_opposite_infinities_in_one_block_are_refused(monkeypatch, kernel, kind: str) -> None:
    # Regression: the kernel summed C's isinf(), which is -1 for -inf, so +inf and -inf in
    # one block cancelled and fp4_dequantize accepted them.
    monkeypatch.setenv("DILOCO_FP4_KERNEL", kind)
    packed = torch.zeros(16, dtype=torch.uint8)
    packed[0] = 0xF7  # +6.0 and -6.0 times 2^127
    scales = torch.tensor([254], dtype=torch.uint8)
    with pytest.raises(InvalidArgument, match="infinite"):
        dequantize_fp4(packed, scales, 32)
    grid = FP4_GRIDS[pb.CODEC_FP4_E2M1]
    assert kernel.stats(as_bytes(packed), as_bytes(scales), 32, grid)[0] == 2


def test_the_padding_nibble_of_an_odd_count_is_ignored_and_nothing_is_written_past_n(
    kernel,
) -> None:
    numel = 33
    packed, scales = packed_values(numel, 3, 120, 130)
    packed[-1] &= 0x0F
    forged = packed.clone()
    forged[-1] |= 0x70  # the unused high nibble: a 6.0 that is not part of the tensor
    grid = FP4_GRIDS[pb.CODEC_FP4_E2M1]
    assert kernel.stats(as_bytes(packed), as_bytes(scales), numel, grid) == kernel.stats(
        as_bytes(forged), as_bytes(scales), numel, grid
    )
    guarded = torch.full((numel + 1,), 5.0)
    kernel.accumulate(as_bytes(forged), as_bytes(scales), numel, grid, 1.0, 0, guarded[:numel])
    assert guarded[numel] == 5.0
    assert torch.equal(guarded[:numel], reference_values(packed, scales, numel, pb.CODEC_FP4_E2M1))


@pytest.fixture(params=[native.ISA_PORTABLE, native.ISA_AVX2, native.ISA_AVX512])
def isa(kernel, request):
    """Each of fp4_accumulate's paths that this CPU runs (the others are skipped)."""
    if request.param > kernel.widest_isa():
        pytest.skip("this CPU lacks that instruction set")
    previous = kernel.limit_isa(request.param)
    yield request.param
    kernel.limit_isa(previous)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("numel", [1, 33, 4099])
def test_accumulate_is_torchs_arithmetic_bit_for_bit(kernel, isa, codec: int, numel: int) -> None:
    packed, scales = packed_values(numel, 11 + numel, 120, 135)
    values = reference_values(packed, scales, numel, codec)
    args = (as_bytes(packed), as_bytes(scales), numel, FP4_GRIDS[codec])
    gen = torch.Generator().manual_seed(numel)
    for weight in WEIGHTS:
        # Sums the size of the products, so FMA and multiply-then-add round differently.
        exps = torch.randint(-3, 3, (numel,), generator=gen).float()
        start = torch.ldexp(torch.randn(numel, generator=gen) * weight, exps)
        got = torch.empty(numel)
        assert kernel.accumulate(*args, weight, native.ACC_SET, got) == 0
        assert torch.equal(got.view(torch.int32), (values * weight).view(torch.int32))
        w32 = torch.tensor(weight, dtype=torch.float32)
        got = start.clone()
        kernel.accumulate(*args, weight, native.ACC_ADD_MUL, got)
        assert torch.equal(got.view(torch.int32), (start + values * w32).view(torch.int32))
        got = start.clone()
        kernel.accumulate(*args, weight, kernel.torch_add_mode(), got)
        torch_sum = start.clone().add_(values, alpha=weight)
        assert torch.equal(got.view(torch.int32), torch_sum.view(torch.int32))


def test_the_probe_finds_a_mode_and_the_two_add_modes_differ(kernel) -> None:
    assert kernel.torch_add_mode() in (native.ACC_ADD_FMA, native.ACC_ADD_MUL)
    packed, scales = packed_values(4099, 5, 124, 130)
    args = (as_bytes(packed), as_bytes(scales), 4099, FP4_GRIDS[pb.CODEC_FP4_E2M1], 1 / 3)
    fused = torch.randn(4099)
    separate = fused.clone()
    kernel.accumulate(*args, native.ACC_ADD_FMA, fused)
    kernel.accumulate(*args, native.ACC_ADD_MUL, separate)
    assert not torch.equal(fused, separate)  # else the probe could not tell them apart


def test_an_unknown_instruction_set_limit_is_refused(kernel) -> None:
    with pytest.raises(ValueError, match="instruction set limit 3"):
        kernel.limit_isa(3)


def test_short_buffers_and_bad_outputs_are_refused_before_the_c_call(kernel) -> None:
    grid = FP4_GRIDS[pb.CODEC_FP4_E2M1]
    with pytest.raises(ValueError, match="payload"):
        kernel.stats(b"\x00" * 16, b"\x7f", 33, grid)
    with pytest.raises(ValueError, match="contiguous float32"):
        kernel.accumulate(b"\x00" * 16, b"\x7f", 32, grid, 1.0, 1, torch.zeros(32).double())
    with pytest.raises(ValueError, match="mode"):
        kernel.accumulate(b"\x00" * 16, b"\x7f", 32, grid, 1.0, 9, torch.zeros(32))


SHAPES = [(3, 20_001), (5,), (64, 33)]


def _pushes(codec: str) -> list[bytes]:
    gens = [torch.Generator().manual_seed(seed) for seed in (1, 2, 3)]
    return [
        encode_fragment([torch.randn(s, generator=g) * 1e-3 for s in SHAPES], codec) for g in gens
    ]


def _ingest_sums(pushes: list[bytes]) -> tuple[list[torch.Tensor], float, float]:
    """The round's sums, summed norms and largest magnitude after three pushes, checking
    each push's norm and magnitude against the decoded tensors'."""
    shapes, slot, sums, norm, max_abs = SHAPES, IngestSlot(), None, 0.0, 0.0
    for data, scale in zip(pushes, [0.37, 1.0, 1 / 3], strict=True):
        body = slot.parse(data, shapes)
        dense = DenseBody(decode_fragment(data, shapes))
        assert body.max_abs == dense.max_abs
        assert body.norm == pytest.approx(dense.norm, rel=1e-12)
        sums = body.add_to(sums, scale)
        norm, max_abs = norm + body.norm, max(max_abs, body.max_abs)
    return sums, norm, max_abs


@pytest.mark.parametrize("codec", ["fp4_e2m1", "fp4_e3m0"])
def test_ingest_with_the_kernel_equals_the_torch_path(monkeypatch, codec: str) -> None:
    pushes = _pushes(codec)
    monkeypatch.setenv("DILOCO_FP4_KERNEL", "torch")
    ref_sums, ref_norm, ref_max = _ingest_sums(pushes)
    monkeypatch.setenv("DILOCO_FP4_KERNEL", "native")
    sums, norm, max_abs = _ingest_sums(pushes)
    for a, b in zip(ref_sums, sums, strict=True):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    assert max_abs == ref_max and norm == pytest.approx(ref_norm, rel=1e-12)


@pytest.mark.parametrize("kind", ["native", "torch"])
def test_ingest_refuses_a_nan_scale_after_an_infinity_like_decode_fragment(
    monkeypatch, kind: str
) -> None:
    monkeypatch.setenv("DILOCO_FP4_KERNEL", kind)
    shape = (2, CHUNK_VALUES)  # the torch path reads it in two chunks
    t = torch.randn(shape) * 1e-3
    msg = encode(t, "fp4_e2m1")
    payload, scales = bytearray(msg.payload), bytearray(msg.scales)
    scales[0], payload[0] = 254, 0x77  # infinite values in the first block
    scales[-1] = 255  # a NaN scale in the last: decode reports the NaN
    forged = pb.EncodedTensor(codec=msg.codec, shape=msg.shape, payload=bytes(payload))
    forged.scales = bytes(scales)
    forged.crc32 = zlib.crc32(forged.scales, zlib.crc32(forged.payload))
    data = pb.EncodedFragment(tensors=[forged]).SerializeToString()
    with pytest.raises(InvalidArgument) as decoded:
        decode_fragment(data, [shape])
    with pytest.raises(InvalidArgument) as ingested:
        IngestSlot().parse(data, [shape])
    assert "NaN" in str(decoded.value) and str(ingested.value) == str(decoded.value)


def test_torch_baseline_kernels_select_the_multiply_then_add_mode() -> None:
    """Torch's baseline CPU kernels do not fuse the multiply-add: the probe must see that and
    the ingest sums must still equal torch's (a fresh process, as the capability is fixed at
    torch's start)."""
    script = (
        "from common.codec import native\n"
        "from tests.unit.test_fp4_ingest_native import _ingest_sums, _pushes\n"
        "import torch, os\n"
        "assert native.load().torch_add_mode() == native.ACC_ADD_MUL\n"
        "pushes = _pushes('fp4_e2m1')\n"
        "os.environ['DILOCO_FP4_KERNEL'] = 'torch'\n"
        "ref = _ingest_sums(pushes)[0]\n"
        "os.environ['DILOCO_FP4_KERNEL'] = 'native'\n"
        "got = _ingest_sums(pushes)[0]\n"
        "assert all(torch.equal(a.view(torch.int32), b.view(torch.int32))"
        " for a, b in zip(ref, got))\n"
    )
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default", "PYTHONPATH": str(ROOT)}
    env.pop("DILOCO_FP4_KERNEL", None)
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, timeout=120
    )
    assert done.returncode == 0, done.stderr.decode()[-2000:]


def test_a_grid_without_exact_square_units_is_refused(kernel) -> None:
    grid = torch.tensor([0.0, 0.1, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # 0.1 is no binary fraction
    with pytest.raises(ValueError, match="grid squares"):
        kernel.stats(b"\x00" * 16, b"\x7f", 32, grid)
