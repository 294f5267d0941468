"""The wire format, pinned: each codec's bytes for fixed inputs, as CRCs.

The inputs are exact (integers times powers of two, made without floating-point arithmetic)
and every codec's arithmetic is exact or a fixed rounding rule, so these bytes are the same on
every machine, with the C kernels or the torch path (DILOCO_FP4_KERNEL=torch). A change here
is a change of the wire format: learners and servers of other versions would stop agreeing.
"""

from __future__ import annotations

import pytest
import torch

from common.checksum import crc32
from common.codec.fragment import encode_fragment

# fmt: off
PINNED = {
    "fp32": 2784256388,
    "bf16": 2286078694,
    "fp4_e2m1": 1422686101,
    "fp4_e3m0": 513029446,
    "sparse_2bit": 77100809,
}
# fmt: on


def inputs() -> list[torch.Tensor]:
    """Three tensors of integer-valued floats over many octaves: blocks near zero, large and
    small scales, ties at rounding midpoints, a short last block and a short sparse chunk."""
    g = torch.Generator().manual_seed(11)
    out = []
    for shape, low, high in [((70, 131), -1000, 1001), ((4096 + 77,), -8, 9), ((33,), -3, 4)]:
        ints = torch.randint(low, high, shape, generator=g)
        octave = torch.randint(-12, 13, shape, generator=g)
        out.append(torch.ldexp(ints.double(), octave.double()).float())
    return out


@pytest.mark.parametrize("kernel", ["native", "torch"])
@pytest.mark.parametrize("codec", sorted(PINNED))
def test_each_codec_writes_the_pinned_bytes(codec: str, kernel: str, monkeypatch) -> None:
    monkeypatch.setenv("DILOCO_FP4_KERNEL", kernel if kernel == "torch" else "auto")
    data = encode_fragment(inputs(), codec, sparse_k=64)
    assert crc32(data) == PINNED[codec], f"{codec}: {crc32(data)}"
