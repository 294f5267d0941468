"""The two 4-bit block formats, fp4_e2m1 and fp4_e3m0 (a tensor's wire encoding: tensor.py).

    packed, scales = quantize_fp4(flat, pb.CODEC_FP4_E2M1)     # uint8 codes and E8M0 scales
    values = dequantize_fp4(packed, scales, flat.numel())       # float32

Both 4-bit formats cut the flattened tensor into blocks of 32 values that share one
power-of-two scale 2^e, stored as an E8M0 byte (e + 127). Each value is a sign bit and a
3-bit magnitude code; codes are packed two per byte, element 0 in the low nibble.

- `fp4_e2m1` (OCP MX FP4): magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 times the scale.
- `fp4_e3m0` (Streaming DiLoCo's format): no mantissa, 3 exponent bits. We give code 0 to
  zero and codes 1..7 to 2^-6 .. 2^0 times the scale (exponent bias 7), so a block spans
  six octaves below its largest value.

Scale rule: the smallest power of two with amax <= top * 2^e (top = 6 for E2M1, 1 for E3M0).
For E2M1 that is 2^ceil(log2(amax/6)), not the OCP rule 2^(floor(log2 amax) - 2): the OCP rule
clips values between 6 and 8 times the scale to 6; ours never clips, so every E2M1 element's
error is at most max(|x|, 2^e) / 4 (tests/unit/test_codec.py checks it). The price is a
coarser grid for blocks whose amax lies just above a power of two. A block of zeros gets the
smallest scale, 2^-127. Blocks within a factor 4 of float32's maximum cap their top codes so
that nothing decodes to infinity.

Rounding: to the nearest grid value with ties to the even code (default), or stochastic
(unbiased: rounds up with probability proportional to the distance from the lower value).
Non-finite inputs are refused, never encoded.

Devices: the 4-bit arithmetic runs where the tensor lives (a CUDA tensor is quantized on the
GPU and only the packed bytes cross to the host); `decode(..., device="cuda")` unpacks there.
The result is bit-identical on every device (bench/cuda_check.py checks it on a GPU).

CPU tensors rounded to nearest go through the C kernels (native.py), bit-identical to the
torch code here.
"""

from __future__ import annotations

import math

import torch

from common.codec import native
from common.errors import InvalidArgument
from common.generated.diloco.v1 import aggregator_pb2 as pb

FP4_BLOCK = 32  # values sharing one scale byte
E8M0_BIAS = 127
E8M0_NAN = 255  # the scale byte that means NaN: never valid on the wire
MIN_SCALE_EXP = -127  # the smallest E8M0 scale; 2^-127 is a float32 subnormal, still exact

# The refusals of bad values, in the words of every reader.
NOT_FINITE = "tensor holds NaN or infinite values"
NAN_SCALE = "FP4 block scale is NaN (E8M0 byte 255)"

F32_MAX = float(torch.finfo(torch.float32).max)
BF16_MAX = float(torch.finfo(torch.bfloat16).max)

# Magnitudes of the 8 non-negative codes of each 4-bit format, ascending.
FP4_GRIDS = {
    pb.CODEC_FP4_E2M1: torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]),
    pb.CODEC_FP4_E3M0: torch.tensor([0.0] + [2.0**k for k in range(-6, 1)]),
}
# Round-to-nearest boundaries between neighbouring grid values, as the torch path computes them.
FP4_MIDPOINTS = {codec: (grid[1:] + grid[:-1]) / 2 for codec, grid in FP4_GRIDS.items()}
ROUNDINGS = ("nearest", "stochastic")


def _block_scale_exponents(blocks: torch.Tensor, top: float) -> torch.Tensor:
    """Per block (rows of `blocks`), the smallest e with amax <= top * 2^e, clamped to E8M0.

    Exact integer logic: with amax = m * 2^E (frexp, m in [0.5, 1)) the answer is
    E - floor(log2 top) - 1 or one more; the comparison decides, in float64 where
    top * 2^e is exact.
    """
    amax = blocks.abs().amax(dim=1)
    _, exponent = torch.frexp(amax)
    exps = exponent.to(torch.int32) - (math.floor(math.log2(top)) + 1)
    limit = torch.ldexp(torch.full_like(amax, top, dtype=torch.float64), exps.double())
    exps = exps + (amax.double() > limit).to(torch.int32)
    exps = torch.where(amax == 0, torch.full_like(exps, MIN_SCALE_EXP), exps)
    return exps.clamp(MIN_SCALE_EXP, E8M0_NAN - 1 - E8M0_BIAS)


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every value is finite, in one pass and without a temporary: NaN and the
    infinities propagate to the extremes aminmax returns. A tenth of isfinite().all()'s
    time on 3 M values here (it writes a bool tensor first), which was half a push's encode."""
    if tensor.numel() == 0:
        return True
    low, high = torch.aminmax(tensor)
    return math.isfinite(float(low)) and math.isfinite(float(high))


