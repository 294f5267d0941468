"""Codec round trips, exact agreement with a plain reference, and worst-case error bounds."""

import math
import struct

import pytest
import torch

from common.codec.fp4 import FP4_BLOCK
from common.codec.tensor import decode, encode
from common.errors import InvalidArgument

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
E3M0 = [0.0] + [2.0**k for k in range(-6, 1)]
F32_MAX = struct.unpack("<f", b"\xff\xff\x7f\x7f")[0]


def reference_fp4(values: list[float], grid: list[float] = E2M1) -> list[float]:
    """Quantize element by element, in plain Python floats, the way the design specifies."""
    out = []
    for start in range(0, len(values), FP4_BLOCK):
        block = values[start : start + FP4_BLOCK]
        amax = max(abs(v) for v in block)
        exp = -127
        if amax > 0:
            exp = max(-127, math.ceil(math.log2(amax / grid[-1])))
            while amax > grid[-1] * 2.0**exp:  # guard log2 rounding
                exp += 1
            while exp > -127 and amax <= grid[-1] * 2.0 ** (exp - 1):
                exp -= 1
            exp = min(exp, 127)
        top = [v for v in grid if v * 2.0**exp <= F32_MAX]
        for v in block:
            scaled = abs(v) / 2.0**exp
            # nearest grid value, ties to the even code (index)
            best = min(range(len(top)), key=lambda i: (abs(top[i] - scaled), i % 2))
            out.append(math.copysign(top[best] * 2.0**exp, v) if v < 0 else top[best] * 2.0**exp)
    return out


def as_f32(values: list[float]) -> list[float]:
    return torch.tensor(values, dtype=torch.float32).tolist()


CASES = {
    "normal": torch.randn(1000, generator=torch.Generator().manual_seed(0)),
    "odd_size": torch.randn(37, generator=torch.Generator().manual_seed(1)) * 1e-3,
    "one": torch.tensor([0.7]),
    "zeros": torch.zeros(65),
    "ties": torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -2.5]),
    "huge": torch.tensor([3.4e38, -1.7e38, 1.0, 2.9e38, -3e37]),
    "tiny": torch.tensor([1e-44, -3e-39, 2.9e-39, 1e-30, 0.0]),
    "mixed_blocks": torch.cat([torch.randn(40) * 1e4, torch.randn(40) * 1e-4]),
}


@pytest.mark.parametrize("name", CASES)
def test_fp4_matches_reference_and_bound(name: str) -> None:
    x = CASES[name]
    msg = encode(x, "fp4_e2m1")
    y = decode(msg)
    assert y.shape == x.shape
    assert y.tolist() == as_f32(reference_fp4(x.tolist()))
    assert torch.isfinite(y).all()
    # Worst case: a quarter of the element's magnitude or of its block's scale.
    for start in range(0, x.numel(), FP4_BLOCK):
        xb, yb = x[start : start + FP4_BLOCK].double(), y[start : start + FP4_BLOCK].double()
        amax = xb.abs().max().item()
        scale = 2.0 ** max(-127, math.ceil(math.log2(amax / 6))) if amax > 0 else 2.0**-127
        bound = torch.maximum(xb.abs(), torch.full_like(xb, scale)) / 4
        assert ((xb - yb).abs() <= bound).all(), name


@pytest.mark.parametrize("name", [n for n in CASES if n != "huge"])
def test_fp4_e3m0_matches_reference(name: str) -> None:
    x = CASES[name]
    y = decode(encode(x, "fp4_e3m0"))
    assert y.tolist() == as_f32(reference_fp4(x.tolist(), E3M0))
    # Every decoded magnitude is zero or a power of two: no mantissa bits.
    nonzero = y[y != 0].abs()
    assert torch.equal(torch.frexp(nonzero).mantissa, torch.full_like(nonzero, 0.5))


