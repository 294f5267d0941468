"""Per-learner call rate limits: one learner cannot flood the aggregator.

    limiter = RateLimit(calls_per_s=100, burst=200)
    create_server(listen, credentials, interceptors=(auth, limiter))   # auth first

Each caller (the `x-diloco-learner-id` it sends; verified when authentication is on, because
the auth interceptor runs first and refuses unauthenticated calls before they get here) has a
token bucket. Without authentication the id is only the client's claim: the limit then stops
a runaway or misconfigured learner, not an attacker, who could send a new id with every call
(run with auth_token_file wherever the network is not trusted). Callers that send no id
(tools such as grpcurl) share one bucket. A bucket holds `burst` calls at once, refilled at
`calls_per_s`. A call over the limit is refused with RESOURCE_EXHAUSTED before its request is
read, and carries the trailing metadata `x-diloco-retry-after-ms`, which our learners treat
as "retry later" (common/retry.py; a rejoin waits that long too); a refusal for size (also
RESOURCE_EXHAUSTED) has no such key and is final. Health checks are
not limited. The table of buckets is bounded, so made-up learner ids cannot grow it.
"""

from __future__ import annotations

import collections
import math
import threading
import time
from collections.abc import Callable

import grpc

from common.rpc import LEARNER_ID_HEADER, RETRY_AFTER_HEADER
from server.auth import HEALTH_METHOD_PREFIX, replace_behavior

MAX_TRACKED_CALLERS = 10_000


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
