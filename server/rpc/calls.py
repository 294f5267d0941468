"""Calls that another thread may end, and the handler rewrapping the interceptors share.

    interceptors = (EndableCalls(), auth, ..., StreamDeadlines(...))  # EndableCalls first
    call = current_call()                       # in a handler: this call's Call
    call.end(grpc.StatusCode.UNAUTHENTICATED, "token revoked")   # from any thread

A handler blocked on its peer cannot end itself, so `end` works with gRPC's public API only:
a request-streaming handler runs on a thread of its own (EndableCalls), and the call's thread,
woken by `end`, aborts the call with the status asked for; a long-poll registers a waker
(`Call.on_end`) and aborts it itself. A send that never completes (a reader that stopped reading)
leaves no thread of ours to wake: after END_GRACE_S `context.cancel()` ends it (CANCELLED).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import queue
import threading
from collections.abc import Callable, Iterator

import grpc

log = logging.getLogger(__name__)

# The one service open to any caller and exempt from limits: orchestrators probe without tokens.
HEALTH_METHOD_PREFIX = "/grpc.health.v1.Health/"
# How long a call asked to end may take to end itself before it is cancelled outright.
END_GRACE_S = 1.0
_DONE, _ENDED, _RESPONSE, _RETURNED, _RAISED = (object() for _ in range(5))

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
    """Gives every call but health checks a Call (current_call), and runs request-streaming
    handlers on a thread of their own so that their wait for the next message can be ended."""

    def __init__(self) -> None:
        self._threads = _HandlerThreads()

    def intercept_service(self, continuation: Callable, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(HEALTH_METHOD_PREFIX):
            return handler
        streaming = handler.response_streaming

        def wrap(behavior):
            def run(request_or_iterator, context):
                call = Call(context)
                token = _current.set(call)
                try:
                    if handler.request_streaming:
                        run = _HandlerRun(call, behavior, request_or_iterator, streaming)
                        return (yield from run.results(self._threads))
                    result = behavior(request_or_iterator, context)
                    if not streaming:
                        return result
                    for response in result:
                        yield response
                        call.abort_if_ended()  # asked to end while it sent: stop here
                    return None
                finally:
                    with contextlib.suppress(ValueError):  # a stream closed from elsewhere
                        _current.reset(token)

            return behavior_from(run, streaming)

        return replace_behavior(handler, wrap)


class _HandlerThreads:
    """Long-lived daemon threads that run handlers, as many as have run at once (gRPC's
    worker_threads bound that). A thread per call instead paid a new thread's first torch
    call, its OpenMP and allocator state, on every push: 0.25 ms of CPU here."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0

    def run(self, job: Callable[[], None]) -> None:
        with self._lock:
            start = self._idle == 0
            self._idle -= not start  # an idle thread is now spoken for
        self._jobs.put(job)
        if start:
            threading.Thread(target=self._work, name="handler", daemon=True).start()

    def _work(self) -> None:
        while True:
            self._jobs.get()()  # a job never raises: _HandlerRun._serve keeps what it raises
            with self._lock:
                self._idle += 1


class _HandlerRun:
    """A request-streaming handler run on a thread of its own, while the call's own thread
    waits for what it returns or yields, or for Call.end. Asked to end while the handler
    waits for the peer's next message, the call's thread ends the call; otherwise the handler
    ends it itself at its next read, so the server's own work is never cut half way. This
    costs a hand-over per call; a reader thread that handed each message over instead cost
    two wake-ups per message (bench/ingest.py --quick: ingest_vs_grpc 0.59 against 0.65)."""

    def __init__(self, call: Call, behavior: Callable, requests: Iterator, streaming: bool):
        self._call = call
        self._lock = threading.Lock()
        self._waiting_on_peer = False
        self._out: queue.SimpleQueue = queue.SimpleQueue()  # (kind, value) for the call's thread
        self._sent = threading.Semaphore(0)  # a streamed response has gone out
        self._closed = False  # the call's thread has stopped listening
        args = (behavior, requests, call.context, streaming)
        context = contextvars.copy_context()  # the handler sees this call's Call
        self._job = lambda: context.run(self._serve, *args)
        call.on_end(lambda: self._out.put((_ENDED, None)))

    def results(self, threads: _HandlerThreads):
        """On the call's thread: the handler's responses; returns what it returns."""
        threads.run(self._job)
        try:
            while True:
                kind, value = self._out.get()
                if kind is _ENDED:
                    with self._lock:
                        if self._waiting_on_peer:
                            self._call.abort_if_ended()
                    continue
                if kind is _RAISED:
                    raise value
                if kind is _RETURNED:
                    return value
                yield value
                self._call.abort_if_ended()  # asked to end while it sent: stop here
                self._sent.release()
        finally:
            self._closed = True
            self._sent.release()

    def _serve(self, behavior, requests, context, streaming: bool) -> None:
        try:
            result = behavior(self._requests(requests), context)
            if streaming:
                for response in result:
                    self._out.put((_RESPONSE, response))
                    self._sent.acquire()
                    if self._closed:  # ended: the rest is never sent
                        getattr(result, "close", lambda: None)()
                        return
                result = None
            self._out.put((_RETURNED, result))
        except BaseException as err:  # noqa: BLE001 - raised on the call's thread
            self._out.put((_RAISED, err))

    def _requests(self, requests: Iterator) -> Iterator:
        while True:
            with self._lock:
                ended = self._call.reason is not None
                self._waiting_on_peer = not ended
            self._call.abort_if_ended()
            try:
                item = next(requests, _DONE)
            finally:
                with self._lock:
                    self._waiting_on_peer = False
            self._call.abort_if_ended()  # asked to end while it waited: what came is dropped
            if item is _DONE:
                return
            yield item


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


def behavior_from(run: Callable, response_streaming: bool) -> Callable:
    """`run` (a generator function) as a behavior: itself, or for a unary answer its value."""

    def unary(request_or_iterator, context):
        try:
            next(run(request_or_iterator, context))
        except StopIteration as done:
            return done.value
        raise RuntimeError("a unary answer yielded a message")

    return run if response_streaming else unary
