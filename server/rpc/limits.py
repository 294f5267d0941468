"""What one caller may hold: calls per second, calls open at once, and push memory's and
streams' settings (LimitsConfig).

    limiter = RateLimit(calls_per_s=100, burst=200)
    in_flight = InFlightLimit(max_calls=16)
    create_server(..., interceptors=(..., auth, limiter, in_flight, deadlines))   # auth first

Rate: each caller (the `x-diloco-learner-id` it sends; verified when authentication is on,
because the auth interceptor runs first) has a token bucket that holds `burst` calls,
refilled at `calls_per_s`. Without authentication the id is only the client's claim: the
limit then stops a runaway or misconfigured learner, not an attacker, who could send a new id
with every call (run with auth_token_file wherever the network is not trusted). Callers that
send no id share one bucket; the table of buckets is bounded, so made-up ids cannot grow it.

Calls in flight: every open call holds one of the server's worker threads (a long-poll for up
to a minute), so without a bound a few hundred idle calls starve every learner. A caller is
its verified learner id, or without authentication the connection it calls on together with
the id it claims (simulated learners in one process share a connection).

A call over either bound is refused with RESOURCE_EXHAUSTED before its request is read, with
the trailing metadata `x-diloco-retry-after-ms`, which our learners treat as "retry later"
(common/retry.py); a refusal for size (also RESOURCE_EXHAUSTED) has no such key and is final.
Health checks are not limited.
"""

from __future__ import annotations

import collections
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from common.rpc import LEARNER_ID_HEADER, RETRY_AFTER_HEADER
from server.rpc.calls import (
    HEALTH_METHOD_PREFIX,
    around_calls,
    authenticated_learner,
    replace_behavior,
)

MAX_TRACKED_CALLERS = 10_000
# A refused caller is told to retry after this long: open calls end within seconds, except
# long-polls, which end when their version arrives.
RETRY_AFTER_MS = 1000


class TokenBuckets:
    """Token buckets by key; `take` answers 0 (admitted) or the seconds until one is free."""

    def __init__(
        self,
        rate_per_s: float,
        burst: int,
        clock: Callable[[], float] = time.monotonic,
        max_keys: int = MAX_TRACKED_CALLERS,
    ) -> None:
        if not rate_per_s > 0 or burst < 1:
            raise ValueError("rate_per_s must be > 0 and burst >= 1")
        self.rate_per_s, self.burst, self.clock, self.max_keys = rate_per_s, burst, clock, max_keys
        self._lock = threading.Lock()
        # key -> (tokens, time of the last refill); least recently used first
        self._buckets: collections.OrderedDict[str, tuple[float, float]] = collections.OrderedDict()

    def take(self, key: str) -> float:
        now = self.clock()
        with self._lock:
            tokens, last = self._buckets.pop(key, (float(self.burst), now))
            tokens = min(float(self.burst), tokens + (now - last) * self.rate_per_s)
            wait_s = 0.0 if tokens >= 1 else (1 - tokens) / self.rate_per_s
            if wait_s == 0.0:
                tokens -= 1
            self._buckets[key] = (tokens, now)
            while len(self._buckets) > self.max_keys:
                self._buckets.popitem(last=False)  # forget the longest-idle caller: full bucket
            return wait_s


class RateLimit(grpc.ServerInterceptor):
    """Refuses calls above each learner's budget (health checks exempt); counts refusals."""

    def __init__(self, calls_per_s: float, burst: int) -> None:
        self.buckets = TokenBuckets(calls_per_s, burst)
        self._lock = threading.Lock()
        self.refused: collections.Counter[str] = collections.Counter()

    def refused_counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self.refused)

    def intercept_service(self, continuation: Callable, handler_call_details):
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(HEALTH_METHOD_PREFIX):
            return handler
        caller = dict(handler_call_details.invocation_metadata).get(LEARNER_ID_HEADER, "")
        name = method.rsplit("/", 1)[-1]

        def wrap(behavior):
            def limited(request_or_iterator, context):
                wait_s = self.buckets.take(caller)
                if wait_s > 0:
                    with self._lock:
                        self.refused[name] += 1
                    retry_ms = str(max(1, math.ceil(wait_s * 1000)))
                    context.set_trailing_metadata(((RETRY_AFTER_HEADER, retry_ms),))
                    context.abort(
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"rate limit: learner {caller or '(no id)'} exceeds "
                        f"{self.buckets.rate_per_s:g} calls/s; retry in {retry_ms} ms",
                    )
                return behavior(request_or_iterator, context)

            return limited

        return replace_behavior(handler, wrap)


