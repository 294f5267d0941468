"""Test doubles and small fixtures shared by the unit tests."""

from __future__ import annotations

import grpc
import torch

from server.state.fragment import FragmentState
from server.state.params import ParamSpec

SHAPES = [(3, 4), (5,)]
FINGERPRINT = [ParamSpec(f"p{i}", s, "float32") for i, s in enumerate(SHAPES)]


class FakeClock:
    """A clock that moves only when a test sets `now` (seconds): no sleeps in tests."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeServicerContext:
    """What the server's interceptors use of a call's context. Records how the call ended:
    `ended` gets (status code, details) for an abort, (CANCELLED, "") for a cancel."""

    def __init__(self) -> None:
        self.ended: list[tuple[grpc.StatusCode, str]] = []
        self.callbacks: list = []

    def add_callback(self, callback) -> bool:
        self.callbacks.append(callback)
        return True

    def is_active(self) -> bool:
        return not self.ended

    def cancel(self) -> None:
        self.ended.append((grpc.StatusCode.CANCELLED, ""))

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.ended.append((code, details))
        raise RuntimeError(f"aborted: {code.name}: {details}")


def tensors(seed: int) -> list[torch.Tensor]:
    """Random parameters (or deltas) of FINGERPRINT's shapes, the same for the same seed."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in SHAPES]


def close_round(fragment: FragmentState, expected_weight: float = 0.0) -> None:
    """Close the fragment's round as a policy does (rounds/policy.py), without a log: the
    round's mean, one outer step along it, and the next round."""
    rnd = fragment.round
    mean = rnd.mean(expected_weight)
    fragment.round = rnd.next()
    fragment.apply_mean(mean)
