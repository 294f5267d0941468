"""The C FP4 kernel gives exactly the bytes and values of the pure-torch codec."""

import logging

import pytest
import torch

from common.codec import native
from common.codec.fp4 import FP4_BLOCK, FP4_GRIDS, dequantize_fp4, quantize_fp4
from common.errors import InvalidArgument
from common.generated.diloco.v1 import aggregator_pb2 as pb

F32_MAX = torch.finfo(torch.float32).max
F32_TINY = torch.finfo(torch.float32).tiny  # smallest normal; subnormals lie below


@pytest.fixture
def use(monkeypatch):
    """Select the implementation for the next codec calls: "native" or "torch"."""

    def select(kind: str) -> None:
        monkeypatch.setenv("DILOCO_FP4_KERNEL", kind)

    return select


def hard_values(seed: int) -> torch.Tensor:
    """Random values across the whole float32 range plus every edge the codec special-cases."""
    gen = torch.Generator().manual_seed(seed)
    parts = [
        torch.randn(10_000, generator=gen),
        torch.randn(3_000, generator=gen) * 1e-40,  # subnormal blocks
        torch.randn(3_000, generator=gen) * 3e38,  # blocks whose top codes are capped
        torch.ldexp(torch.ones(2_000), torch.randint(-149, 128, (2_000,), generator=gen)),
        torch.zeros(FP4_BLOCK * 3),  # an all-zero block gets the smallest scale
        torch.tensor([F32_MAX, -F32_MAX, F32_TINY, -0.0, 0.0, 1e-45, 6.0, 7.0, 5.0]),
    ]
    grid_points = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 3.0])
    parts.append(torch.cat([grid_points * 2.0**k for k in (-100, -3, 0, 7, 60)]))  # ties
    values = torch.cat(parts)
    return values[torch.randperm(values.numel(), generator=gen)]


@pytest.mark.parametrize("codec", [pb.CODEC_FP4_E2M1, pb.CODEC_FP4_E3M0])
@pytest.mark.parametrize("numel", [1, 31, 32, 33, 1001, 18_001])
def test_kernel_matches_torch_bit_for_bit(use, codec: int, numel: int) -> None:
    flat = hard_values(numel)[:numel].contiguous()
    use("native")
    assert native.load() is not None, "the C kernel must build on the CI machine"
    packed, scales = quantize_fp4(flat, codec)
    values = dequantize_fp4(packed, scales, numel, codec)
    use("torch")
    ref_packed, ref_scales = quantize_fp4(flat, codec)
    ref_values = dequantize_fp4(ref_packed, ref_scales, numel, codec)
    assert torch.equal(packed, ref_packed)
    assert torch.equal(scales, ref_scales)
    assert torch.equal(values.view(torch.int32), ref_values.view(torch.int32))  # -0.0 too


def test_every_code_and_scale_decodes_identically(use) -> None:
    # Each block of 16 bytes under each scale byte, 256 byte values in 16 blocks; scale bytes
    # from 253 up overflow for the top codes (tested for rejection below).
    packed = torch.arange(256, dtype=torch.uint8).repeat(253)
    scales = torch.arange(253, dtype=torch.uint8).repeat_interleave(16)
    numel = packed.numel() * 2
    for codec in FP4_GRIDS:
        use("native")
        values = dequantize_fp4(packed, scales, numel, codec)
        use("torch")
        ref = dequantize_fp4(packed, scales, numel, codec)
        assert torch.equal(values.view(torch.int32), ref.view(torch.int32))


@pytest.mark.parametrize("kind", ["native", "torch"])
def test_forged_blocks_are_rejected_by_both(use, kind: str) -> None:
    use(kind)
    top_code_block = torch.full((16,), 0x77, dtype=torch.uint8)  # code 7 = 6 x scale
    with pytest.raises(InvalidArgument, match="infinite"):
        dequantize_fp4(top_code_block, torch.tensor([254], dtype=torch.uint8), 32)
    with pytest.raises(InvalidArgument, match="NaN"):
        dequantize_fp4(top_code_block, torch.tensor([255], dtype=torch.uint8), 32)


def test_torch_path_is_announced_once(use, caplog) -> None:
    use("torch")
    native._loaded.pop("torch", None)
    with caplog.at_level(logging.INFO, logger="common.codec.native"):
        assert native.load() is None
        assert native.load() is None
    assert sum("pure-torch" in r.message for r in caplog.records) == 1


def test_unknown_kernel_choice_is_one_clear_error(use) -> None:
    use("fast")
    with pytest.raises(ValueError, match="DILOCO_FP4_KERNEL must be one of"):
        native.load()


def test_native_without_a_compiler_is_an_error(use, monkeypatch, tmp_path) -> None:
    use("native")
    monkeypatch.setenv("CC", "no-such-compiler")
    monkeypatch.setenv("DILOCO_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native, "_loaded", {})
    with pytest.raises(RuntimeError, match="no C compiler"):
        native.load()


def test_a_kernel_built_beforehand_needs_no_compiler(use, monkeypatch, tmp_path) -> None:
    """An image builds the kernel into DILOCO_CACHE_DIR and ships without a compiler."""
    use("native")
    monkeypatch.setenv("DILOCO_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native, "_loaded", {})
    assert native.load() is not None  # built here, with the compiler
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setattr(native.shutil, "which", lambda name: None)  # the compiler is gone
    assert native.load() is not None


def test_short_buffers_are_refused_not_read_past(use) -> None:
    use("native")
    with pytest.raises(ValueError, match="packed and 2 scale"):
        native.load().dequantize(
            torch.zeros(16, dtype=torch.uint8),
            torch.zeros(1, dtype=torch.uint8),
            64,
            FP4_GRIDS[pb.CODEC_FP4_E2M1],
        )
