"""Bounds on what hostile or careless callers can hold on a real server: reflection off by
default and behind tokens, abandoned long-polls free their worker, calls open per learner."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import torch
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from common.generated.diloco.v1 import aggregator_pb2 as pb
from common.generated.diloco.v1 import aggregator_pb2_grpc as pb_grpc
from common.retry import wait_until
from common.rpc import LEARNER_ID_HEADER, SERVICE_NAME, create_channel
from common.wire import encode_fragment
from server.auth import add_token

SHAPES = [(4,)]
SPECS = [pb.ParamSpec(name="w", shape=[4], dtype="float32")]


def list_services(channel: grpc.Channel, metadata=()) -> list[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    reply = next(stub.ServerReflectionInfo(iter([request]), metadata=metadata, timeout=10))
    return [s.name for s in reply.list_services_response.service]


def code_of(call) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


def test_reflection_is_off_by_default(start_service) -> None:
    service = start_service()
    with create_channel(f"127.0.0.1:{service.port}") as channel:
        assert code_of(lambda: list_services(channel)) == grpc.StatusCode.UNIMPLEMENTED


def test_reflection_needs_a_token_when_auth_is_on(start_service, tmp_path: Path) -> None:
    path = tmp_path / "tokens.txt"
    token = add_token(str(path), "a")
    service = start_service(auth_token_file=str(path), reflection=True)
    with create_channel(f"127.0.0.1:{service.port}") as channel:
        assert code_of(lambda: list_services(channel)) == grpc.StatusCode.UNAUTHENTICATED
        metadata = ((LEARNER_ID_HEADER, "a"), ("authorization", f"Bearer {token}"))
        assert SERVICE_NAME in list_services(channel, metadata)


def joined_session(stub, learner_id: str, initialize: bool = False) -> str:
    metadata = ((LEARNER_ID_HEADER, learner_id),)
    join = stub.Join(pb.JoinRequest(learner_id=learner_id, fingerprint=SPECS), metadata=metadata)
    if initialize:
        header = pb.PushHeader(
            session_id=join.session_id, kind=pb.PUSH_KIND_INITIAL, base_version=-1
        )
        payload = encode_fragment([torch.ones(s) for s in SHAPES], "fp32")
        header.payload_bytes = len(payload)
        messages = [pb.PushFragmentRequest(header=header), pb.PushFragmentRequest(chunk=payload)]
        stub.PushFragment(iter(messages), metadata=metadata, timeout=10)
    return join.session_id


def long_poll(stub, session: str, learner_id: str):
    """A PullParams waiting for a version that does not come; the call starts at once."""
    request = pb.PullParamsRequest(
        session_id=session, have_version=0, wait_for_version=1, wait_timeout_s=60
    )
    return stub.PullParams(request, metadata=((LEARNER_ID_HEADER, learner_id),), timeout=120)


@pytest.fixture
def server(start_service):
    service = start_service(lease_s=60.0, max_calls_in_flight=4)
    with create_channel(f"127.0.0.1:{service.port}") as channel:
        stub = pb_grpc.AggregatorStub(channel)
        yield service, stub, joined_session(stub, "a", initialize=True)


def test_abandoned_long_polls_free_their_workers(server) -> None:
    service, stub, session = server
    registry = service.metrics.registry

    def waiting() -> float | None:
        return registry.get_sample_value("diloco_server_waiting_pulls")

    polls = [long_poll(stub, session, "a") for _ in range(4)]
    wait_until(lambda: waiting() == 4, 10, "4 long-polls waiting")
    for poll in polls:
        poll.cancel()
    # Each poll would otherwise hold its worker for its whole 60 s wait.
    wait_until(lambda: waiting() == 0 and service.in_flight.open_calls() == 0, 10, "polls ended")


def test_calls_open_per_learner_are_bounded(server) -> None:
    service, stub, session = server
    polls = [long_poll(stub, session, "a") for _ in range(4)]
    registry = service.metrics.registry
    wait_until(
        lambda: registry.get_sample_value("diloco_server_waiting_pulls") == 4, 10, "4 waiting"
    )
    with pytest.raises(grpc.RpcError) as err:
        list(long_poll(stub, session, "a"))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_calls_in_flight" in err.value.details()
    # Another learner, on the same connection, is not affected.
    other = joined_session(stub, "b")
    metadata = ((LEARNER_ID_HEADER, "b"),)
    assert stub.Heartbeat(pb.HeartbeatRequest(session_id=other), metadata=metadata, timeout=10)
    refused = "diloco_server_in_flight_limited_calls_total"
    assert registry.get_sample_value(refused, {"method": "PullParams"}) == 1
    for poll in polls:
        poll.cancel()
