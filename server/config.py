"""The server's settings: one small section per component, each validated on construction.

    config = build_config(AggregatorConfig, {"mode": "quorum", "fragments": 2})
    config = aggregator_config(mode="quorum", fragments=2)   # the same, for tests and benches
    Aggregator(config)   # reads membership, rounds, outer, streaming, persistence
    AggregatorService(build_config(ServerConfig, {"listen": "127.0.0.1:0", "insecure": True}))

Each section's `__post_init__` raises ValueError naming the field to fix; what spans sections
is checked by the daemon config that holds them. Every setting keeps one flat name, unique
across the sections: its flag, its DILOCO_* variable and its TOML key, at the top of the file
or in its section's table (common/config.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc

from common.codec import CODECS
from common.config import build_config
from common.fragments import LAYOUTS
from common.metrics_http import check_listen
from common.sparse import DEFAULT_TOPK_FRACTION
from common.tls import server_credentials
from server.policy import MODES, WEIGHTINGS


@dataclass(kw_only=True)
class MembershipConfig:
    """Learners' sessions and leases (server/membership.py)."""

    lease_s: float = 10.0
    """A learner that neither heartbeats nor calls for this long is dropped from rounds."""

    def __post_init__(self) -> None:
        if not self.lease_s > 0:
            raise ValueError(f"lease_s must be > 0, got {self.lease_s}")


@dataclass(kw_only=True)
class RoundsConfig:
    """When a round closes, what a push weighs and which pushes are refused (server/rounds.py)."""

    mode: str = "sync"
    """sync (round closes when every live learner pushed), quorum or async (server/rounds.py)."""
    min_contributors: int = 1
    """K: a round closes only once at least this many learners pushed to it (in sync mode,
    also every live learner): in sync mode, the expected count makes everyone start together."""
    grace_steps: float = 5.0
    """quorum: after K pushes, wait this many median inner-step times for more."""
    grace_min_s: float = 0.0
    """quorum: the shortest grace window (also used before any learner reported step times)."""
    grace_max_s: float = 10.0
    """quorum: the longest grace window."""
    weighting: str = ""
    """equal, tokens or tokens_squared_per_step (default: equal in sync mode, else the last)."""
    scale_partial_rounds: bool = True
    """quorum: a round that carries only part of the live learners' usual weight moves the
    model by that part (missing work counts as zero), so closing rounds early and often does
    not make the outer step larger. Off: every round takes the plain weighted mean."""
    max_staleness: int = 4
    """quorum/async: refuse a push computed against a version more than this many behind."""
    async_momentum_every: int = 0
    """async: Delayed Nesterov applies momentum every N pushes (0: N = live learners)."""
    max_norm_ratio: float = 10.0
    """Refuse a push whose pseudo-gradient norm exceeds this many times the median of the
    fragment's recent accepted pushes (a poisoned or exploding update); 0: off."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if not self.weighting:
            self.weighting = "equal" if self.mode == "sync" else "tokens_squared_per_step"
        if self.weighting not in WEIGHTINGS:
            raise ValueError(
                f"weighting must be one of {', '.join(WEIGHTINGS)}, got {self.weighting!r}"
            )
        if self.min_contributors < 1:
            raise ValueError(f"min_contributors must be >= 1, got {self.min_contributors}")
        if not 0 <= self.grace_min_s <= self.grace_max_s:
            raise ValueError("grace_min_s and grace_max_s must satisfy 0 <= min <= max")
        if self.grace_steps < 0 or self.max_staleness < 0 or self.async_momentum_every < 0:
            raise ValueError("grace_steps, max_staleness and async_momentum_every must be >= 0")
        if not self.max_norm_ratio >= 0:
            raise ValueError(f"max_norm_ratio must be >= 0, got {self.max_norm_ratio}")


RECIPES = ("best", "paper")


def outer_recipe(values: Mapping[str, Any]) -> dict[str, Any]:
    """The outer settings of the recipe named in `values` (the dataclass defaults are best,
    less the momentum warm-up in async mode, which has no rounds to warm up over)."""
    if values.get("recipe") == "paper":
        return {"outer_momentum_warmup_rounds": 0, "pull_codec": "fp4_e3m0"}
    if values.get("mode") == "async":
        return {"outer_momentum_warmup_rounds": 0}
    return {}


@dataclass(kw_only=True)
class OuterConfig:
    """The outer optimizer's step (server/outer.py)."""

    recipe: str = "best"
    """best: the defaults below, the best measured training from scratch (docs/RESULTS.md;
    async mode: no momentum warm-up); paper: DiLoCo's outer step exactly (no momentum
    warm-up) and Streaming DiLoCo's fp4_e3m0 pulls, for the settings not given (pair it with
    the learners' --recipe paper)."""
    outer_lr: float = 0.7
    """Outer learning rate of the Nesterov step (0.7 in DiLoCo)."""
    outer_momentum: float = 0.9
    """Outer Nesterov momentum (0.9 in DiLoCo)."""
    outer_momentum_warmup_rounds: int = 20
    """sync/quorum: raise the outer momentum linearly from outer_momentum_warmup_start to
    outer_momentum over each fragment's first N outer steps (0: off, torch's SGD exactly).
    Helps a model trained from scratch (docs/RESULTS.md, quality)."""
    outer_momentum_warmup_start: float = 0.5
    """The outer momentum of the first outer step when the warm-up is on."""

    def __post_init__(self) -> None:
        if self.recipe not in RECIPES:
            raise ValueError(f"recipe must be one of {', '.join(RECIPES)}, got {self.recipe!r}")
        if not self.outer_lr > 0:
            raise ValueError(f"outer_lr must be > 0, got {self.outer_lr}")
        if not 0 <= self.outer_momentum < 1:
            raise ValueError(f"outer_momentum must be in [0, 1), got {self.outer_momentum}")
        if self.outer_momentum_warmup_rounds < 0:
            raise ValueError(
                "outer_momentum_warmup_rounds must be >= 0, "
                f"got {self.outer_momentum_warmup_rounds}"
            )
        if not 0 <= self.outer_momentum_warmup_start < 1:
            raise ValueError(
                "outer_momentum_warmup_start must be in [0, 1), "
                f"got {self.outer_momentum_warmup_start}"
            )
        if (
            self.outer_momentum_warmup_rounds
            and self.outer_momentum_warmup_start > self.outer_momentum
        ):
            raise ValueError(
                f"outer_momentum_warmup_start ({self.outer_momentum_warmup_start}) must not "
                f"exceed outer_momentum ({self.outer_momentum}): a warm-up raises the momentum"
            )


