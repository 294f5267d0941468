"""Token buckets with a fake clock, and the retry helper honouring a rate-limit refusal."""

import threading

import grpc
import pytest

from common.retry import call_with_retry, retry_after_s
from common.rpc import RETRY_AFTER_HEADER
from server.rpc.limits import TokenBuckets
from tests.support.fakes import FakeClock


def test_burst_then_steady_rate() -> None:
    clock = FakeClock()
    buckets = TokenBuckets(rate_per_s=2.0, burst=3, clock=clock)
    assert [buckets.take("a") for _ in range(3)] == [0.0, 0.0, 0.0]
    assert buckets.take("a") == pytest.approx(0.5)  # empty: the next token in 1/2 s
    assert buckets.take("b") == 0.0  # other learners have their own bucket
    clock.now = 0.5
    assert buckets.take("a") == 0.0
    assert buckets.take("a") == pytest.approx(0.5)
    clock.now = 100.0  # a long pause refills only up to the burst
    assert [buckets.take("a") for _ in range(4)][-1] > 0


def test_caller_table_is_bounded() -> None:
    clock = FakeClock()
    buckets = TokenBuckets(rate_per_s=1.0, burst=1, clock=clock, max_keys=3)
    for key in "abcd":
        buckets.take(key)
    assert len(buckets._buckets) == 3
    assert buckets.take("a") == 0.0  # forgotten, so it starts full again


def test_bad_limits_are_refused() -> None:
    with pytest.raises(ValueError, match="rate_per_s"):
        TokenBuckets(rate_per_s=0, burst=1)


class FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, trailing=()) -> None:
        self._code, self._trailing = code, trailing

    def code(self) -> grpc.StatusCode:
        return self._code

    def trailing_metadata(self):
        return self._trailing


def test_rate_limited_calls_are_retried_after_the_hint_and_size_refusals_are_not() -> None:
    limited = FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, ((RETRY_AFTER_HEADER, "20"),))
    too_large = FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert retry_after_s(limited) == pytest.approx(0.02)
    assert retry_after_s(too_large) is None
    attempts = []

    def flaky() -> str:
        attempts.append(1)
        if len(attempts) < 3:
            raise limited
        return "ok"

    waits = []
    assert call_with_retry(flaky, threading.Event(), lambda _, d: waits.append(d)) == "ok"
    assert len(waits) == 2 and all(w >= 0.02 for w in waits)
    with pytest.raises(grpc.RpcError):
        call_with_retry(lambda: (_ for _ in ()).throw(too_large), threading.Event())