class InFlightLimit(grpc.ServerInterceptor):
    """Refuses a caller's call while it already has `max_calls` open; counts refusals."""

    def __init__(self, max_calls: int) -> None:
        if max_calls < 1:
            raise ValueError(f"max_calls must be >= 1, got {max_calls}")
        self.max_calls = max_calls
        self._lock = threading.Lock()
        self._open: collections.Counter[str] = collections.Counter()
        self.refused: collections.Counter[str] = collections.Counter()

    def refused_counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self.refused)

    def open_calls(self) -> int:
        """Calls admitted and not yet finished, over all callers."""
        with self._lock:
            return sum(self._open.values())

    def _admit(self, caller: str, method: str) -> Callable[[], None] | None:
        """A function that ends the call's claim (safe to call twice); None when refused."""
        with self._lock:
            if self._open[caller] >= self.max_calls:
                self.refused[method] += 1
                return None
            self._open[caller] += 1
        done = threading.Event()

        def release() -> None:
            with self._lock:
                if done.is_set():
                    return
                done.set()
                self._open[caller] -= 1
                if not self._open[caller]:
                    del self._open[caller]  # the table holds only callers with open calls

        return release

    def intercept_service(self, continuation: Callable, handler_call_details):
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(HEALTH_METHOD_PREFIX):
            return handler
        claimed = dict(handler_call_details.invocation_metadata).get(LEARNER_ID_HEADER, "")
        name = method.rsplit("/", 1)[-1]

        def admit(context) -> Callable[[], None]:
            caller = authenticated_learner() or f"{context.peer()} {claimed}"
            release = self._admit(caller, name)
            if release is None:
                context.set_trailing_metadata(((RETRY_AFTER_HEADER, str(RETRY_AFTER_MS)),))
                context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"learner {claimed or '(no id)'} already has {self.max_calls} calls open "
                    f"(max_calls_in_flight); retry once one has finished",
                )
            # Also when the client cancels: a streaming answer may never be read to its end.
            if not context.add_callback(release):
                release()
            return release

        return around_calls(handler, admit)


@dataclass(kw_only=True)
class LimitsConfig:
    """Per-learner call rate and concurrency limits, worker threads and deadlines for
    streams (server/rpc/limits.py, server/rpc/deadlines.py)."""

    rate_limit_calls_per_s: float = 100.0
    """Each learner may make this many calls per second on average (0: no limit); a
    learner over it is told to retry later."""
    rate_limit_burst: int = 200
    """Calls a learner may make at once before rate_limit_calls_per_s applies."""
    max_calls_in_flight: int = 16
    """Calls one learner may have open at the same time (0: no limit). Each open call holds
    one of the server's worker threads (a long-poll for up to a minute), so this stops a
    few learners from starving the rest; our learners have at most three open at once."""
    push_memory_budget_mb: float = 0.0
    """Push payload bytes the server holds at once, all pushes together: a push's announced
    size is reserved before its payload is read (server/rpc/receive.py). 0: sized to the
    fragments the shard owns, a quarter of their fp32 bytes within 64-256 MiB and at least
    two fp4 pushes of the largest. A fragment's initial fp32 values larger than this are
    received alone; other pushes must fit: learners pushing in bf16 or fp32 need a budget of
    at least one such push of the largest fragment (2 or 4 bytes a value), else those pushes
    are refused, the error giving both sizes."""
    push_budget_wait_s: float = 0.0
    """How long a push waits for room in push_memory_budget_mb before it is refused with
    RESOURCE_EXHAUSTED and a retry hint (learners retry it). 0: refused at once. A waiting
    push holds what gRPC's flow control lets its sender send meanwhile (up to the link's
    bandwidth-delay product), so waiting trades memory for fewer retries."""
    worker_threads: int = 256
    """Threads that run calls; every open call holds one. Sized for a few hundred learners."""
    max_concurrent_streams: int = 100
    """Calls one connection may have open at once (HTTP/2 max concurrent streams). A gRPC
    client queues calls beyond it until one ends; a learner needs a handful."""
    stream_idle_timeout_s: float = 30.0
    """End a streaming call whose peer makes no progress for this long: a push with no next
    chunk, a pull whose reader stopped reading (server/rpc/deadlines.py); 0: off."""
    stream_min_bytes_per_s: float = 131072.0
    """A push or pull must end within stream_idle_timeout_s + its payload bytes / this rate
    (128 KiB/s: a 1 Mbit/s link); 0: no bound on the whole stream."""

    def __post_init__(self) -> None:
        if not self.rate_limit_calls_per_s >= 0 or self.rate_limit_burst < 1:
            raise ValueError("rate_limit_calls_per_s must be >= 0 and rate_limit_burst >= 1")
        if self.max_calls_in_flight < 0:
            raise ValueError(f"max_calls_in_flight must be >= 0, got {self.max_calls_in_flight}")
        if not self.push_memory_budget_mb >= 0:
            raise ValueError(
                f"push_memory_budget_mb must be >= 0 (0: sized to the owned fragments), "
                f"got {self.push_memory_budget_mb}"
            )
        if 0 < self.push_memory_budget_mb * 2**20 < 1:
            raise ValueError(
                f"push_memory_budget_mb must be 0 or at least one byte, "
                f"got {self.push_memory_budget_mb}"
            )
        if not 0 <= self.push_budget_wait_s <= 3600:
            raise ValueError(f"push_budget_wait_s must be 0 to 3600, got {self.push_budget_wait_s}")
        if self.worker_threads < 1 or self.max_concurrent_streams < 1:
            raise ValueError("worker_threads and max_concurrent_streams must be >= 1")
        if not self.stream_idle_timeout_s >= 0 or not self.stream_min_bytes_per_s >= 0:
            raise ValueError("stream_idle_timeout_s and stream_min_bytes_per_s must be >= 0")
        if self.stream_min_bytes_per_s and not self.stream_idle_timeout_s:
            raise ValueError(
                "stream_min_bytes_per_s needs stream_idle_timeout_s > 0 (its grace period)"
            )
