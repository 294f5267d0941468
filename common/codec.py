"""Tensor codecs for the wire: fp32, bf16 and OCP MX FP4 (E2M1 values, E8M0 block scales).

    from common.codec import encode, decode
    wire = encode(torch.randn(3, 100), "fp4_e2m1")   # an EncodedTensor message
    approx = decode(wire)                              # float32, shape (3, 100)

FP4 (E2M1) represents 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives. Values are cut into
blocks of 32 along the flattened tensor; each block shares one power-of-two scale 2^e stored as
an E8M0 byte (e + 127). Codes are packed two per byte, element 0 in the low nibble, rounded to
the nearest representable value with ties to the even code.

Scale rule: we use the smallest power of two with amax <= 6 * 2^e (that is 2^ceil(log2(amax/6))),
not the OCP rule 2^(floor(log2 amax) - 2). The OCP rule clips values between 6 and 8 times the
scale to 6; ours never clips, so the error of every element is bounded by a quarter of its
own magnitude or of the scale: |x - q(x)| <= max(|x|, 2^e) / 4 (see tests/unit/test_codec.py).
The price is a coarser grid for blocks whose amax lies just above a power of two. A block of
zeros gets the smallest scale, 2^-127. Blocks within a factor 4 of float32's maximum cap
their top codes so that nothing decodes to infinity (the bound above still holds).
Non-finite inputs are refused, never encoded.
"""

from __future__ import annotations

import math
import zlib

import torch

from common.errors import InvalidArgument
from common.generated.diloco.v1 import aggregator_pb2 as pb

FP4_BLOCK = 32
E8M0_BIAS = 127
E8M0_NAN = 255
MIN_SCALE_EXP = -127  # the smallest E8M0 scale; 2^-127 is a float32 subnormal, still exact

# Magnitudes of the 8 non-negative E2M1 codes, and the midpoints between neighbours.
FP4_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
_FP4_MIDPOINTS = (FP4_VALUES[1:] + FP4_VALUES[:-1]) / 2

CODECS = {
    "fp32": pb.CODEC_FP32,
    "bf16": pb.CODEC_BF16,
    "fp4_e2m1": pb.CODEC_FP4_E2M1,
}
CODEC_NAMES = {value: name for name, value in CODECS.items()}


def codec_id(name: str) -> int:
    """The wire enum of a codec name; raises ValueError naming the valid choices."""
    if name not in CODECS:
        raise ValueError(f"unknown codec {name!r}; choose one of {', '.join(CODECS)}")
    return CODECS[name]


def encoded_sizes(codec: int, numel: int) -> tuple[int, int]:
    """Exact (payload, scales) byte lengths of a tensor of `numel` elements in `codec`."""
    if codec == pb.CODEC_FP32:
        return 4 * numel, 0
    if codec == pb.CODEC_BF16:
        return 2 * numel, 0
    if codec == pb.CODEC_FP4_E2M1:
        return (numel + 1) // 2, (numel + FP4_BLOCK - 1) // FP4_BLOCK
    raise InvalidArgument(f"unknown codec {codec}")


def encode(tensor: torch.Tensor, codec: str | int) -> pb.EncodedTensor:
    """Encode a floating-point tensor of any shape; raises ValueError on non-finite values."""
    codec = codec_id(codec) if isinstance(codec, str) else codec
    flat = tensor.detach().reshape(-1).to(device="cpu", dtype=torch.float32)
    if not bool(torch.isfinite(flat).all()):
        raise ValueError("cannot encode a tensor with NaN or infinite values")
    if codec == pb.CODEC_FP32:
        payload, scales = flat.numpy().tobytes(), b""
    elif codec == pb.CODEC_BF16:
        # bfloat16 has no numpy dtype: reinterpret the rounded bits as int16 to serialize.
        payload, scales = flat.to(torch.bfloat16).view(torch.int16).numpy().tobytes(), b""
    elif codec == pb.CODEC_FP4_E2M1:
        payload, scales = _encode_fp4(flat)
    else:
        raise ValueError(f"unknown codec {codec}")
    return pb.EncodedTensor(
        codec=codec,
        shape=list(tensor.shape),
        payload=payload,
        scales=scales,
        crc32=zlib.crc32(scales, zlib.crc32(payload)),
    )


