"""The gRPC surface of a real server on port 0: health, and bad requests refused cleanly."""

from __future__ import annotations

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.codec.fragment import encode_fragment
from common.generated.diloco.v1 import aggregator_pb2 as pb
from common.generated.diloco.v1 import aggregator_pb2_grpc as pb_grpc
from common.rpc import SERVICE_NAME, create_channel
from learner.client import AggregatorClient

SHAPES = [(4, 8), (8,)]
FINGERPRINT = [pb.ParamSpec(name=f"p{i}", shape=s, dtype="float32") for i, s in enumerate(SHAPES)]


@pytest.fixture
def joined(start_service):
    """A server with one learner joined and version 0 initialized."""
    service = start_service(lease_s=30.0)
    client = AggregatorClient(f"127.0.0.1:{service.port}")
    client.wait_ready(10)
    session = client.join("l0", FINGERPRINT).session_id
    initial = [torch.ones(s) for s in SHAPES]
    header = pb.PushHeader(session_id=session, kind=pb.PUSH_KIND_INITIAL, base_version=-1)
    client.push(header, encode_fragment(initial, "fp32"))
    yield service, client, session
    client.close()


def test_health_reports_serving(start_service) -> None:
    service = start_service()
    with create_channel(f"127.0.0.1:{service.port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for name in ("", SERVICE_NAME):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


def raw_push(client: AggregatorClient, messages: list[pb.PushFragmentRequest]):
    stub = pb_grpc.AggregatorStub(client._channel)
    return stub.PushFragment(iter(messages), timeout=10)


@pytest.mark.parametrize(
    "payload, announced, code, reason",
    [
        (b"\x0a\xff\xff", 3, grpc.StatusCode.INVALID_ARGUMENT, "not a valid EncodedFragment"),
        (b"abc", 1 << 34, grpc.StatusCode.RESOURCE_EXHAUSTED, "exceeds the limit"),
        (b"abcdef", 3, grpc.StatusCode.INVALID_ARGUMENT, "longer than the announced"),
    ],
)
def test_bad_push_is_refused_and_changes_nothing(joined, payload, announced, code, reason):
    service, client, session = joined
    before = service.aggregator.params(0)
    header = pb.PushHeader(
        session_id=session, kind=pb.PUSH_KIND_DELTA, base_version=0, payload_bytes=announced
    )
    with pytest.raises(grpc.RpcError) as err:
        raw_push(
            client, [pb.PushFragmentRequest(header=header), pb.PushFragmentRequest(chunk=payload)]
        )
    assert err.value.code() == code and reason in err.value.details()
    assert service.aggregator.version(0) == 0
    assert all(torch.equal(a, b) for a, b in zip(before, service.aggregator.params(0), strict=True))
    # The learner can still push a good update to the same round afterwards.
    good = encode_fragment([torch.zeros(s) for s in SHAPES], "fp4_e2m1")
    assert client.push(
        pb.PushHeader(session_id=session, kind=pb.PUSH_KIND_DELTA, base_version=0), good
    ).accepted


def test_push_without_header_and_unknown_session(joined) -> None:
    _, client, _ = joined
    with pytest.raises(grpc.RpcError) as err:
        raw_push(client, [pb.PushFragmentRequest(chunk=b"x")])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as err:
        client.pull("no-such-session", 0, -1)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_pull_returns_snapshot_then_up_to_date(joined) -> None:
    _, client, session = joined
    header, payload = client.pull(session, 0, have_version=-1)
    assert header.kind == pb.PULL_KIND_SNAPSHOT and header.version == 0 and payload
    header, payload = client.pull(session, 0, have_version=0)
    assert header.kind == pb.PULL_KIND_UP_TO_DATE and payload == b""
    # Waiting for a version that never comes returns after the timeout, still up to date.
    header, _ = client.pull(session, 0, have_version=0, wait_for_version=1, wait_timeout_s=0.2)
    assert header.kind == pb.PULL_KIND_UP_TO_DATE


def test_fingerprint_mismatch_is_refused(joined) -> None:
    _, client, _ = joined
    other = [pb.ParamSpec(name="p0", shape=[4, 9], dtype="float32"), FINGERPRINT[1]]
    with pytest.raises(grpc.RpcError) as err:
        client.join("l1", other)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "differs at parameter p0" in err.value.details()