@dataclass(kw_only=True)
class StreamingConfig:
    """Streaming DiLoCo: how the parameters are split into fragments and sent to learners."""

    fragments: int = 1
    """P, the number of fragments the parameters are split into (Streaming DiLoCo)."""
    layout: str = "strided"
    """How parameters are split: strided, sequential or balanced (common/fragments.py)."""
    pull_codec: str = "fp4_e2m1"
    """Codec of the outer updates learners pull (with error feedback): fp4_e2m1, fp4_e3m0,
    the top-k sparse sparse_2bit or sparse_fp4; fp32 pulls snapshots."""
    pull_topk_fraction: float = DEFAULT_TOPK_FRACTION
    """Sparse pull codecs: the fraction of values kept in every chunk of 4096 (1/64: 64)."""
    update_log_versions: int = 16
    """Quantized updates kept per fragment; a learner further behind gets a snapshot."""

    def __post_init__(self) -> None:
        if self.fragments < 1:
            raise ValueError(f"fragments must be >= 1, got {self.fragments}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {self.layout!r}")
        if self.pull_codec not in CODECS or self.pull_codec == "bf16":
            raise ValueError(
                f"pull_codec must be fp32, fp4_e2m1, fp4_e3m0, sparse_2bit or sparse_fp4, "
                f"got {self.pull_codec!r}"
            )
        if not 0 < self.pull_topk_fraction <= 1:
            raise ValueError(f"pull_topk_fraction must be in (0, 1], got {self.pull_topk_fraction}")
        if self.update_log_versions < 1:
            raise ValueError(f"update_log_versions must be >= 1, got {self.update_log_versions}")


@dataclass(kw_only=True)
class PersistenceConfig:
    """The state directory: snapshots and the log of outer steps (server/persistence.py)."""

    state_dir: str = ""
    """Directory for snapshots and the update log; empty keeps state in memory only."""
    snapshot_every_versions: int = 100
    """Write a full snapshot (and start a new log) after this many closed rounds."""

    def __post_init__(self) -> None:
        if self.snapshot_every_versions < 1:
            raise ValueError(
                f"snapshot_every_versions must be >= 1, got {self.snapshot_every_versions}"
            )