def decode(msg: pb.EncodedTensor, expected_shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """Decode to float32 after checking codec, shape, lengths, checksum and scales.

    Raises InvalidArgument (nothing allocated in proportion to the claimed size) when any
    field is inconsistent, so a decoder fed garbage fails cleanly.
    """
    shape = tuple(msg.shape)
    if any(dim < 0 for dim in shape):
        raise InvalidArgument(f"negative dimension in shape {shape}")
    if expected_shape is not None and shape != tuple(expected_shape):
        raise InvalidArgument(f"shape {shape} does not match expected {tuple(expected_shape)}")
    numel = math.prod(shape)
    payload_len, scales_len = encoded_sizes(msg.codec, numel)
    if len(msg.payload) != payload_len or len(msg.scales) != scales_len:
        raise InvalidArgument(
            f"{CODEC_NAMES.get(msg.codec)} tensor of shape {shape} needs {payload_len} payload "
            f"and {scales_len} scale bytes, got {len(msg.payload)} and {len(msg.scales)}"
        )
    if zlib.crc32(msg.scales, zlib.crc32(msg.payload)) != msg.crc32:
        raise InvalidArgument("tensor checksum mismatch")
    if numel == 0:
        return torch.zeros(shape, dtype=torch.float32)
    if msg.codec == pb.CODEC_FP32:
        flat = torch.frombuffer(bytearray(msg.payload), dtype=torch.float32)
    elif msg.codec == pb.CODEC_BF16:
        flat = torch.frombuffer(bytearray(msg.payload), dtype=torch.bfloat16).float()
    else:
        flat = _decode_fp4(msg.payload, msg.scales, numel)
    if not bool(torch.isfinite(flat).all()):
        raise InvalidArgument("tensor holds NaN or infinite values")
    return flat.reshape(shape)


def _block_scale_exponents(blocks: torch.Tensor) -> torch.Tensor:
    """Per block (rows of `blocks`), the smallest e with amax <= 6 * 2^e, clamped to E8M0.

    Exact integer logic via frexp: amax = m * 2^E with m in [0.5, 1); then amax <= 6 * 2^e
    holds first at e = E - 3 when m <= 0.75 and at e = E - 2 otherwise.
    """
    amax = blocks.abs().amax(dim=1)
    mantissa, exponent = torch.frexp(amax)
    exps = torch.where(mantissa <= 0.75, exponent - 3, exponent - 2).to(torch.int32)
    exps = torch.where(amax == 0, torch.full_like(exps, MIN_SCALE_EXP), exps)
    return exps.clamp(MIN_SCALE_EXP, E8M0_NAN - 1 - E8M0_BIAS)


def _encode_fp4(flat: torch.Tensor) -> tuple[bytes, bytes]:
    numel = flat.numel()
    n_blocks = (numel + FP4_BLOCK - 1) // FP4_BLOCK
    padded = torch.zeros(n_blocks * FP4_BLOCK, dtype=torch.float32)
    padded[:numel] = flat
    blocks = padded.view(n_blocks, FP4_BLOCK)
    exps = _block_scale_exponents(blocks)
    # ldexp by a power of two is exact (no rounding) unless the result underflows, and values
    # that small round to code 0 anyway.
    scaled = torch.ldexp(blocks, (-exps).unsqueeze(1).float()).abs().reshape(-1)
    lower = torch.bucketize(scaled, _FP4_MIDPOINTS, right=False)
    upper = torch.bucketize(scaled, _FP4_MIDPOINTS, right=True)
    # lower != upper exactly at a midpoint: ties go to the even code.
    codes = torch.where(lower % 2 == 0, lower, upper)
    # Near float32's maximum, rounding up would decode to infinity: cap the code instead
    # (6 * 2^125 is the last full grid; at 2^126 the top is 3, at 2^127 it is 1.5).
    top_code = torch.where(exps == 127, 3, torch.where(exps == 126, 5, 7))
    codes = torch.minimum(codes, top_code.repeat_interleave(FP4_BLOCK)).to(torch.uint8)
    codes |= (padded < 0).to(torch.uint8) << 3
    codes = codes[: numel + (numel % 2)]  # drop block padding but keep an even count
    packed = codes[0::2] | (codes[1::2] << 4)
    scales = (exps + E8M0_BIAS).to(torch.uint8)
    return packed.numpy().tobytes(), scales.numpy().tobytes()


def _decode_fp4(payload: bytes, scales: bytes, numel: int) -> torch.Tensor:
    scale_bytes = torch.frombuffer(bytearray(scales), dtype=torch.uint8)
    if bool((scale_bytes == E8M0_NAN).any()):
        raise InvalidArgument("FP4 block scale is NaN (E8M0 byte 255)")
    packed = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=1).reshape(-1)[:numel].long()
    magnitudes = FP4_VALUES[codes & 0x7]
    values = torch.where(codes >= 8, -magnitudes, magnitudes)
    exps = scale_bytes.to(torch.int32) - E8M0_BIAS
    per_element = exps.repeat_interleave(FP4_BLOCK)[:numel].float()
    return torch.ldexp(values, per_element)
