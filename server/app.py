"""The running aggregator service: gRPC server, servicer, health (also on a plaintext port of
its own when health_listen is set), reflection (when on) and the reaper that expires leases
and cuts overdue streams.

    config = build_config(ServerConfig, {"listen": "127.0.0.1:0", "insecure": True})
    service = AggregatorService(config)
    service.start()            # service.port is the bound port
    ...
    service.stop()

Used by `diloco-server` and by integration tests, which run it in-process on port 0.
"""

from __future__ import annotations

import logging
import threading

from grpc_reflection.v1alpha import reflection

from common.generated.diloco.v1 import aggregator_pb2 as pb
from common.generated.diloco.v1 import aggregator_pb2_grpc as pb_grpc
from common.metrics_http import write_port_file
from common.rpc import SERVICE_NAME, create_health_server, create_server
from server.aggregator import Aggregator
from server.auth import TokenAuth
from server.cert_identity import CertificateIdentity
from server.config import ServerConfig
from server.deadlines import StreamDeadlines
from server.inflight import InFlightLimit
from server.metrics import ServerMetrics
from server.push_wire import ChunkViews
from server.ratelimit import RateLimit
from server.receive import PushBudget
from server.servicer import AggregatorServicer

log = logging.getLogger("diloco.server")

TICK_S = 0.05


class AggregatorService:
    """Owns the Aggregator, its gRPC server and the thread that expires leases."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.metrics = ServerMetrics()
        self.aggregator = Aggregator(config, events=self.metrics)
        network, limits = config.network, config.limits
        if network.insecure:
            log.warning(
                "serving WITHOUT TLS (insecure): anyone who can reach %s can read and send "
                "parameters; use tls_cert/tls_key outside a trusted network",
                network.listen,
            )
        self.auth = TokenAuth(network.auth_token_file) if network.auth_token_file else None
        self.rate_limit = (
            RateLimit(limits.rate_limit_calls_per_s, limits.rate_limit_burst)
            if limits.rate_limit_calls_per_s > 0
            else None
        )
        self.in_flight = (
            InFlightLimit(limits.max_calls_in_flight) if limits.max_calls_in_flight > 0 else None
        )
        self.deadlines = (
            StreamDeadlines(limits.stream_idle_timeout_s, limits.stream_min_bytes_per_s)
            if limits.stream_idle_timeout_s > 0
            else None
        )
        # Authentication first: the limits then key on verified learner ids. Deadlines last:
        # they watch the handler's own waits on its peer.
        # ChunkViews first: it gives PushFragment a request deserializer whatever the others do.
        identity = CertificateIdentity() if network.tls_client_id_from_cert else None
        chain = (ChunkViews(), self.auth, identity, self.rate_limit, self.in_flight, self.deadlines)
        self._server, self.port = create_server(
            network.listen,
            network.credentials(),
            max_workers=limits.worker_threads,
            interceptors=tuple(i for i in chain if i is not None),
            max_concurrent_streams=limits.max_concurrent_streams,
        )
        mb = limits.push_memory_budget_mb
        budget = PushBudget(
            int(mb * 2**20) if mb else None,
            limits.push_budget_wait_s,
            drain=self.aggregator.settle_deferred,
        )
        self.servicer = AggregatorServicer(self.aggregator, push_budget=budget)
        self.metrics.watch(self.aggregator, self.servicer, self.rate_limit, self.in_flight)
        self.metrics.watch_cuts(self.deadlines, self.auth)
        pb_grpc.add_AggregatorServicer_to_server(self.servicer, self._server)
        if network.reflection:
            reflection.enable_server_reflection(
                (pb.DESCRIPTOR.services_by_name["Aggregator"].full_name, reflection.SERVICE_NAME),
                self._server,
            )
        # Plaintext health for probes that cannot speak TLS: a server of its own, so that
        # nothing else is ever served without the main port's TLS.
        self._health_server, self.health_port = (
            create_health_server(network.health_listen) if network.health_listen else (None, 0)
        )
        self._stopping = threading.Event()
        self._reaper = threading.Thread(target=self._expire_leases, name="reaper", daemon=True)

    def start(self) -> None:
        """Serve; if any part cannot start, whatever did is stopped and the error raised."""
        try:
            self._start()
        except BaseException:
            self._stopping.set()  # the reaper, if it started
            # wait(): stop() only begins a shutdown; the ports are free once it is done.
            self._server.stop(grace=0).wait()
            if self._health_server is not None:
                self._health_server.stop(grace=0).wait()
            raise

    def _start(self) -> None:
        self._server.start()
        if self._health_server is not None:
            self._health_server.start()
            log.info("serving grpc.health.v1 alone, in plaintext, on port %d", self.health_port)
        self._reaper.start()
        log.info(
            "serving %s on port %d mode=%s epoch=%d",
            SERVICE_NAME,
            self.port,
            self.config.rounds.mode,
            self.aggregator.server_epoch,
        )
        if self.config.network.port_file:
            write_port_file(self.config.network.port_file, self.port)

    def stop(self, grace_s: float = 2.0) -> None:
        self._stopping.set()
        if self._health_server is not None:
            self._health_server.stop(grace=0).wait()  # first: probes see it going at once
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
        # Often enough for grace windows; a dead learner is dropped within a lease and a tick,
        # a stream past its deadline is cut within a tick.
        while not self._stopping.wait(min(self.config.membership.lease_s / 4, TICK_S)):
            chores = (self.aggregator.tick, self.deadlines.sweep if self.deadlines else None)
            for chore in filter(None, chores):
                try:
                    chore()
                except Exception:  # noqa: BLE001 - leases must keep expiring whatever happened
                    log.exception("tick failed; trying again at the next one")
