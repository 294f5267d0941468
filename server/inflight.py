"""A bound on the calls each learner has open at once: a few learners cannot hold every
worker thread of the server.

    inflight = InFlightLimit(max_calls=16)
    create_server(listen, credentials, interceptors=(auth, inflight, limiter))   # auth first

Every open call holds one of the server's worker threads (a long-poll for up to a minute), so
without a bound a few hundred idle calls starve every learner. A caller is its verified
learner id when authentication is on (the auth interceptor runs first); without it, the
connection it calls on together with the id it claims (simulated learners in one process
share a connection). A call over the bound is refused with RESOURCE_EXHAUSTED before its
request is read, with a retry hint (`x-diloco-retry-after-ms`, common/retry.py). Health checks
are not counted. Without authentication a caller that claims a new id with every call is not
bounded by this: run with auth_token_file wherever the network is not trusted.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable

import grpc

from common.rpc import LEARNER_ID_HEADER, RETRY_AFTER_HEADER
from server.auth import HEALTH_METHOD_PREFIX, around_calls, authenticated_learner

# A refused caller is told to retry after this long: open calls end within seconds, except
# long-polls, which end when their version arrives.
RETRY_AFTER_MS = 1000


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
