"""Test doubles and small fixtures shared by the unit tests."""

from __future__ import annotations

import torch

from server.global_params import ParamSpec

SHAPES = [(3, 4), (5,)]
FINGERPRINT = [ParamSpec(f"p{i}", s, "float32") for i, s in enumerate(SHAPES)]


class FakeClock:
    """A clock that moves only when a test sets `now` (seconds): no sleeps in tests."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def tensors(seed: int) -> list[torch.Tensor]:
    """Random parameters (or deltas) of FINGERPRINT's shapes, the same for the same seed."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in SHAPES]
