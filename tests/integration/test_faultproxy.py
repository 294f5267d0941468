"""The fault-injecting proxy forwards gRPC traffic and cuts it on command."""

import grpc
import pytest

from common.generated.diloco.v1 import aggregator_pb2 as pb
from deploy.faultproxy import FaultProxy
from learner.client import AggregatorClient

SPECS = [pb.ParamSpec(name="w", shape=[4], dtype="float32")]


def test_proxy_forwards_cuts_and_restores(start_service) -> None:
    service = start_service()
    proxy = FaultProxy(("127.0.0.1", service.port))
    proxy.start()
    client = AggregatorClient(f"127.0.0.1:{proxy.port}")
    try:
        client.wait_ready(10)
        session = client.join("l0", SPECS).session_id
        proxy.cut()
        with pytest.raises(grpc.RpcError) as err:
            client.heartbeat(pb.HeartbeatRequest(session_id=session))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        proxy.restore()
        client.wait_ready(30)
        assert client.heartbeat(pb.HeartbeatRequest(session_id=session)).live_learners == 1
        assert proxy.cuts == 1
    finally:
        client.close()
        proxy.close()
