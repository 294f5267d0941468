"""StreamDeadlines on a fake clock: which streams are cut, when, why, and what is counted."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import grpc
import pytest

from common.generated.diloco.v1 import aggregator_pb2 as pb
from server.deadlines import StreamDeadlines
from tests.support.fakes import FakeClock, FakeServicerContext

PUSH = "/diloco.v1.Aggregator/PushFragment"
PULL = "/diloco.v1.Aggregator/PullParams"


def intercepted(deadlines: StreamDeadlines, method: str, handler) -> grpc.RpcMethodHandler:
    details = SimpleNamespace(method=method, invocation_metadata=())
    return deadlines.intercept_service(lambda _: handler, details)


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
    intercepted(deadlines, PUSH, handler).stream_unary(requests(), context)
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


def test_unary_calls_and_health_checks_are_not_watched(deadlines) -> None:
    unary = grpc.unary_unary_rpc_method_handler(lambda request, ctx: None)
    assert intercepted(deadlines, "/diloco.v1.Aggregator/Heartbeat", unary) is unary
    watch = grpc.unary_stream_rpc_method_handler(lambda request, ctx: iter(()))
    assert intercepted(deadlines, "/grpc.health.v1.Health/Watch", watch) is watch
