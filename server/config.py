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

import math
from dataclasses import dataclass, field
from typing import Protocol

from common.codec.sparse import DEFAULT_TOPK_FRACTION
from common.codec.tensor import CODECS
from common.config import address_list, build_config
from common.fragments import LAYOUTS
from common.metrics_http import check_listen
from server.influence import ROBUST_MERGES
from server.network_config import LimitsConfig, NetworkConfig
from server.outer_config import OuterConfig, outer_recipe
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
    max_weight_ratio: float = 4.0
    """A push weighs at most this many times the median of the other live learners' last
    weights, whatever tokens it claims (server/influence.py); 0: off. 4 lets an honest
    learner do twice the median's tokens per step under tokens_squared_per_step."""
    robust_merge: str = "none"
    """none (the weighted mean), trimmed-mean (value by value, drop the trim_fraction
    largest and smallest of a round's pushes; sync and quorum modes) or clip-to-median
    (scale each push down to the fragment's recent median norm): for untrusted learners."""
    trim_fraction: float = 0.2
    """trimmed-mean: the share of a round's K pushes dropped at each end, at least one when
    K >= 3 (server/influence.py)."""

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
        if not (self.max_weight_ratio == 0 or 1 <= self.max_weight_ratio < math.inf):
            raise ValueError(
                f"max_weight_ratio must be 0 (off) or >= 1, got {self.max_weight_ratio}"
            )
        if self.robust_merge not in ROBUST_MERGES:
            raise ValueError(
                f"robust_merge must be one of {', '.join(ROBUST_MERGES)}, got {self.robust_merge!r}"
            )
        if self.robust_merge == "trimmed-mean" and self.mode == "async":
            raise ValueError(
                "robust_merge trimmed-mean needs rounds of several pushes (sync or quorum "
                "mode); in async mode use clip-to-median"
            )
        if not 0 < self.trim_fraction < 0.5:
            raise ValueError(f"trim_fraction must be in (0, 0.5), got {self.trim_fraction}")


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
    """Sparse pull codecs: the fraction of values kept in every chunk of 4096 (1/64: 64;
    the best recipe's default for a sparse pull codec: 1/32, SPARSE_PULL_TOPK_FRACTION)."""
    update_log_versions: int = 16
    """Quantized updates kept per fragment; a learner further behind gets a snapshot."""
    update_log_fraction: float = 0.5
    """The kept updates' bytes stay within this fraction of a snapshot's (fp32 parameters):
    the server holds that much of a model copy per fragment for catch-up pulls. A learner
    further behind pulls a snapshot, at most 1/fraction times the bytes of the chain it
    would have pulled (fp4: 3 versions at 0.5, 7 at 1)."""

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
        if not 0 < self.update_log_fraction <= 1:
            raise ValueError(
                f"update_log_fraction must be > 0 and <= 1, got {self.update_log_fraction}"
            )


@dataclass(kw_only=True)
class PersistenceConfig:
    """The state directory: snapshots and the log of outer steps (server/persistence.py)."""

    state_dir: str = ""
    """Directory for snapshots and the update log; empty keeps state in memory only."""
    snapshot_every_versions: int = 100
    """Write a full snapshot (and start a new log) once the log holds this many closed rounds
    (those a restart replayed count too)."""

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

    def addresses(self) -> list[str]:
        return address_list(self.shard_addresses, "shard_addresses")


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
    if config.outer.outer_state_dtype != "float32" and config.rounds.mode == "async":
        raise ValueError(
            "outer_state_dtype bfloat16 is for sync and quorum modes; async mode's Delayed "
            "Nesterov keeps float32"
        )
    if config.outer.sparse_mean == "senders" and config.rounds.mode == "async":
        raise ValueError(
            "sparse_mean senders is for sync and quorum modes; in async mode each push is "
            "its own round"
        )
    if config.outer.sparse_mean == "senders" and config.rounds.robust_merge == "trimmed-mean":
        raise ValueError(
            "sparse_mean senders takes each value's mean over its senders; robust_merge "
            "trimmed-mean replaces the mean: choose one"
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
