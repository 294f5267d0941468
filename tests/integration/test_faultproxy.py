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


def test_proxy_adds_latency_each_way_and_keeps_order() -> None:
    import socket
    import threading
    import time

    echo = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = echo.accept()
        with conn:
            while data := conn.recv(1 << 16):
                conn.sendall(data)

    threading.Thread(target=serve, daemon=True).start()
    proxy = FaultProxy(("127.0.0.1", echo.getsockname()[1]), delay_s=0.2)
    proxy.start()
    try:
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
            message = bytes(range(256)) * 4096  # 1 MiB, many chunks
            started = time.monotonic()
            sock.sendall(message)
            received = b""
            while len(received) < len(message):
                received += sock.recv(1 << 16)
            elapsed = time.monotonic() - started
        assert received == message
        assert elapsed >= 0.4  # 0.2 s out and 0.2 s back
    finally:
        proxy.close()
        echo.close()
