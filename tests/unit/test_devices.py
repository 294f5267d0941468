"""Where tensors live: the codec gives the same bytes on every device, and --device is checked.

CI has no GPU, so the CUDA cases run where one exists (bench/cuda_check.py runs them on a GPU
machine); on the CPU they still check that results land on the device asked for.
"""

from __future__ import annotations

import pytest
import torch

from common.codec.tensor import decode, encode
from learner.config import resolve_device

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("codec", ["fp32", "bf16", "fp4_e2m1", "fp4_e3m0"])
def test_encode_gives_the_same_bytes_on_every_device(device: str, codec: str) -> None:
    torch.manual_seed(0)
    values = torch.randn(4099) * torch.logspace(-30, 30, 4099)
    values[:5] = torch.tensor([0.0, -0.0, 3.4e38, -1e-44, 6.0])
    reference = encode(values, codec)
    on_device = encode(values.to(device), codec)
    assert on_device == reference
    decoded = decode(reference, device=device)
    assert decoded.device.type == device
    assert torch.equal(decoded.cpu(), decode(reference))


def test_resolve_device() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    for bad in ("tpu", "gpu0", ""):
        with pytest.raises(ValueError, match="device must be auto, cpu, cuda or cuda:N"):
            resolve_device(bad)
    with pytest.raises(ValueError, match="requested but this host has"):
        resolve_device(f"cuda:{torch.cuda.device_count() + 3}")
