"""One retry helper for calls that may hit a server that is restarting or cut off, and one
for waiting until something holds (a port file written, a metric reached).

Capped exponential backoff with full jitter (sleep a random time up to min(cap, base·2^n)),
so many learners that lost the same server do not come back in lock step. Every retry is one
log line (log_retry): what is waited for, why, the attempt and the wait before the next; the
waits grow, so the lines thin out.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import grpc

from common.rpc import RETRY_AFTER_HEADER

T = TypeVar("T")

log = logging.getLogger("diloco.retry")

# The server is down, restarting or unreachable: worth another try. So is a rate-limit
# refusal, after the wait it names. Everything else is an answer (a refusal with a reason)
# and goes to the caller.
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


def retry_after_s(err: grpc.RpcError) -> float | None:
    """The wait a rate-limited refusal asks for (server/rpc/limits.py), or None."""
    if err.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
        return None
    trailing = getattr(err, "trailing_metadata", lambda: None)() or ()
    for key, value in trailing:
        if key == RETRY_AFTER_HEADER:
            try:
                return max(0.0, int(value) / 1000)
            except ValueError:
                return None
    return None


def is_retryable(err: grpc.RpcError) -> bool:
    return err.code() in RETRYABLE or retry_after_s(err) is not None


class Stopped(Exception):
    """The caller asked to stop while the call was being retried."""


class Backoff:
    def __init__(self, base_s: float = 0.2, cap_s: float = 10.0, rng: random.Random | None = None):
        self.base_s, self.cap_s = base_s, cap_s
        self.rng = rng or random.Random()
        self.attempt = 0

    def next_delay_s(self) -> float:
        ceiling = min(self.cap_s, self.base_s * 2**self.attempt)
        self.attempt += 1
        return self.rng.uniform(0, ceiling)

    def reset(self) -> None:
        self.attempt = 0


class RetryGate:
    """When an attempt that failed may be made again (a rejoin tried from the training loop,
    which must not wait): after the next backoff delay, or the server's hint if longer."""

    def __init__(self, backoff: Backoff | None = None) -> None:
        self._backoff = backoff or Backoff()
        self._next_s = 0.0

    def due(self) -> bool:
        return time.monotonic() >= self._next_s

    def failed(self, err: grpc.RpcError) -> float:
        """Note a failure; returns the delay before the next try."""
        delay = max(self._backoff.next_delay_s(), retry_after_s(err) or 0.0)
        self._next_s = time.monotonic() + delay
        return delay

    def succeeded(self) -> None:
        self._backoff.reset()
        self._next_s = 0.0


def log_retry(what: str, why: str, attempt: int, delay_s: float) -> None:
    """One line for a failed attempt: `what` was tried (the call and its address), `why` it
    failed, and how long until the next try."""
    log.warning("%s: %s (attempt %d); trying again in %.1f s", what, why, attempt, delay_s)


def call_with_retry(
    call: Callable[[], T],
    stop: threading.Event,
    on_retry: Callable[[grpc.RpcError, float], None] | None = None,
    backoff: Backoff | None = None,
    what: str = "",
) -> T:
    """Run `call` until it succeeds, fails with a non-retryable status, or `stop` is set.
    With `what` (the call and where it goes) each retry is logged (log_retry), after
    `on_retry`, which may raise to give up."""
    backoff = backoff or Backoff()
    attempt = 0
    while True:
        attempt += 1
        try:
            return call()
        except grpc.RpcError as err:
            if not is_retryable(err):
                raise
            delay = max(backoff.next_delay_s(), retry_after_s(err) or 0.0)
            if on_retry is not None:
                on_retry(err, delay)
            if what:
                log_retry(what, err.code().name, attempt, delay)
            if stop.wait(delay):
                raise Stopped() from err


def wait_until(check: Callable[[], T], timeout_s: float, what: str, interval_s: float = 0.05) -> T:
    """Call `check` every `interval_s` until it returns a truthy value, and return that value.

    Raises TimeoutError naming `what` after `timeout_s`; an exception from `check` ends the
    wait at once (e.g. the process being waited on has exited)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what}: not within {timeout_s:g} s")
        time.sleep(interval_s)
