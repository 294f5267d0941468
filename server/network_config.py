"""The server's network-facing settings: where it listens and how (TLS, tokens, reflection),
and what one caller may hold (threads, streams, deadlines, rate, push memory). Sections of
ServerConfig (server/config.py); each validated on construction.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from common.metrics_http import check_listen
from common.tls import server_credentials


@dataclass(kw_only=True)
class NetworkConfig:
    """Where the server listens, and who may talk to it (TLS, per-learner tokens)."""

    listen: str = "127.0.0.1:50051"
    """host:port to serve gRPC on; port 0 picks a free port."""
    port_file: str = ""
    """If set, write the bound port to this file once serving (for launchers using port 0)."""
    tls_cert: str = ""
    """PEM certificate chain the server presents (with tls_key): serve over TLS."""
    tls_key: str = ""
    """PEM private key of tls_cert."""
    tls_client_ca: str = ""
    """PEM CA that must have signed every learner's client certificate (mutual TLS)."""
    tls_client_id_from_cert: bool = False
    """With tls_client_ca: a learner may act only as the learner id its client certificate's
    Common Name gives (deploy/make_certs.sh writes it), so one certificate is one learner's
    share of influence (server/cert_identity.py)."""
    insecure: bool = False
    """Serve in plaintext, without TLS: only on a trusted network (logs a warning)."""
    auth_token_file: str = ""
    """Per-learner tokens (`diloco-token add FILE ID`); SIGHUP reloads. Empty: off."""
    health_listen: str = ""
    """host:port to serve grpc.health.v1 on as well, in plaintext and nothing else, for
    probes that cannot speak TLS (Kubernetes' grpc probe); empty: off. It reveals only that
    the server is up."""
    reflection: bool = False
    """Serve gRPC server reflection (for grpcurl); behind the tokens when auth_token_file is
    set, and the certificate binding when tls_client_id_from_cert is. Off by default: a
    service a deployment does not use is one less to attack."""

    def __post_init__(self) -> None:
        if ":" not in self.listen:
            raise ValueError(f"listen must be host:port, got {self.listen!r}")
        check_listen("health_listen", self.health_listen)
        port = self.listen.rpartition(":")[2]
        if self.health_listen and self.health_listen.rpartition(":")[2] == port != "0":
            raise ValueError("health_listen must have a port of its own, not listen's")
        tls = bool(self.tls_cert or self.tls_key or self.tls_client_ca)
        if self.insecure and tls:
            raise ValueError("insecure and tls_* settings exclude each other: choose one")
        if self.tls_client_id_from_cert and not self.tls_client_ca:
            raise ValueError(
                "tls_client_id_from_cert needs tls_client_ca: without client certificates "
                "there is no name to bind learner ids to"
            )

    def check_tls_chosen(self) -> None:
        """TLS or an explicit insecure: checked by ServerConfig after the training settings,
        so that a bad training setting is reported first."""
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


@dataclass(kw_only=True)
class LimitsConfig:
    """Per-learner call rate and concurrency limits, worker threads and deadlines for
    streams (server/ratelimit.py, server/inflight.py, server/deadlines.py)."""

    rate_limit_calls_per_s: float = 100.0
    """Each learner may make this many calls per second on average (0: no limit); a
    learner over it is told to retry later (server/ratelimit.py)."""
    rate_limit_burst: int = 200
    """Calls a learner may make at once before rate_limit_calls_per_s applies."""
    max_calls_in_flight: int = 16
    """Calls one learner may have open at the same time (0: no limit). Each open call holds
    one of the server's worker threads (a long-poll for up to a minute), so this stops a
    few learners from starving the rest; our learners have at most three open at once."""
    push_memory_budget_mb: float = 0.0
    """Push payload bytes the server holds at once, all pushes together: a push's announced
    size is reserved before its payload is read (server/receive.py). 0: sized to the
    fragments the shard owns, a quarter of their fp32 bytes within 64-256 MiB and at least
    two fp4 pushes of the largest. A fragment's initial fp32 values larger than this are
    received alone; other pushes must fit: learners pushing in bf16 or fp32 need a budget of
    at least one such push of the largest fragment (2 or 4 bytes a value), else those pushes
    are refused, the error giving both sizes."""
    push_budget_wait_s: float = 0.0
    """How long a push waits for room in push_memory_budget_mb before it is refused with
    RESOURCE_EXHAUSTED and a retry hint (learners retry it). 0: refused at once. A waiting
    push holds what gRPC's flow control lets its sender send meanwhile (up to the link's
    bandwidth-delay product), so waiting trades memory for fewer retries."""
    worker_threads: int = 256
    """Threads that run calls; every open call holds one. Sized for a few hundred learners."""
    max_concurrent_streams: int = 100
    """Calls one connection may have open at once (HTTP/2 max concurrent streams). A gRPC
    client queues calls beyond it until one ends; a learner needs a handful."""
    stream_idle_timeout_s: float = 30.0
    """End a streaming call whose peer makes no progress for this long: a push with no next
    chunk, a pull whose reader stopped reading (server/deadlines.py); 0: off."""
    stream_min_bytes_per_s: float = 131072.0
    """A push or pull must end within stream_idle_timeout_s + its payload bytes / this rate
    (128 KiB/s: a 1 Mbit/s link); 0: no bound on the whole stream."""

    def __post_init__(self) -> None:
        if not self.rate_limit_calls_per_s >= 0 or self.rate_limit_burst < 1:
            raise ValueError("rate_limit_calls_per_s must be >= 0 and rate_limit_burst >= 1")
        if self.max_calls_in_flight < 0:
            raise ValueError(f"max_calls_in_flight must be >= 0, got {self.max_calls_in_flight}")
        if not self.push_memory_budget_mb >= 0:
            raise ValueError(
                f"push_memory_budget_mb must be >= 0 (0: sized to the owned fragments), "
                f"got {self.push_memory_budget_mb}"
            )
        if 0 < self.push_memory_budget_mb * 2**20 < 1:
            raise ValueError(
                f"push_memory_budget_mb must be 0 or at least one byte, "
                f"got {self.push_memory_budget_mb}"
            )
        if not 0 <= self.push_budget_wait_s <= 3600:
            raise ValueError(f"push_budget_wait_s must be 0 to 3600, got {self.push_budget_wait_s}")
        if self.worker_threads < 1 or self.max_concurrent_streams < 1:
            raise ValueError("worker_threads and max_concurrent_streams must be >= 1")
        if not self.stream_idle_timeout_s >= 0 or not self.stream_min_bytes_per_s >= 0:
            raise ValueError("stream_idle_timeout_s and stream_min_bytes_per_s must be >= 0")
        if self.stream_min_bytes_per_s and not self.stream_idle_timeout_s:
            raise ValueError(
                "stream_min_bytes_per_s needs stream_idle_timeout_s > 0 (its grace period)"
            )
