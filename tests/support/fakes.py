"""Test doubles and small fixtures shared by the unit tests."""

from __future__ import annotations

from types import SimpleNamespace

import grpc
import torch
from grpc import _common

from server.global_params import ParamSpec

SHAPES = [(3, 4), (5,)]
FINGERPRINT = [ParamSpec(f"p{i}", s, "float32") for i, s in enumerate(SHAPES)]


class FakeClock:
    """A clock that moves only when a test sets `now` (seconds): no sleeps in tests."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeServicerContext:
    """What the server's interceptors use of a call's context; records how the call was
    ended from outside (server/calls.py) as (status code, details)."""

    def __init__(self) -> None:
        self.ended: list[tuple[grpc.StatusCode, str]] = []
        self.callbacks: list = []
        codes = {cy: code for code, cy in _common.STATUS_CODE_TO_CYGRPC_STATUS_CODE.items()}
        cancel = lambda code, details: self.ended.append((codes[code], details))  # noqa: E731
        self._rpc_event = SimpleNamespace(call=SimpleNamespace(cancel=cancel))

    def add_callback(self, callback) -> bool:
        self.callbacks.append(callback)
        return True

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise RuntimeError(f"aborted: {code.name}: {details}")


def tensors(seed: int) -> list[torch.Tensor]:
    """Random parameters (or deltas) of FINGERPRINT's shapes, the same for the same seed."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in SHAPES]
