"""A learner over its call rate is refused with RESOURCE_EXHAUSTED and a retry hint; others,
and health checks, are not affected; refusals are counted in metrics."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.generated.diloco.v1 import aggregator_pb2 as pb
from common.generated.diloco.v1 import aggregator_pb2_grpc as pb_grpc
from common.retry import retry_after_s
from common.rpc import LEARNER_ID_HEADER, create_channel

SPECS = [pb.ParamSpec(name="w", shape=[4], dtype="float32")]


def heartbeat_code(stub, learner_id: str) -> tuple[grpc.StatusCode, float | None]:
    try:
        stub.Heartbeat(
            pb.HeartbeatRequest(session_id="none"),
            metadata=((LEARNER_ID_HEADER, learner_id),),
            timeout=10,
        )
    except grpc.RpcError as err:
        return err.code(), retry_after_s(err)
    return grpc.StatusCode.OK, None


def test_flooding_learner_is_limited_alone(start_service) -> None:
    # A rate far below the test's call rate: refill is negligible while the test runs.
    service = start_service(rate_limit_calls_per_s=0.01, rate_limit_burst=5)
    with create_channel(f"127.0.0.1:{service.port}") as channel:
        stub = pb_grpc.AggregatorStub(channel)
        # An unknown session is NOT_FOUND: admitted calls reach the servicer.
        first = [heartbeat_code(stub, "flood")[0] for _ in range(5)]
        assert first == [grpc.StatusCode.NOT_FOUND] * 5
        code, wait_s = heartbeat_code(stub, "flood")
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and wait_s is not None and wait_s > 1
        # Refused before the request is used: a Join over the limit creates no session.
        try:
            stub.Join(
                pb.JoinRequest(learner_id="flood", fingerprint=SPECS),
                metadata=((LEARNER_ID_HEADER, "flood"),),
                timeout=10,
            )
            raise AssertionError("the Join over the limit was accepted")
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "rate limit" in err.details()
        assert service.aggregator.live_learners() == []
        assert heartbeat_code(stub, "polite")[0] == grpc.StatusCode.NOT_FOUND
        health = health_pb2_grpc.HealthStub(channel)
        for _ in range(10):
            assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == 1
    registry = service.metrics.registry
    assert (
        registry.get_sample_value("diloco_server_rate_limited_calls_total", {"method": "Heartbeat"})
        == 1
    )
    assert (
        registry.get_sample_value("diloco_server_rate_limited_calls_total", {"method": "Join"}) == 1
    )
