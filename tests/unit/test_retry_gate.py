"""RetryGate: a failed rejoin is tried again after the backoff, or the server's hint if longer."""

from __future__ import annotations

import random

import grpc

from common.retry import Backoff, RetryGate
from common.rpc import RETRY_AFTER_HEADER


class Refused(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, retry_after_ms: int | None = None) -> None:
        self._code, self._ms = code, retry_after_ms

    def code(self) -> grpc.StatusCode:
        return self._code

    def trailing_metadata(self):
        return () if self._ms is None else ((RETRY_AFTER_HEADER, str(self._ms)),)


def test_the_gate_opens_after_the_backoff_or_the_servers_hint() -> None:
    gate = RetryGate(Backoff(base_s=0.2, cap_s=10.0, rng=random.Random(0)))
    assert gate.due()
    first = gate.failed(Refused(grpc.StatusCode.UNAVAILABLE))
    assert 0 <= first <= 0.2 and (first == 0 or not gate.due())
    # A rate-limited refusal's hint wins over a shorter backoff.
    assert gate.failed(Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, 60_000)) == 60.0
    assert not gate.due()
    gate.succeeded()
    assert gate.due()
    # The backoff starts over after a success: its next ceiling is the base again.
    assert gate.failed(Refused(grpc.StatusCode.UNAVAILABLE)) <= 0.2
