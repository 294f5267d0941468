"""Calls that another thread may end, streaming calls' deadlines, handlers rewrapped.

    interceptors = (EndableCalls(), auth, ..., StreamDeadlines(30, 128 << 10))  # in this order
    call = current_call()                       # in a handler: this call's Call
    call.end(grpc.StatusCode.UNAUTHENTICATED, "token revoked")   # from any thread
    deadlines.sweep()                           # often (the service's tick): ends overdue streams

A handler blocked on its peer cannot end itself, so `end` works with gRPC's public API only:
a request stream is read on a thread of its own (EndableCalls) and the handler waits on a
queue that `end` wakes; a long-poll registers a waker (`Call.on_end`); either then aborts the
call with the status asked for. A send that never completes (a reader that stopped reading)
leaves no thread of ours to wake: after END_GRACE_S `context.cancel()` ends it (CANCELLED).

StreamDeadlines watches the time a streaming call waits on its peer (between request
messages, or while a response message is sent); a stream whose header announces a payload
must also end within idle_timeout_s + payload_bytes / min_bytes_per_s, so a trickle ends.
Not watched: the server's own work, unary calls, health checks. Cuts count by reason.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc

from common.rpc import LEARNER_ID_HEADER

log = logging.getLogger(__name__)

# The one service open to any caller and exempt from limits: orchestrators probe without tokens.
HEALTH_METHOD_PREFIX = "/grpc.health.v1.Health/"
# How long a call asked to end may take to end itself before it is cancelled outright.
END_GRACE_S = 1.0
_NEXT, _DONE = object(), object()  # a request reader's signals

_current: contextvars.ContextVar[Call | None] = contextvars.ContextVar("call", default=None)


def current_call() -> Call | None:
    """The call the current handler serves (None outside EndableCalls)."""
    return _current.get()


def authenticated_learner() -> str | None:
    """The learner id the current call proved (a token, a certificate: auth.py), or None
    when authentication is off."""
    call = _current.get()
    return call.learner_id if call is not None else None


class Call:
    """One call in progress, which any thread may ask to end with a status."""

    def __init__(self, context: grpc.ServicerContext) -> None:
        self.context = context
        self.learner_id: str | None = None  # set once the caller proved who it is (auth.py)
        self.reason: tuple[grpc.StatusCode, str] | None = None
        self._lock = threading.Lock()
        self._wakers: list[Callable[[], None]] = []

    def end(self, code: grpc.StatusCode, details: str) -> None:
        """Ask the call to end with `code` and `details` (the first ask wins): its handler's
        waits are woken, and a call still active after END_GRACE_S is cancelled."""
        with self._lock:
            if self.reason is not None:
                return
            self.reason = (code, details)
            wakers = list(self._wakers)
        for wake in wakers:
            wake()
        timer = threading.Timer(END_GRACE_S, self._cancel_if_active)
        timer.daemon = True
        timer.start()

    def on_end(self, wake: Callable[[], None]) -> None:
        """Run `wake` when the call is asked to end (now, if it was already)."""
        with self._lock:
            self._wakers.append(wake)
            asked = self.reason is not None
        if asked:
            wake()

    def abort_if_ended(self) -> None:
        """From the handler: end the call now with the status it was asked to end with."""
        if self.reason is not None:
            self.context.abort(*self.reason)

    def _cancel_if_active(self) -> None:
        if self.context.is_active():
            log.warning("call did not end itself within %g s; cancelling it", END_GRACE_S)
            self.context.cancel()


class EndableCalls(grpc.ServerInterceptor):
    """Gives every call but health checks a Call (current_call), and reads request streams
    on a thread of their own so that their handler's wait for the next message can be ended."""

    def intercept_service(self, continuation: Callable, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(HEALTH_METHOD_PREFIX):
            return handler

        def wrap(behavior):
            def run(request_or_iterator, context):
                call = Call(context)
                token = _current.set(call)
                reader = None
                if handler.request_streaming:
                    reader = request_or_iterator = _EndableRequests(request_or_iterator, call)
                try:
                    result = behavior(request_or_iterator, context)
                    if not handler.response_streaming:
                        return result
                    for response in result:
                        yield response
                        call.abort_if_ended()  # asked to end while it sent: stop here
                    return None
                finally:
                    if reader is not None:
                        reader.close()
                    with contextlib.suppress(ValueError):  # a stream closed from elsewhere
                        _current.reset(token)

            return _behavior(run, handler.response_streaming)

        return replace_behavior(handler, wrap)


class _EndableRequests:
    """A request stream read by a thread of its own, a message when the handler asks for
    one; `next` waits on a queue that Call.end wakes, and then aborts the call with the
    status it was asked for. Past its end it keeps answering as it ended."""

    def __init__(self, requests: Iterator, call: Call) -> None:
        self._requests, self._call = requests, call
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._wanted = threading.Semaphore(0)  # the handler asks for one more message
        self._closed = False
        self._ended: BaseException | None = None  # StopIteration or the stream's error
        self._thread: threading.Thread | None = None
        call.on_end(lambda: self._queue.put(_DONE))

    def __iter__(self) -> _EndableRequests:
        return self

    def __next__(self):
        if self._ended is not None:
            raise self._ended
        if self._thread is None:
            self._thread = threading.Thread(target=self._read, name="requests", daemon=True)
            self._thread.start()
        self._wanted.release()
        item = self._queue.get()
        if item is _DONE:
            self._ended = StopIteration()
            self._call.abort_if_ended()
            raise StopIteration
        if isinstance(item, BaseException):
            self._ended = item
            raise item
        return item

    def close(self) -> None:
        """The handler is done: a reader waiting to be asked for more stops."""
        self._closed = True
        self._wanted.release()

    def _read(self) -> None:
        while True:
            self._wanted.acquire()
            if self._closed:
                return
            try:
                item = next(self._requests)
            except StopIteration:
                self._queue.put(_DONE)
                return
            except BaseException as err:  # noqa: BLE001 - the handler raises it
                self._queue.put(err)
                return
            self._queue.put(item)


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

            return _behavior(streaming, handler.response_streaming)

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


def around_calls(handler: grpc.RpcMethodHandler, enter: Callable) -> grpc.RpcMethodHandler:
    """The same handler with `enter(context)` run as each call starts and the function it
    returns run as the call ends (a streamed answer's end included)."""

    def wrap(behavior):
        if handler.response_streaming:

            def streaming(request, context):
                leave = enter(context)
                try:
                    yield from behavior(request, context)
                finally:
                    leave()

            return streaming

        def unary(request_or_iterator, context):
            leave = enter(context)
            try:
                return behavior(request_or_iterator, context)
            finally:
                leave()

        return unary

    return replace_behavior(handler, wrap)


def replace_behavior(handler: grpc.RpcMethodHandler, wrap) -> grpc.RpcMethodHandler:
    """The same handler with its behavior function replaced by wrap(behavior)."""
    kinds = {
        (False, False): ("unary_unary", grpc.unary_unary_rpc_method_handler),
        (True, False): ("stream_unary", grpc.stream_unary_rpc_method_handler),
        (False, True): ("unary_stream", grpc.unary_stream_rpc_method_handler),
        (True, True): ("stream_stream", grpc.stream_stream_rpc_method_handler),
    }
    attr, make = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(
        wrap(getattr(handler, attr)),
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


def _behavior(run: Callable, response_streaming: bool) -> Callable:
    """`run` (a generator function) as a behavior: itself, or for a unary answer its value."""

    def unary(request_or_iterator, context):
        try:
            next(run(request_or_iterator, context))
        except StopIteration as done:
            return done.value
        raise RuntimeError("a unary answer yielded a message")

    return run if response_streaming else unary
