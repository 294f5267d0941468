"""The running aggregator service: gRPC server, servicer, health, reflection and lease reaper.

    service = AggregatorService(ServerConfig(listen="127.0.0.1:0", insecure=True))
    service.start()            # service.port is the bound port
    ...
    service.stop()

Used by `diloco-server` and by integration tests, which run it in-process on port 0.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import grpc
from grpc_reflection.v1alpha import reflection

from common.generated.diloco.v1 import aggregator_pb2 as pb
from common.generated.diloco.v1 import aggregator_pb2_grpc as pb_grpc
from common.metrics_http import check_listen, write_port_file
from common.rpc import SERVICE_NAME, create_server
from common.tls import server_credentials
from server.aggregator import Aggregator, AggregatorConfig
from server.auth import TokenAuth
from server.metrics import ServerMetrics
from server.ratelimit import RateLimit
from server.servicer import AggregatorServicer

log = logging.getLogger("diloco.server")

TICK_S = 0.05


@dataclass(kw_only=True)
class ServerConfig(AggregatorConfig):
    listen: str = "127.0.0.1:50051"
    """host:port to serve gRPC on; port 0 picks a free port."""
    port_file: str = ""
    """If set, write the bound port to this file once serving (for launchers using port 0)."""
    log_level: str = "INFO"
    """Python logging level."""
    metrics_listen: str = ""
    """host:port for the Prometheus endpoint (/metrics), e.g. 0.0.0.0:9100; empty: off."""
    metrics_port_file: str = ""
    """If set, write the bound metrics port to this file (for launchers using port 0)."""
    tls_cert: str = ""
    """PEM certificate chain the server presents (with tls_key): serve over TLS."""
    tls_key: str = ""
    """PEM private key of tls_cert."""
    tls_client_ca: str = ""
    """PEM CA that must have signed every learner's client certificate (mutual TLS)."""
    insecure: bool = False
    """Serve in plaintext, without TLS: only on a trusted network (logs a warning)."""
    auth_token_file: str = ""
    """Per-learner tokens (`diloco-token add FILE ID`); SIGHUP reloads. Empty: off."""
    rate_limit_calls_per_s: float = 100.0
    """Each learner may make this many calls per second on average (0: no limit); a
    learner over it is told to retry later (server/ratelimit.py)."""
    rate_limit_burst: int = 200
    """Calls a learner may make at once before rate_limit_calls_per_s applies."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if ":" not in self.listen:
            raise ValueError(f"listen must be host:port, got {self.listen!r}")
        check_listen("metrics_listen", self.metrics_listen)
        if not self.rate_limit_calls_per_s >= 0 or self.rate_limit_burst < 1:
            raise ValueError("rate_limit_calls_per_s must be >= 0 and rate_limit_burst >= 1")
        tls = bool(self.tls_cert or self.tls_key or self.tls_client_ca)
        if self.insecure and tls:
            raise ValueError("insecure and tls_* settings exclude each other: choose one")
        if not self.insecure and not (self.tls_cert and self.tls_key):
            raise ValueError(
                "set tls_cert and tls_key to serve over TLS, or insecure to serve in "
                "plaintext (trusted networks only)"
            )

    def credentials(self) -> grpc.ServerCredentials | None:
        """The TLS credentials to serve with; None when insecure."""
        if self.insecure:
            return None
        return server_credentials(self.tls_cert, self.tls_key, self.tls_client_ca)


class AggregatorService:
    """Owns the Aggregator, its gRPC server and the thread that expires leases."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.metrics = ServerMetrics()
        self.aggregator = Aggregator(config, events=self.metrics)
        if config.insecure:
            log.warning(
                "serving WITHOUT TLS (insecure): anyone who can reach %s can read and send "
                "parameters; use tls_cert/tls_key outside a trusted network",
                config.listen,
            )
        self.auth = TokenAuth(config.auth_token_file) if config.auth_token_file else None
        self.rate_limit = (
            RateLimit(config.rate_limit_calls_per_s, config.rate_limit_burst)
            if config.rate_limit_calls_per_s > 0
            else None
        )
        # Authentication first: the limiter then keys on verified learner ids.
        interceptors = tuple(i for i in (self.auth, self.rate_limit) if i is not None)
        self._server, self.port = create_server(
            config.listen, config.credentials(), interceptors=interceptors
        )
        self.servicer = AggregatorServicer(self.aggregator)
        self.metrics.watch(self.aggregator, self.servicer, self.rate_limit)
        pb_grpc.add_AggregatorServicer_to_server(self.servicer, self._server)
        reflection.enable_server_reflection(
            (pb.DESCRIPTOR.services_by_name["Aggregator"].full_name, reflection.SERVICE_NAME),
            self._server,
        )
        self._stopping = threading.Event()
        self._reaper = threading.Thread(target=self._expire_leases, name="reaper", daemon=True)

    def start(self) -> None:
        self._server.start()
        self._reaper.start()
        log.info(
            "serving %s on port %d mode=%s epoch=%d",
            SERVICE_NAME,
            self.port,
            self.config.mode,
            self.aggregator.server_epoch,
        )
        if self.config.port_file:
            write_port_file(self.config.port_file, self.port)

    def stop(self, grace_s: float = 2.0) -> None:
        self._stopping.set()
        self._server.stop(grace=grace_s).wait()
        self.aggregator.checkpoint()
        for fid, counts in self.servicer.traffic.by_fragment().items():
            log.info(
                "fragment=%d bytes_received=%d bytes_sent=%d",
                fid,
                counts["received"],
                counts["sent"],
            )
        log.info("stopped")

    def _expire_leases(self) -> None:
        # Often enough for grace windows; a dead learner is dropped within a lease and a tick.
        while not self._stopping.wait(min(self.config.lease_s / 4, TICK_S)):
            try:
                self.aggregator.tick()
            except Exception:  # noqa: BLE001 - leases must keep expiring whatever happened
                log.exception("tick failed; trying again at the next one")