def quantize_fp4(
    flat: torch.Tensor,
    codec: int = pb.CODEC_FP4_E2M1,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed codes and E8M0 scale bytes (uint8 tensors on flat's device) of a finite
    1-D float32 tensor; the wire bytes of `encode` are exactly these.

    CPU tensors rounded to nearest go through the C kernel where it is available
    (native.py); it returns the same bytes as the torch code below.
    """
    kernel = native.load() if flat.device.type == "cpu" and not stochastic else None
    if kernel is not None:
        grid = FP4_GRIDS[codec]
        top_shift = math.floor(math.log2(float(grid[-1]))) + 1
        return kernel.quantize(flat.contiguous(), grid, FP4_MIDPOINTS[codec], top_shift)
    numel = flat.numel()
    n_blocks = (numel + FP4_BLOCK - 1) // FP4_BLOCK
    padded = torch.zeros(n_blocks * FP4_BLOCK, dtype=torch.float32, device=flat.device)
    padded[:numel] = flat
    codes, exps = fp4_block_codes(padded.view(n_blocks, FP4_BLOCK), codec, stochastic, generator)
    codes = codes.reshape(-1)
    codes = codes[: numel + (numel % 2)]  # drop block padding but keep an even count
    packed = codes[0::2] | (codes[1::2] << 4)
    return packed, (exps + E8M0_BIAS).to(torch.uint8)


def fp4_block_codes(
    blocks: torch.Tensor,
    codec: int = pb.CODEC_FP4_E2M1,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The 4-bit codes (uint8, sign in bit 3, blocks' shape) and scale exponents (int32, one
    per row) of finite float32 `blocks`, each row sharing one scale: quantize_fp4's rule for
    blocks of any width (the sparse codec's chunks use it too, sparse.py)."""
    grid = FP4_GRIDS[codec].to(blocks.device)
    exps = _block_scale_exponents(blocks, float(grid[-1]))
    # ldexp by a power of two is exact (no rounding) unless the result underflows, and values
    # that small round to code 0 anyway.
    scaled = torch.ldexp(blocks, (-exps).unsqueeze(1).float()).abs()
    if stochastic:
        below = (torch.bucketize(scaled, grid, right=True) - 1).clamp(0, len(grid) - 2)
        low, high = grid[below], grid[below + 1]
        p_up = ((scaled - low) / (high - low)).clamp(0, 1)
        # Drawn on the generator's device (the CPU unless given a CUDA one), so a seed gives
        # the same codes wherever the tensor lives.
        draw_device = generator.device if generator is not None else blocks.device
        draw = torch.rand(scaled.shape, generator=generator, device=draw_device)
        codes = below + (draw.to(blocks.device) < p_up).long()
    else:
        midpoints = (grid[1:] + grid[:-1]) / 2
        lower = torch.bucketize(scaled, midpoints, right=False)
        upper = torch.bucketize(scaled, midpoints, right=True)
        # lower != upper exactly at a midpoint: ties go to the even code.
        codes = torch.where(lower % 2 == 0, lower, upper)
    # Near float32's maximum, rounding up could decode to infinity: cap the code instead.
    headroom = F32_MAX / torch.ldexp(torch.ones_like(exps, dtype=torch.float64), exps.double())
    top_code = torch.bucketize(headroom, grid.double(), right=True) - 1
    codes = torch.minimum(codes, top_code.unsqueeze(1)).to(torch.uint8)
    codes |= (blocks < 0).to(torch.uint8) << 3
    return codes, exps


def dequantize_fp4(
    packed: torch.Tensor, scale_bytes: torch.Tensor, numel: int, codec: int = pb.CODEC_FP4_E2M1
) -> torch.Tensor:
    """The float32 values (on packed's device) of `numel` packed codes with their scales.

    Raises InvalidArgument for a NaN scale byte or a value that decodes to infinity (a
    forged top code in a block scaled near float32's maximum).
    """
    kernel = native.load() if packed.device.type == "cpu" else None
    if kernel is not None:
        values, status = kernel.dequantize(
            packed.contiguous(), scale_bytes.contiguous(), numel, FP4_GRIDS[codec]
        )
        if status < 0:
            raise InvalidArgument(NAN_SCALE)
        if status > 0:
            raise InvalidArgument(NOT_FINITE)
        return values
    if bool((scale_bytes == E8M0_NAN).any()):
        raise InvalidArgument(NAN_SCALE)
    grid = FP4_GRIDS[codec].to(packed.device)
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=1).reshape(-1)[:numel].long()
    magnitudes = grid[codes & 0x7]
    values = torch.where(codes >= 8, -magnitudes, magnitudes)
    exps = scale_bytes.to(torch.int32) - E8M0_BIAS
    per_element = exps.repeat_interleave(FP4_BLOCK)[:numel].float()
    decoded = torch.ldexp(values, per_element)
    if not all_finite(decoded):
        raise InvalidArgument(NOT_FINITE)
    return decoded
