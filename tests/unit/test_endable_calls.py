"""EndableCalls: a request-streaming handler runs on a thread of its own, so a call asked to
end while it waits for its peer ends at once with the status asked for, while one asked to
end during the server's own work finishes that work and ends at its next read."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from types import SimpleNamespace

import grpc
import pytest

from common.retry import wait_until
from server.rpc.calls import EndableCalls, current_call
from tests.support.fakes import FakeServicerContext

PUSH = "/diloco.v1.Aggregator/PushFragment"
WAIT_S = 10  # a bound on each wait; the tests end in milliseconds


def endable(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    details = SimpleNamespace(method=PUSH, invocation_metadata=())
    return EndableCalls().intercept_service(lambda _: handler, details)


def peer(messages: list, silent: threading.Event) -> Iterator:
    """A peer that sends `messages`, then goes silent until `silent` is set."""
    yield from messages
    silent.wait(WAIT_S)


def test_a_call_waiting_for_its_peer_ends_at_once_with_the_status_asked_for() -> None:
    context, silent, calls = FakeServicerContext(), threading.Event(), []

    def handler(requests, ctx) -> int:
        calls.append(current_call())
        return sum(1 for _ in requests)

    outcome: list[Exception] = []

    def serve() -> None:
        try:
            endable(grpc.stream_unary_rpc_method_handler(handler)).stream_unary(
                peer([b"header"], silent), context
            )
        except RuntimeError as err:  # the fake context's abort
            outcome.append(err)

    run = threading.Thread(target=serve)
    run.start()
    try:
        wait_until(lambda: calls, WAIT_S, "the handler started")
        [call] = calls
        call.end(grpc.StatusCode.DEADLINE_EXCEEDED, "no message for 30 s")
        run.join(WAIT_S)  # the peer is still silent
        assert not run.is_alive() and len(outcome) == 1
        assert context.ended == [(grpc.StatusCode.DEADLINE_EXCEEDED, "no message for 30 s")]
    finally:
        silent.set()  # the handler's read returns, and its thread ends


def test_a_call_asked_to_end_during_the_servers_work_finishes_it_first() -> None:
    context, silent = FakeServicerContext(), threading.Event()
    done: list[str] = []

    def handler(requests, ctx) -> int:
        first = next(requests)
        current_call().end(grpc.StatusCode.UNAUTHENTICATED, "token revoked")
        done.append(f"work on {first!r}")  # not cut half way
        next(requests)  # the next read ends the call
        done.append("read on")
        return 0

    with pytest.raises(RuntimeError, match="UNAUTHENTICATED"):
        endable(grpc.stream_unary_rpc_method_handler(handler)).stream_unary(
            peer([b"header", b"chunk"], silent), context
        )
    silent.set()
    assert done == ["work on b'header'"]
    assert context.ended == [(grpc.StatusCode.UNAUTHENTICATED, "token revoked")]


def test_a_handler_answers_and_raises_as_it_would_on_the_calls_thread() -> None:
    context, silent = FakeServicerContext(), threading.Event()
    silent.set()
    counted = endable(grpc.stream_unary_rpc_method_handler(lambda it, ctx: sum(1 for _ in it)))
    assert counted.stream_unary(peer([b"a", b"b"], silent), context) == 2
    error = ValueError("bad push")

    def failing(requests, ctx):
        raise error

    with pytest.raises(ValueError) as raised:
        endable(grpc.stream_unary_rpc_method_handler(failing)).stream_unary(iter(()), context)
    assert raised.value is error  # the same object: gRPC recognises its own errors by identity
    echoed = endable(grpc.stream_stream_rpc_method_handler(lambda it, ctx: (m * 2 for m in it)))
    assert list(echoed.stream_stream(iter([b"a", b"b"]), context)) == [b"aa", b"bb"]
    assert context.ended == []