@pytest.mark.parametrize("codec", ["fp4_e2m1", "fp4_e3m0"])
def test_stochastic_rounding_is_unbiased_and_stays_on_grid(codec: str) -> None:
    x = torch.tensor([0.3, 0.7, -1.2, 2.6, 0.05, 6.0] * 6)  # one block, amax 6
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([decode(encode(x, codec, "stochastic", g)) for _ in range(4000)])
    nearest = decode(encode(x, codec))
    lower = torch.minimum(draws.min(0).values, nearest)
    upper = torch.maximum(draws.max(0).values, nearest)
    assert ((draws == lower) | (draws == upper)).all()  # only the two neighbours appear
    # 4000 draws: the mean is within ~3 standard errors; nearest rounding is off by up to 0.6.
    assert (draws.mean(0) - x).abs().max() < 0.1
    with pytest.raises(ValueError, match="rounding must be one of"):
        encode(x, codec, "upwards")


def test_fp4_packs_low_nibble_first() -> None:
    msg = encode(torch.tensor([1.0, -6.0, 0.5]), "fp4_e2m1")
    # amax 6 -> scale 2^0 (byte 127); codes: 1.0 -> 2, -6 -> 8|7 = 15, 0.5 -> 1
    assert msg.scales == bytes([127])
    assert msg.payload == bytes([2 | (15 << 4), 1])


def test_fp4_sizes_and_bits_per_value() -> None:
    msg = encode(torch.randn(1024), "fp4_e2m1")
    assert len(msg.payload) == 512 and len(msg.scales) == 32
    assert 8 * (len(msg.payload) + len(msg.scales)) / 1024 == 4.25


@pytest.mark.parametrize("shape", [(0,), (2, 0, 3), (5,), (3, 31), (4, 8, 33), ()])
@pytest.mark.parametrize("codec", ["fp32", "bf16", "fp4_e2m1", "fp4_e3m0"])
def test_round_trip_any_shape(shape: tuple, codec: str) -> None:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(3))
    y = decode(encode(x, codec), expected_shape=shape)
    assert y.shape == x.shape and y.dtype == torch.float32
    if codec == "fp32":
        assert torch.equal(x, y)
    elif codec == "bf16":
        assert torch.equal(x.to(torch.bfloat16).float(), y)
        assert ((x - y).abs() <= x.abs() * 2.0**-8).all()


def test_encode_refuses_non_finite() -> None:
    with pytest.raises(ValueError, match="NaN or infinite"):
        encode(torch.tensor([1.0, float("nan")]), "fp4_e2m1")


def test_unknown_codec_name() -> None:
    with pytest.raises(ValueError, match="unknown codec 'fp5'"):
        encode(torch.zeros(2), "fp5")


@pytest.mark.parametrize(
    "tamper, message",
    [
        (lambda m: m.shape.append(2), "needs"),
        (lambda m: setattr(m, "payload", m.payload[:-1]), "needs"),
        (lambda m: setattr(m, "scales", m.scales + b"\x00"), "needs"),
        (lambda m: setattr(m, "crc32", m.crc32 ^ 1), "checksum"),
        (lambda m: setattr(m, "codec", 99), "unknown codec"),
        (lambda m: m.shape.__setitem__(0, -64), "negative"),
    ],
)
def test_decode_rejects_inconsistent_messages(tamper, message: str) -> None:
    msg = encode(torch.randn(64), "fp4_e2m1")
    tamper(msg)
    with pytest.raises(InvalidArgument, match=message):
        decode(msg)


def test_decode_rejects_nan_scale_and_wrong_shape() -> None:
    import zlib

    msg = encode(torch.randn(32), "fp4_e2m1")
    msg.scales = b"\xff"
    msg.crc32 = zlib.crc32(msg.scales, zlib.crc32(msg.payload))
    with pytest.raises(InvalidArgument, match="NaN"):
        decode(msg)
    with pytest.raises(InvalidArgument, match="does not match expected"):
        decode(encode(torch.randn(4), "fp32"), expected_shape=(5,))
