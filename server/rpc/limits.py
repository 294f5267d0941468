"""What one caller may hold: calls per second, calls open at once, and streams' time (their
settings: server/config.py LimitsConfig).

    limiter = RateLimit(calls_per_s=100, burst=200)
    in_flight = InFlightLimit(max_calls=16)
    deadlines = StreamDeadlines(idle_timeout_s=30, min_bytes_per_s=128 << 10)
    create_server(..., interceptors=(..., auth, limiter, in_flight, deadlines))   # auth first
    deadlines.sweep()        # often (the service's tick): ends overdue streams

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

Deadlines: a stream waiting on its peer (between request messages, or while a response message
is sent) for idle_timeout_s is cut, and one whose header announces a payload must end within
idle_timeout_s + payload_bytes / min_bytes_per_s, so a trickle ends too; not watched: the
server's own work (decoding a push, a long-poll's wait) and unary calls. A cut ends the call
with DEADLINE_EXCEEDED naming the setting (Call.end); cuts are counted ("idle", "slow").
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc

from common.rpc import LEARNER_ID_HEADER, RETRY_AFTER_HEADER
from server.rpc.calls import (
    HEALTH_METHOD_PREFIX,
    Call,
    around_calls,
    authenticated_learner,
    behavior_from,
    current_call,
    replace_behavior,
)

log = logging.getLogger(__name__)

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


@dataclass(eq=False)
class _Watch:
    """One open stream: since when it waits on its peer, and when it must have ended."""

    call: Call
    method: str
    caller: str
    waiting_since: float | None = None
    deadline: float | None = None
    payload_bytes: int = 0


class StreamDeadlines(grpc.ServerInterceptor):
    """Ends streaming calls whose peer is silent for idle_timeout_s, or too slow for its
    announced payload; counts the cuts by reason. Runs inside EndableCalls."""

    def __init__(
        self,
        idle_timeout_s: float,
        min_bytes_per_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not idle_timeout_s > 0 or not min_bytes_per_s >= 0:
            raise ValueError("idle_timeout_s must be > 0 and min_bytes_per_s >= 0")
        self.idle_timeout_s = idle_timeout_s
        self.min_bytes_per_s = min_bytes_per_s
        self._clock = clock
        self._lock = threading.Lock()
        self._open: set[_Watch] = set()
        self._cut: collections.Counter[str] = collections.Counter()

    def cut_counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._cut)

    def open_streams(self) -> int:
        with self._lock:
            return len(self._open)

    def sweep(self, now: float | None = None) -> int:
        """End every stream that is overdue now; returns how many were cut."""
        now = self._clock() if now is None else now
        with self._lock:
            overdue = [(w, reason) for w in self._open if (reason := self._overdue(w, now))]
            for watch, reason in overdue:
                self._open.discard(watch)
                self._cut[reason] += 1
        for watch, reason in overdue:
            details = self._explain(watch, reason)
            log.warning("learner=%s %s stream cut: %s", watch.caller, watch.method, details)
            watch.call.end(grpc.StatusCode.DEADLINE_EXCEEDED, details)
        return len(overdue)

    def _overdue(self, watch: _Watch, now: float) -> str:
        since = watch.waiting_since
        if since is None:  # the server's own work: its time is not the peer's
            return ""
        if now - since > self.idle_timeout_s:
            return "idle"
        if watch.deadline is not None and now > watch.deadline:
            return "slow"
        return ""

    def _explain(self, watch: _Watch, reason: str) -> str:
        if reason == "idle":
            return (
                f"no progress from the peer for {self.idle_timeout_s:g} s (stream_idle_timeout_s)"
            )
        return (
            f"a stream of {watch.payload_bytes} payload bytes must end within "
            f"{self.idle_timeout_s:g} s + the bytes at {self.min_bytes_per_s:g} bytes/s "
            "(stream_min_bytes_per_s)"
        )

    def intercept_service(self, continuation: Callable, handler_call_details):
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(HEALTH_METHOD_PREFIX):
            return handler
        if not (handler.request_streaming or handler.response_streaming):
            return handler
        name = method.rsplit("/", 1)[-1]
        claimed = dict(handler_call_details.invocation_metadata).get(LEARNER_ID_HEADER, "")

        def wrap(behavior):
            def streaming(request_or_iterator, context):
                watch = self._watch(name, claimed)
                try:
                    if handler.request_streaming:
                        request_or_iterator = self._requests(request_or_iterator, watch)
                    result = behavior(request_or_iterator, context)
                    if handler.response_streaming:
                        result = yield from self._responses(result, watch)
                    return result
                finally:
                    self._forget(watch)

            return behavior_from(streaming, handler.response_streaming)

        return replace_behavior(handler, wrap)

    def _watch(self, method: str, claimed: str) -> _Watch:
        call = current_call()
        if call is None:
            raise RuntimeError("StreamDeadlines must run inside EndableCalls")
        watch = _Watch(call, method, authenticated_learner() or claimed or "(no id)")
        with self._lock:
            self._open.add(watch)
        # A streamed answer whose reader went away may never be resumed to its end.
        if not call.context.add_callback(lambda: self._forget(watch)):
            self._forget(watch)
        return watch

    def _forget(self, watch: _Watch) -> None:
        with self._lock:
            self._open.discard(watch)

    def _announced(self, watch: _Watch, message) -> None:
        """A header announcing the payload starts the stream's whole-length bound."""
        if watch.deadline is not None or not self.min_bytes_per_s:
            return
        try:
            if not message.HasField("header"):
                return
        except (ValueError, AttributeError):  # no header field (reflection), or a chunk view
            return
        watch.payload_bytes = message.header.payload_bytes
        watch.deadline = (
            self._clock() + self.idle_timeout_s + watch.payload_bytes / self.min_bytes_per_s
        )

    def _requests(self, requests: Iterator, watch: _Watch) -> Iterator:
        """The request stream, watched while the server waits for each message."""
        while True:
            watch.waiting_since = self._clock()
            try:
                request = next(requests)
            except StopIteration:
                return
            finally:
                watch.waiting_since = None
            self._announced(watch, request)
            yield request

    def _responses(self, responses: Iterator, watch: _Watch) -> Iterator:
        """The response stream, watched while gRPC sends each message: it asks for the next
        one only once the last has gone out."""
        for response in responses:
            self._announced(watch, response)
            watch.waiting_since = self._clock()
            yield response
            watch.waiting_since = None
