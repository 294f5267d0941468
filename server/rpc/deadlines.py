"""Deadlines of streaming calls: a peer that stops sending or reading, or trickles, is cut.

    deadlines = StreamDeadlines(idle_timeout_s=30, min_bytes_per_s=128 << 10)
    create_server(..., interceptors=(EndableCalls(), ..., deadlines))   # inside EndableCalls
    deadlines.sweep()        # often (the service's tick): ends overdue streams

The time a streaming call waits on its peer (between request messages, or while a response
message is sent) is bounded by idle_timeout_s, and a stream whose header announces a payload
must end within idle_timeout_s + payload_bytes / min_bytes_per_s, so a trickle that is never
idle ends too. Not watched: the server's own work (decoding a push, a long-poll's wait),
unary calls, health checks. A cut ends the call with DEADLINE_EXCEEDED and a message naming
the setting (Call.end); cuts are counted by reason ("idle", "slow").
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc

from common.rpc import LEARNER_ID_HEADER
from server.rpc.calls import (
    HEALTH_METHOD_PREFIX,
    Call,
    authenticated_learner,
    behavior_from,
    current_call,
    replace_behavior,
)

log = logging.getLogger(__name__)


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
