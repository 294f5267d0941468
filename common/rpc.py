"""One place that sets message limits, keepalive, retries and TLS for servers and channels.

server, port = create_server("127.0.0.1:0", credentials)   # unstarted; port 0: a free port
channel = create_channel(f"127.0.0.1:{port}", credentials)  # credentials None: plaintext
"""

from __future__ import annotations

import json
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common.codec.fragment import CHUNK_BYTES

SERVICE_NAME = "diloco.v1.Aggregator"
# Metadata key naming the learner a call's token belongs to (server/rpc/auth.py).
LEARNER_ID_HEADER = "x-diloco-learner-id"
# Trailing metadata of a refusal that is worth retrying after this many milliseconds (a rate
# limit, server/rpc/limits.py); common/retry.py honours it.
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
    # gRPC binds with SO_REUSEPORT by default: a second server on a port in use would start
    # and silently take half its connections. A port in use must be an error instead.
    ("grpc.so_reuseport", 0),
]
# The plaintext health-only server: requests are a service name, so a few KiB is plenty.
_HEALTH_MESSAGE_BYTES = 4096
# A channel that failed to connect tries again after gRPC's backoff, by default up to 120 s:
# a learner could sit that long idle after its server is back. Trying every 2 s at most is
# cheap (one TCP connect) and bounds the rejoin after a server restart.
_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 500),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]
# Threads that answer health checks, apart from the learners' (create_server).
HEALTH_THREADS = 2
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
    max_concurrent_streams: int = 100,
    health_servicer: health.HealthServicer | None = None,
) -> tuple[grpc.Server, int]:
    """An unstarted gRPC server bound to `listen` (host:port) with the health service; TLS
    with `credentials` (common/tls.py), plaintext without.

    Long-polling pulls each hold a thread while they wait, so the pool is sized for a few
    hundred learners rather than for CPU cores. A connection may have at most
    `max_concurrent_streams` calls open (HTTP/2 SETTINGS): gRPC clients queue the rest; a
    client that ignores the setting has the excess refused (RST_STREAM REFUSED_STREAM, which
    its gRPC stack reports as UNAVAILABLE). Health checks run on a pool of their own: a flood
    of them cannot take the learners' threads, nor can calls that fill the main pool delay
    them (a Watch holds no thread at all). `health_servicer` (new_health) lets the caller set
    the status it reports; default: one that always says SERVING.
    """
    options = [*_SERVER_OPTIONS, ("grpc.max_concurrent_streams", max_concurrent_streams)]
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="rpc"),
        options=options,
        interceptors=interceptors,
    )
    port = _bind(server, listen, credentials, "the gRPC server")
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer or new_health(), server)
    return server, port


def _bind(
    server: grpc.Server, listen: str, credentials: grpc.ServerCredentials | None, what: str
) -> int:
    """The port `server` bound on `listen` (TLS with `credentials`, plaintext without); an
    OSError in one sentence if it cannot bind (grpc raises RuntimeError or returns 0, by
    version)."""
    try:
        if credentials is None:
            port = server.add_insecure_port(listen)
        else:
            port = server.add_secure_port(listen, credentials)
    except RuntimeError:
        port = 0
    if port == 0:
        raise OSError(f"could not bind {what} to {listen} (in use, or not an address here)")
    return port


def create_health_server(
    listen: str, health_servicer: health.HealthServicer | None = None
) -> tuple[grpc.Server, int]:
    """An unstarted plaintext gRPC server on `listen` with the health service alone, for
    probes that cannot speak TLS (Kubernetes' grpc probe). Given the main server's
    `health_servicer` it answers as that does, and offers nothing else."""
    options = [
        *(o for o in _SERVER_OPTIONS if o[0] != "grpc.max_receive_message_length"),
        ("grpc.max_receive_message_length", _HEALTH_MESSAGE_BYTES),
        ("grpc.max_concurrent_streams", 8),
    ]
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=HEALTH_THREADS, thread_name_prefix="health-rpc"),
        options=options,
    )
    port = _bind(server, listen, None, "the health server")
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer or new_health(), server)
    return server, port


def new_health() -> health.HealthServicer:
    """grpc's health service saying SERVING (for the server and SERVICE_NAME), with Check
    run on HEALTH_THREADS threads of its own; `set_serving` changes what it says."""
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
    check = servicer.Check

    def own_pool_check(request, context):
        return check(request, context)

    # grpc runs a behaviour with this attribute on that pool instead of the server's.
    own_pool_check.experimental_thread_pool = futures.ThreadPoolExecutor(  # type: ignore[attr-defined]
        max_workers=HEALTH_THREADS, thread_name_prefix="health"
    )
    servicer.Check = own_pool_check
    return servicer


def set_serving(servicer: health.HealthServicer, serving: bool) -> None:
    """Say SERVING or NOT_SERVING, for the server and SERVICE_NAME (Check and Watch)."""
    status = (
        health_pb2.HealthCheckResponse.SERVING
        if serving
        else health_pb2.HealthCheckResponse.NOT_SERVING
    )
    for name in ("", SERVICE_NAME):
        servicer.set(name, status)


def create_channel(target: str, credentials: grpc.ChannelCredentials | None = None) -> grpc.Channel:
    """A client channel with the same message limits, keepalive, a retry policy and a bounded
    reconnect backoff; TLS with
    `credentials`, plaintext without. Each channel has a connection of its own, as a learner
    process does (gRPC would otherwise share one between a process's channels to the same
    server, and simulated learners would queue behind each other's calls)."""
    options = [
        *_COMMON_OPTIONS,
        *_CHANNEL_OPTIONS,
        ("grpc.service_config", json.dumps(_RETRY_SERVICE_CONFIG)),
        ("grpc.use_local_subchannel_pool", 1),
    ]
    if credentials is None:
        return grpc.insecure_channel(target, options=options)
    return grpc.secure_channel(target, credentials, options=options)
