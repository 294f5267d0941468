"""StreamDeadlines (inside EndableCalls) on a fake clock: which streams are cut, when, why, and
what is counted."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import grpc
import pytest

from common.generated.diloco.v1 import aggregator_pb2 as pb
from common.retry import wait_until
from server.rpc.calls import EndableCalls
from server.rpc.limits import StreamDeadlines
from tests.support.fakes import FakeClock, FakeServicerContext

PUSH = "/diloco.v1.Aggregator/PushFragment"
PULL = "/diloco.v1.Aggregator/PullParams"


def intercepted(deadlines: StreamDeadlines, method: str, handler) -> grpc.RpcMethodHandler:
    """The handler inside the deadlines, inside EndableCalls, as the service chains them."""
    details = SimpleNamespace(method=method, invocation_metadata=())
    inner = lambda d: deadlines.intercept_service(lambda _: handler, d)  # noqa: E731
    return EndableCalls().intercept_service(inner, details)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def deadlines(clock: FakeClock) -> StreamDeadlines:
    return StreamDeadlines(idle_timeout_s=2, min_bytes_per_s=100, clock=clock)


def header(payload_bytes: int) -> pb.PushFragmentRequest:
    return pb.PushFragmentRequest(header=pb.PushHeader(payload_bytes=payload_bytes))


def chunk() -> pb.PushFragmentRequest:
    return pb.PushFragmentRequest(chunk=b"x")


def push_through(deadlines, clock, steps) -> FakeServicerContext:
    """A push whose request stream advances the clock by each step's seconds (the peer's
    delay before the message) and sweeps, as the service's tick would meanwhile."""
    context = FakeServicerContext()

    def requests() -> Iterator[pb.PushFragmentRequest]:
        for delay_s, message in steps:
            clock.now += delay_s
            deadlines.sweep()
            yield message

    handler = grpc.stream_unary_rpc_method_handler(lambda it, ctx: sum(1 for _ in it))
    try:
        intercepted(deadlines, PUSH, handler).stream_unary(requests(), context)
    except RuntimeError as err:  # the fake context's abort
        assert "aborted" in str(err)
    return context


def test_a_peer_silent_past_the_idle_timeout_is_cut(deadlines, clock) -> None:
    context = push_through(deadlines, clock, [(0, header(10)), (1.5, chunk()), (2.5, chunk())])
    assert [code for code, _ in context.ended] == [grpc.StatusCode.DEADLINE_EXCEEDED]
    assert "stream_idle_timeout_s" in context.ended[0][1]
    assert deadlines.cut_counts() == {"idle": 1}
    assert deadlines.open_streams() == 0


def test_a_trickle_never_idle_is_cut_past_its_payload_bound(deadlines, clock) -> None:
    # 1000 bytes at 100 bytes/s: 2 s of grace + 10 s; a chunk every 1.5 s is never idle.
    steps = [(0, header(1000))] + [(1.5, chunk()) for _ in range(9)]
    context = push_through(deadlines, clock, steps)
    assert len(context.ended) == 1 and "stream_min_bytes_per_s" in context.ended[0][1]
    assert deadlines.cut_counts() == {"slow": 1}


def test_a_steady_push_and_the_servers_own_work_are_not_cut(deadlines, clock) -> None:
    context = push_through(deadlines, clock, [(0, header(1000))] + [(1.5, chunk())] * 6)
    clock.now += 60  # the push is decoded after its last chunk: not the peer's time
    deadlines.sweep()
    assert context.ended == [] and deadlines.cut_counts() == {}


def test_a_received_push_is_not_cut_while_the_server_works_on_it(deadlines, clock) -> None:
    # All bytes in within the payload bound; the handler then waits for an ingest slot and
    # decodes past it (a busy server): the peer is not waited on, so nothing is cut.
    context = FakeServicerContext()
    steps = [(0, header(1000)), (1.0, chunk())]

    def requests() -> Iterator[pb.PushFragmentRequest]:
        for delay_s, message in steps:
            clock.now += delay_s
            yield message

    def handler_work(it, ctx) -> int:
        received = sum(1 for _ in it)
        clock.now += 60
        assert deadlines.sweep() == 0
        return received

    handler = grpc.stream_unary_rpc_method_handler(handler_work)
    assert intercepted(deadlines, PUSH, handler).stream_unary(requests(), context) == 2
    assert context.ended == [] and deadlines.cut_counts() == {}


def test_a_pull_is_watched_while_sending_not_while_waiting(deadlines, clock) -> None:
    context = FakeServicerContext()

    def pull(request, ctx) -> Iterator[pb.PullParamsResponse]:
        clock.now += 30  # a long-poll's wait for its version
        deadlines.sweep()
        yield pb.PullParamsResponse(header=pb.PullHeader(payload_bytes=10))
        yield pb.PullParamsResponse(chunk=b"x" * 10)

    handler = grpc.unary_stream_rpc_method_handler(pull)
    responses = intercepted(deadlines, PULL, handler).unary_stream(None, context)
    next(responses)
    assert context.ended == []
    clock.now += 2.5  # gRPC has not asked for the next message: the reader is not reading
    assert deadlines.sweep() == 1 and deadlines.cut_counts() == {"idle": 1}
    # A send stuck on a reader that stopped reading leaves no thread of ours to wake: the
    # call is cancelled once END_GRACE_S has passed.
    wait_until(lambda: context.ended, 10, "the stuck pull cancelled")
    assert context.ended == [(grpc.StatusCode.CANCELLED, "")]


def test_a_cut_between_messages_ends_the_stream_with_its_reason(deadlines, clock) -> None:
    context = FakeServicerContext()

    def pull(request, ctx) -> Iterator[pb.PullParamsResponse]:
        yield pb.PullParamsResponse(header=pb.PullHeader(payload_bytes=10))
        yield pb.PullParamsResponse(chunk=b"x" * 10)

    handler = grpc.unary_stream_rpc_method_handler(pull)
    responses = intercepted(deadlines, PULL, handler).unary_stream(None, context)
    next(responses)
    clock.now += 2.5
    assert deadlines.sweep() == 1
    with pytest.raises(RuntimeError, match="aborted: DEADLINE_EXCEEDED"):
        next(responses)  # gRPC asks for the next message: the handler ends the call itself


def test_unary_calls_and_health_checks_are_not_watched(deadlines) -> None:
    def alone(method: str, handler) -> grpc.RpcMethodHandler:
        details = SimpleNamespace(method=method, invocation_metadata=())
        return deadlines.intercept_service(lambda _: handler, details)

    unary = grpc.unary_unary_rpc_method_handler(lambda request, ctx: None)
    assert alone("/diloco.v1.Aggregator/Heartbeat", unary) is unary
    watch = grpc.unary_stream_rpc_method_handler(lambda request, ctx: iter(()))
    assert alone("/grpc.health.v1.Health/Watch", watch) is watch