@dataclass(kw_only=True)
class ShardingConfig:
    """The aggregator as shard i of N: each owns some fragments (server/sharding.py)."""

    shard_index: int = 0
    """This server's index among the shards, from 0."""
    shard_count: int = 1
    """N, the number of shards the fragments are spread over (1: one server holds them all)."""
    shard_addresses: str = ""
    """host:port of every shard, in index order, comma-separated: the addresses learners
    given one shard's address discover (DescribeShards). Empty: learners must list them."""

    def __post_init__(self) -> None:
        if self.shard_count < 1:
            raise ValueError(f"shard_count must be >= 1, got {self.shard_count}")
        if not 0 <= self.shard_index < self.shard_count:
            raise ValueError(
                f"shard_index must be in [0, shard_count) = [0, {self.shard_count}), "
                f"got {self.shard_index}"
            )
        addresses = self.addresses()
        if addresses and len(addresses) != self.shard_count:
            raise ValueError(
                f"shard_addresses lists {len(addresses)} addresses; it must list all "
                f"{self.shard_count} shards, in index order"
            )
        for address in addresses:
            if ":" not in address:
                raise ValueError(f"shard_addresses: {address!r} is not host:port")

    def addresses(self) -> list[str]:
        return [a.strip() for a in self.shard_addresses.split(",") if a.strip()]


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
    insecure: bool = False
    """Serve in plaintext, without TLS: only on a trusted network (logs a warning)."""
    auth_token_file: str = ""
    """Per-learner tokens (`diloco-token add FILE ID`); SIGHUP reloads. Empty: off."""
    reflection: bool = False
    """Serve gRPC server reflection (for grpcurl); behind the tokens when auth_token_file is
    set. Off by default: a service a deployment does not use is one less to attack."""

    def __post_init__(self) -> None:
        if ":" not in self.listen:
            raise ValueError(f"listen must be host:port, got {self.listen!r}")
        tls = bool(self.tls_cert or self.tls_key or self.tls_client_ca)
        if self.insecure and tls:
            raise ValueError("insecure and tls_* settings exclude each other: choose one")

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
        if self.worker_threads < 1 or self.max_concurrent_streams < 1:
            raise ValueError("worker_threads and max_concurrent_streams must be >= 1")
        if not self.stream_idle_timeout_s >= 0 or not self.stream_min_bytes_per_s >= 0:
            raise ValueError("stream_idle_timeout_s and stream_min_bytes_per_s must be >= 0")
        if self.stream_min_bytes_per_s and not self.stream_idle_timeout_s:
            raise ValueError(
                "stream_min_bytes_per_s needs stream_idle_timeout_s > 0 (its grace period)"
            )


@dataclass(kw_only=True)
class ObservabilityConfig:
    """Logging and the Prometheus endpoint."""

    log_level: str = "INFO"
    """Python logging level."""
    metrics_listen: str = ""
    """host:port for the Prometheus endpoint (/metrics), e.g. 0.0.0.0:9100; empty: off."""
    metrics_port_file: str = ""
    """If set, write the bound metrics port to this file (for launchers using port 0)."""

    def __post_init__(self) -> None:
        check_listen("metrics_listen", self.metrics_listen)


class AggregatorSections(Protocol):
    """The sections the Aggregator reads; AggregatorConfig and ServerConfig both hold them."""

    membership: MembershipConfig
    rounds: RoundsConfig
    outer: OuterConfig
    streaming: StreamingConfig
    persistence: PersistenceConfig
    sharding: ShardingConfig


@dataclass(kw_only=True)
class AggregatorConfig:
    """The Aggregator's settings alone, for code that runs one without a gRPC server (tests,
    simulations, benchmarks)."""

    membership: MembershipConfig = field(default_factory=MembershipConfig)
    rounds: RoundsConfig = field(default_factory=RoundsConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    streaming: StreamingConfig = field(default_factory=StreamingConfig)
    persistence: PersistenceConfig = field(default_factory=PersistenceConfig)
    sharding: ShardingConfig = field(default_factory=ShardingConfig)

    recipe_values = staticmethod(outer_recipe)

    def __post_init__(self) -> None:
        check_aggregator_sections(self)


@dataclass(kw_only=True)
class ServerConfig:
    """diloco-server's settings: the Aggregator's sections plus the service around it (the
    Aggregator's first: a bad training setting is reported before a missing TLS setting)."""

    membership: MembershipConfig = field(default_factory=MembershipConfig)
    rounds: RoundsConfig = field(default_factory=RoundsConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    streaming: StreamingConfig = field(default_factory=StreamingConfig)
    persistence: PersistenceConfig = field(default_factory=PersistenceConfig)
    sharding: ShardingConfig = field(default_factory=ShardingConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    observability: ObservabilityConfig = field(default_factory=ObservabilityConfig)

    recipe_values = staticmethod(outer_recipe)

    def __post_init__(self) -> None:
        check_aggregator_sections(self)
        self.network.check_tls_chosen()


def check_aggregator_sections(config: AggregatorSections) -> None:
    """What spans the Aggregator's sections: the outer optimizer must suit the mode, and
    every shard must own a fragment."""
    if config.sharding.shard_count > config.streaming.fragments:
        raise ValueError(
            f"shard_count ({config.sharding.shard_count}) must not exceed fragments "
            f"({config.streaming.fragments}): every shard owns at least one fragment"
        )
    if config.outer.outer_momentum_warmup_rounds and config.rounds.mode == "async":
        raise ValueError(
            "outer_momentum_warmup_rounds is for sync and quorum modes; async mode's "
            "Delayed Nesterov has no warm-up"
        )


def aggregator_config(**settings: object) -> AggregatorConfig:
    """An AggregatorConfig from flat setting names, for code that builds one by hand:
    `aggregator_config(mode="quorum", fragments=2)`."""
    return build_config(AggregatorConfig, settings)
