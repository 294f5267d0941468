"""Every retry says what it waits for: the call and its address, the attempt, the next wait."""

from __future__ import annotations

import logging
import re
import threading
from concurrent.futures import Future

import grpc
import pytest

from common.retry import call_with_retry
from common.traffic import Traffic
from learner import shard_map
from learner.shard_map import ShardMap


class Unavailable(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE


def retry_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "diloco.retry"]


def test_each_retry_of_a_call_is_one_line_naming_the_call_the_attempt_and_the_wait(
    caplog: pytest.LogCaptureFixture,
) -> None:
    failures = [Unavailable(), Unavailable()]

    def join() -> str:
        if failures:
            raise failures.pop()
        return "joined"

    waits: list[float] = []
    with caplog.at_level(logging.WARNING, "diloco.retry"):
        answer = call_with_retry(
            join, threading.Event(), lambda _, d: waits.append(d), what="join at h:1"
        )
    assert answer == "joined"
    assert retry_lines(caplog) == [
        f"join at h:1: UNAVAILABLE (attempt {n}); trying again in {wait:.1f} s"
        for n, wait in enumerate(waits, 1)
    ]


class NeverReady:
    """A shard's client whose channel never connects."""

    def ready_future(self) -> Future:
        return Future()

    def close(self) -> None:
        pass


def test_waiting_for_a_server_that_never_answers_logs_each_check_with_its_backoff(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shard_map, "READY_NOTES_S", (0.05, 0.1))
    shards = ShardMap(["127.0.0.1:1"], None, (), Traffic())
    shards.close()
    shards.clients = [NeverReady()]
    with caplog.at_level(logging.WARNING, "diloco.retry"), pytest.raises(grpc.FutureTimeoutError):
        shards.wait_ready(1.5)  # the first check is due at 0.05 s: room for a busy machine
    lines = retry_lines(caplog)
    # A busy machine may skip a check, never add one: at most one per 0.1 s after the first.
    assert 1 <= len(lines) <= 15
    pattern = r"connect to 127\.0\.0\.1:1: no connection after [01] s of 1\.5 \(attempt (\d+)\); "
    pattern += r"trying again in 0\.\d s"
    attempts = [int(re.fullmatch(pattern, line).group(1)) for line in lines]
    assert attempts == list(range(1, len(lines) + 1))
