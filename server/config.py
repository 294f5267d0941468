"""The server's settings: one small section per component, each validated on construction.

    config = build_config(ServerConfig, {"listen": "127.0.0.1:0", "insecure": True})
    config = aggregator_config(mode="quorum", fragments=2)   # the Aggregator's sections alone
    Aggregator(config)   # reads membership, rounds, outer, streaming, persistence, sharding

Each component owns its section (MembershipConfig: learners.py; RoundsConfig:
rounds/policy.py; OuterConfig: rounds/outer.py; ShardingConfig: state/params.py;
PersistenceConfig: state/store.py; NetworkConfig: rpc/auth.py; LimitsConfig, which spans the
rpc modules and the server's threads, is here),
whose `__post_init__` raises ValueError naming the field to fix; the daemon configs here hold
them and check what spans them. Every setting keeps one flat name, unique across the
sections: its flag, its DILOCO_* variable and its TOML key, at the top of the file or in its
section's table (common/config.py). `outer_recipe` gives the best recipe's values for the
settings a user leaves unset.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Protocol

from common.codec.sparse import DEFAULT_TOPK_FRACTION
from common.codec.tensor import CODECS, is_sparse
from common.config import build_config
from common.fragments import LAYOUTS
from common.metrics_http import check_listen
from common.tracing import EXPORTERS
from server.learners import MembershipConfig
from server.rounds.outer import OuterConfig, snapshot_settings
from server.rounds.policy import RoundsConfig
from server.rpc.auth import NetworkConfig
from server.state.params import ShardingConfig
from server.state.store import PersistenceConfig

if TYPE_CHECKING:
    from server.state.formats import Restored

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class LimitsConfig:
    """Per-learner call rate and concurrency limits, worker threads and deadlines for
    streams (server/rpc/limits.py)."""

    rate_limit_calls_per_s: float = 100.0
    """Each learner may make this many calls per second on average (0: no limit); a
    learner over it is told to retry later."""
    rate_limit_burst: int = 200
    """Calls a learner may make at once before rate_limit_calls_per_s applies."""
    max_calls_in_flight: int = 16
    """Calls one learner may have open at the same time (0: no limit). Each open call holds
    one of the server's worker threads (a long-poll for up to a minute), so this stops a
    few learners from starving the rest; our learners have at most three open at once."""
    push_memory_budget_mb: float = 0.0
    """Push payload bytes the server holds at once, all pushes together: a push's announced
    size is reserved before its payload is read (server/rpc/receive.py). 0: sized to the
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
    chunk, a pull whose reader stopped reading; 0: off."""
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


@dataclass(kw_only=True)
class StreamingConfig:
    """Streaming DiLoCo: how the parameters are split into fragments and sent to learners."""

    fragments: int = 1
    """P, the number of fragments the parameters are split into (Streaming DiLoCo)."""
    layout: str = "strided"
    """How parameters are split: strided, sequential or balanced (common/fragments.py)."""
    pull_codec: str = "fp4_e2m1"
    """Codec of the outer updates learners pull (with error feedback): fp4_e2m1, fp4_e3m0,
    the top-k sparse sparse_2bit; fp32 pulls snapshots."""
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
                f"pull_codec must be fp32, fp4_e2m1, fp4_e3m0 or sparse_2bit, "
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
class ObservabilityConfig:
    """Logging, the Prometheus endpoint and its status page, OpenTelemetry traces."""

    log_level: str = "INFO"
    """Python logging level."""
    metrics_listen: str = ""
    """host:port for the Prometheus endpoint (/metrics), e.g. 0.0.0.0:9100; empty: off."""
    metrics_port_file: str = ""
    """If set, write the bound metrics port to this file (for launchers using port 0)."""
    status_page: bool = True
    """Serve the status page (/status, HTML) and its JSON (/status.json) on the metrics
    port, with no authentication, as /metrics: keep that port on a private network."""
    shard_status_urls: str = ""
    """Every shard's status page URL, in index order, comma-separated: the page's links to
    the other shards. Empty: each shard's host from shard_addresses with this metrics port."""
    trace_exporter: str = ""
    """Where OpenTelemetry spans of each push and round close go: "console" (stdout, to try
    it), "otlp" (a collector at trace_endpoint) or empty: off. Needs the `otel` extra."""
    trace_endpoint: str = ""
    """The OTLP collector's gRPC endpoint for trace_exporter otlp, e.g. http://127.0.0.1:4317
    (http: plaintext, https: TLS)."""

    def __post_init__(self) -> None:
        check_listen("metrics_listen", self.metrics_listen)
        if self.trace_exporter not in ("", *EXPORTERS):
            raise ValueError(
                f"trace_exporter must be empty (off) or one of {', '.join(EXPORTERS)}, "
                f"got {self.trace_exporter!r}"
            )
        if self.trace_endpoint and self.trace_exporter != "otlp":
            raise ValueError("trace_endpoint is for trace_exporter otlp; set both, or neither")
        if self.trace_exporter == "otlp" and not self.trace_endpoint.startswith(
            ("http://", "https://")
        ):
            raise ValueError(
                "trace_exporter otlp needs trace_endpoint, the collector's http(s):// URL, "
                f"got {self.trace_endpoint!r}"
            )
        for url in self.status_urls():
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"shard_status_urls must be http(s) URLs, got {url!r}")

    def status_urls(self) -> list[str]:
        return [url.strip() for url in self.shard_status_urls.split(",") if url.strip()]


# ---- Recipes -----------------------------------------------------------------------------

