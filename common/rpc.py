"""One place that sets message limits, keepalive, retries and TLS for servers and channels.

server, port = create_server("127.0.0.1:0", credentials)   # unstarted; port 0: a free port
channel = create_channel(f"127.0.0.1:{port}", credentials)  # credentials None: plaintext
"""

from __future__ import annotations

import json
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common.wire import CHUNK_BYTES

SERVICE_NAME = "diloco.v1.Aggregator"
# Metadata key naming the learner a call's token belongs to (server/auth.py).
LEARNER_ID_HEADER = "x-diloco-learner-id"
# Trailing metadata of a refusal that is worth retrying after this many milliseconds (a rate
# limit, server/ratelimit.py); common/retry.py honours it.
RETRY_AFTER_HEADER = "x-diloco-retry-after-ms"
# Chunks are 1 MiB; leave room for headers and a few chunks batched by the transport.
MAX_MESSAGE_BYTES = 4 * CHUNK_BYTES + (64 << 10)

_COMMON_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
]
_SERVER_OPTIONS = [
    *_COMMON_OPTIONS,
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
]
# Unary calls that are safe to repeat are retried by gRPC itself on UNAVAILABLE.
_RETRY_SERVICE_CONFIG = {
    "methodConfig": [
        {
            "name": [
                {"service": SERVICE_NAME, "method": m} for m in ("Join", "Heartbeat", "Leave")
            ],
            "retryPolicy": {
                "maxAttempts": 5,
                "initialBackoff": "0.2s",
                "maxBackoff": "5s",
                "backoffMultiplier": 2,
                "retryableStatusCodes": ["UNAVAILABLE"],
            },
        }
    ]
}


def create_server(
    listen: str,
    credentials: grpc.ServerCredentials | None = None,
    max_workers: int = 256,
    interceptors: tuple[grpc.ServerInterceptor, ...] = (),
) -> tuple[grpc.Server, int]:
    """An unstarted gRPC server bound to `listen` (host:port) with the health service; TLS
    with `credentials` (common/tls.py), plaintext without.

    Long-polling pulls each hold a thread while they wait, so the pool is sized for a few
    hundred learners rather than for CPU cores.
    """
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="rpc"),
        options=_SERVER_OPTIONS,
        interceptors=interceptors,
    )
    if credentials is None:
        port = server.add_insecure_port(listen)
    else:
        port = server.add_secure_port(listen, credentials)
    if port == 0:
        raise OSError(f"could not bind the gRPC server to {listen}")
    health_servicer = health.HealthServicer()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    return server, port


def create_channel(target: str, credentials: grpc.ChannelCredentials | None = None) -> grpc.Channel:
    """A client channel with the same message limits, keepalive and a retry policy; TLS with
    `credentials`, plaintext without."""
    options = [*_COMMON_OPTIONS, ("grpc.service_config", json.dumps(_RETRY_SERVICE_CONFIG))]
    if credentials is None:
        return grpc.insecure_channel(target, options=options)
    return grpc.secure_channel(target, credentials, options=options)