# The best recipe for sparse pull codecs: the averaged pushes applied at three times their size, no
# outer momentum, and a pull that keeps twice the push's default fraction. Sparse pushes carry
# their own momentum in the learners' decayed error-feedback residual (learner
# --push-feedback-decay, SparseLoCo); a server momentum on top of it, behind a pull that sends
# 1/64 of each chunk a round, keeps pushing along directions the learners have not been sent
# yet and diverges. The mean of K top-k pushes is denser than each; a pull of 1/32 carries it
# with less delay. Over three seeds outer lr 3 had the best mean (1.2% ahead of 2, within one
# standard deviation; 6.7% ahead of 1); 4 was worse than 1 on seed 0 (docs/RESULTS.md,
# "Headline rows").
SPARSE_OUTER = {"outer_lr": 3.0, "outer_momentum": 0.0, "outer_momentum_warmup_rounds": 0}
SPARSE_PULL_TOPK_FRACTION = 2 * DEFAULT_TOPK_FRACTION

# The outer state in float32: torch's SGD exactly. The best recipe keeps it in bfloat16 (a
# quarter less server memory with 4-bit pulls, no quality cost measured over three seeds) where
# that was measured: sync and quorum modes with dense pulls. The sparse codecs' step keeps
# most of each update in the pull residual for many rounds and was measured in float32 only.
EXACT_STATE = {"outer_state_dtype": "float32"}


def outer_recipe(values: Mapping[str, Any]) -> dict[str, Any]:
    """The outer settings of the recipe named in `values` (the dataclass defaults are best,
    less the momentum warm-up and the bfloat16 state in async mode, which has no rounds to
    warm up over and keeps float32, and with SPARSE_OUTER's step, in float32, for the sparse
    pull codecs)."""
    if values.get("recipe") == "paper":
        return {**EXACT_STATE, "outer_momentum_warmup_rounds": 0, "pull_codec": "fp4_e3m0"}
    pull_codec = values.get("pull_codec")
    if is_sparse(pull_codec):
        return {**SPARSE_OUTER, **EXACT_STATE, "pull_topk_fraction": SPARSE_PULL_TOPK_FRACTION}
    if values.get("mode") == "async":
        return {**EXACT_STATE, "outer_momentum_warmup_rounds": 0}
    return {}


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

    @classmethod
    def restart_notes(cls) -> dict[str, str]:
        """What the configuration reference says of each setting across a restart."""
        return restart_notes()

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
        urls = self.observability.status_urls()
        if urls and len(urls) != self.sharding.shard_count:
            raise ValueError(
                f"shard_status_urls lists {len(urls)} URLs; it must list all "
                f"{self.sharding.shard_count} shards, in index order"
            )


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
        merge = "untrusted_learners" if config.rounds.untrusted_learners else "robust_merge"
        raise ValueError(
            f"sparse_mean senders takes each value's mean over its senders; {merge} "
            "merges with the trimmed mean instead: choose one"
        )
    if config.outer.outer_momentum_warmup_rounds and config.rounds.mode == "async":
        raise ValueError(
            "outer_momentum_warmup_rounds is for sync and quorum modes; async mode's "
            "Delayed Nesterov has no warm-up"
        )


# Across a restart on the same state dir: the settings it is bound to (params.state_identity)
# are refused if changed, naming each; the other settings of these sections are recorded with
# each snapshot, and a change is logged and applies from each fragment's next round.
FIXED_BY_STATE_DIR = ("fragments", "layout", "mode", "pull_codec", "pull_topk_fraction")
FIXED_BY_STATE_DIR += ("shard_index", "shard_count")
RECORDED_SECTIONS = ("membership", "rounds", "outer", "streaming")


def recorded_settings(config: AggregatorSections) -> dict[str, Any]:
    """The settings a state dir records with each snapshot, by flat name, as JSON values."""
    sections = (getattr(config, name) for name in RECORDED_SECTIONS)
    values = {f.name: getattr(s, f.name) for s in sections for f in fields(s)}
    return json.loads(json.dumps(values))


def changed_settings(
    restored: Restored, config: AggregatorSections, versions: Sequence[int]
) -> list[tuple[str, Any, Any]]:
    """(setting, the state dir's value, this server's) of each recorded setting a restart
    changed, each logged; `versions`: the fragments' after the replay (it applies after them).
    A dir that recorded no settings (an older server's) has its outer optimizer's."""
    recorded = restored.settings
    if not recorded and restored.fragments:
        recorded = snapshot_settings(restored.fragments[0]["outer"])
    now = recorded_settings(config)
    changes = [(k, recorded[k], v) for k, v in now.items() if k in recorded and recorded[k] != v]
    for name, was, value in changes:
        log.warning("%s %r -> %r from the rounds after versions %s", name, was, value, versions)
    return changes


def restart_notes() -> dict[str, str]:
    """Each recorded or fixed setting's note across a restart on the same state dir."""
    kinds = [f.default_factory for f in fields(AggregatorConfig) if f.name in RECORDED_SECTIONS]
    may = "*Restart:* may change (logged; applies from the next round)."
    notes = {f.name: may for kind in kinds for f in fields(kind)}
    return notes | dict.fromkeys(FIXED_BY_STATE_DIR, "*Restart:* fixed by the state dir.")


def aggregator_config(**settings: object) -> AggregatorConfig:
    """An AggregatorConfig from flat setting names, for code that builds one by hand:
    `aggregator_config(mode="quorum", fragments=2)`."""
    return build_config(AggregatorConfig, settings)
