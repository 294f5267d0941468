"""The aggregator's Prometheus metrics, declared in one place.

    metrics = ServerMetrics()                        # its own registry
    aggregator = Aggregator(config, events=metrics)  # events: rounds, staleness, snapshots
    metrics.watch(aggregator, servicer)              # state read at scrape time

One registry per service rather than the module-level default, so that tests can run several
servers in one process. Labels are bounded: `fragment` (P values, plus "none" for traffic that
belongs to no fragment) and `result` ("accepted" or a gRPC status name).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from common.traffic import NO_FRAGMENT
from server.aggregator import Aggregator, AggregatorEvents
from server.rounds.admission import staleness_discount
from server.rounds.policy import RoundSummary
from server.rounds.round import twice_fair_share

if TYPE_CHECKING:  # the servicer counts into this module's counters
    from server.rpc.auth import TokenAuth
    from server.rpc.limits import InFlightLimit, RateLimit, StreamDeadlines
    from server.rpc.servicer import AggregatorServicer

SECONDS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class ServerMetrics(AggregatorEvents):
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        # process_resident_memory_bytes and CPU seconds: what a shard costs (the dashboard's
        # per-shard memory panel); on systems without /proc the collector exports nothing.
        ProcessCollector(registry=r)
        self.round_duration = Histogram(
            "diloco_server_round_duration_seconds",
            "Time from a round's first push to its close.",
            buckets=SECONDS,
            registry=r,
        )
        self.outer_step = Histogram(
            "diloco_server_outer_step_seconds",
            "Time of one outer optimizer step (average, Nesterov, 4-bit update).",
            buckets=SECONDS,
            registry=r,
        )
        self.staleness = Histogram(
            "diloco_server_contribution_staleness_versions",
            "How many versions behind the global fragment an accepted push was computed.",
            buckets=(0, 1, 2, 3, 4, 6, 8, 16),
            registry=r,
        )
        self.quorum = Histogram(
            "diloco_server_round_contributions",
            "Pushes averaged into one round (the quorum size it closed with).",
            buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32, 64),
            registry=r,
        )
        self.discount = Counter(
            "diloco_server_contribution_discount",
            "Sum of accepted pushes' staleness discounts 1/(1 + staleness); over the staleness "
            "histogram's count it is the share of their weight that stale pushes keep.",
            registry=r,
        )
        self.bounded = Counter(
            "diloco_server_bounded_contributions",
            "Pushes whose influence was bounded, by action: weight_capped (weight lowered to "
            "max_weight_ratio x the others' median), claim_refused (more tokens than "
            "declared at Join; refused).",
            ["action"],
            registry=r,
        )
        self.largest_share = Gauge(
            "diloco_server_round_max_weight_share",
            "The largest share of its round's weight one learner held, in the fragment's last "
            "closed round (after any cap).",
            ["fragment"],
            registry=r,
        )
        self.share_bound = Gauge(
            "diloco_server_weight_share_bound",
            "2/K for the fragment's last closed round of K pushes: twice a fair share, the "
            "most untrusted_learners lets one learner hold.",
            ["fragment"],
            registry=r,
        )
        self.snapshot = Histogram(
            "diloco_server_snapshot_write_seconds",
            "Time to write one durable snapshot of the whole state.",
            buckets=SECONDS,
            registry=r,
        )
        # A timestamp rather than an age: Prometheus computes the age (time() - it), and the
        # value stays right while the server is not scraped.
        self.last_snapshot = Gauge(
            "diloco_server_last_snapshot_timestamp_seconds",
            "Unix time the last snapshot write ended (0: none since the server started). A "
            "write that failed ends too, and sets diloco_server_state_dir_failed to 1.",
            registry=r,
        )
        self.lease_expiries = Counter(
            "diloco_server_lease_expiries",
            "Sessions closed because their learner called and heartbeated nothing for lease_s.",
            registry=r,
        )

    def watch(
        self,
        aggregator: Aggregator,
        servicer: AggregatorServicer,
        rate_limit: RateLimit | None = None,
        in_flight: InFlightLimit | None = None,
    ) -> None:
        """Export the aggregator's and servicer's current state at every scrape."""
        self.registry.register(_StateCollector(aggregator, servicer, rate_limit))
        self.registry.register(_CallsCollector(servicer, in_flight))

    def watch_cuts(self, deadlines: StreamDeadlines | None, auth: TokenAuth | None) -> None:
        """Export the calls the server ended itself, by reason."""
        self.registry.register(_CutsCollector(deadlines, auth))

    # -- AggregatorEvents -------------------------------------------------------------------

    def contribution(self, staleness_versions: int) -> None:
        self.staleness.observe(staleness_versions)
        self.discount.inc(staleness_discount(staleness_versions))

    def round_closed(self, fragment_id: int, summary: RoundSummary, round_s: float) -> None:
        self.quorum.observe(summary.contributors)
        self.round_duration.observe(round_s)
        self.outer_step.observe(summary.outer_step_s)
        fragment = str(fragment_id)
        self.largest_share.labels(fragment).set(summary.largest_share)
        self.share_bound.labels(fragment).set(twice_fair_share(summary.contributors))

    def influence_bounded(self, action: str) -> None:
        self.bounded.labels(action).inc()

    def snapshot_written(self, seconds: float) -> None:
        self.snapshot.observe(seconds)
        self.last_snapshot.set_to_current_time()

    def leases_expired(self, count: int) -> None:
        self.lease_expiries.inc(count)


class _StateCollector(Collector):
    def __init__(
        self, aggregator: Aggregator, servicer: AggregatorServicer, rate_limit: RateLimit | None
    ) -> None:
        self.aggregator, self.servicer, self.rate_limit = aggregator, servicer, rate_limit

    def collect(self) -> Iterator:
        agg = self.aggregator
        versions = GaugeMetricFamily(
            "diloco_server_fragment_version",
            "Current global version of each fragment this shard owns (-1: not initialised).",
            labels=["fragment"],
        )
        for fid, version, _ in agg.owned()[1]:
            versions.add_metric([str(fid)], version)
        yield versions
        yield GaugeMetricFamily(
            "diloco_server_state_dir_failed",
            "1 once the state dir could not be written: the shard takes no new versions "
            "until it is restarted (the log says why), else 0.",
            value=int(agg.state_failure() is not None),
        )
        yield GaugeMetricFamily(
            "diloco_server_live_learners",
            "Learners holding a live lease.",
            value=len(agg.live_learners()),
        )
        pushes = CounterMetricFamily(
            "diloco_server_pushes",
            "PushFragment calls by result: accepted, or the status they were refused with.",
            labels=["result"],
        )
        for result, count in sorted(self.servicer.push_results.snapshot().items()):
            pushes.add_metric([result], count)
        yield pushes
        limited = CounterMetricFamily(
            "diloco_server_rate_limited_calls",
            "Calls refused because their learner exceeded its rate limit, by method.",
            labels=["method"],
        )
        if self.rate_limit is not None:
            for method, count in sorted(self.rate_limit.refused_counts().items()):
                limited.add_metric([method], count)
        yield limited
        received = CounterMetricFamily(
            "diloco_server_received_bytes",
            "Bytes of gRPC messages received, per fragment.",
            labels=["fragment"],
        )
        sent = CounterMetricFamily(
            "diloco_server_sent_bytes",
            "Bytes of gRPC messages sent, per fragment.",
            labels=["fragment"],
        )
        for fid, counts in self.servicer.traffic.by_fragment().items():
            label = "none" if fid == NO_FRAGMENT else str(fid)
            received.add_metric([label], counts["received"])
            sent.add_metric([label], counts["sent"])
        yield received
        yield sent
        merged = CounterMetricFamily(
            "diloco_server_merged_tokens",
            "Training tokens of accepted pushes whose round has closed, per fragment (a "
            "learner's token counts once for each fragment it pushes).",
            labels=["fragment"],
        )
        for fid, tokens in sorted(self.servicer.merged_tokens.totals(agg.version).items()):
            merged.add_metric([str(fid)], tokens)
        yield merged


class _CallsCollector(Collector):
    """Calls the server holds open: what the bounds on worker threads watch."""

    def __init__(self, servicer: AggregatorServicer, in_flight: InFlightLimit | None) -> None:
        self.servicer, self.in_flight = servicer, in_flight

    def collect(self) -> Iterator:
        yield GaugeMetricFamily(
            "diloco_server_waiting_pulls",
            "PullParams long-polls waiting now for a version (each holds a worker thread).",
            value=self.servicer.waiting.snapshot().get("pulls", 0),
        )
        budget = self.servicer.push_budget
        yield GaugeMetricFamily(
            "diloco_server_push_memory_reserved_bytes",
            "Bytes of push_memory_budget_mb held now: payloads being received, pushes whose "
            "add waits to be done with the next, and buffers kept for reuse.",
            value=budget.reserved_bytes(),
        )
        yield GaugeMetricFamily(
            "diloco_server_push_memory_deferred_bytes",
            "Of those, the buffers of accepted pushes whose add waits to be done with the "
            "next push's (at most half the budget).",
            value=budget.held_bytes(),
        )
        yield GaugeMetricFamily(
            "diloco_server_push_memory_budget_bytes",
            "The push memory budget in bytes (push_memory_budget_mb, or the size chosen for "
            "the owned fragments; 0 until the model is known).",
            value=budget.budget_bytes or 0,
        )
        yield CounterMetricFamily(
            "diloco_server_push_memory_refused_calls",
            "Pushes refused because push_memory_budget_mb stayed full for push_budget_wait_s.",
            value=budget.refused,
        )
        refused = CounterMetricFamily(
            "diloco_server_in_flight_limited_calls",
            "Calls refused because their learner already had max_calls_in_flight open, by method.",
            labels=["method"],
        )
        if self.in_flight is not None:
            for method, count in sorted(self.in_flight.refused_counts().items()):
                refused.add_metric([method], count)
        yield refused


class _CutsCollector(Collector):
    """Calls the server ended itself: streams past their deadline, calls of revoked tokens."""

    def __init__(self, deadlines: StreamDeadlines | None, auth: TokenAuth | None) -> None:
        self.deadlines, self.auth = deadlines, auth

    def collect(self) -> Iterator:
        cut = CounterMetricFamily(
            "diloco_server_cut_calls",
            "Calls the server ended, by reason: idle (no progress from the peer for "
            "stream_idle_timeout_s), slow (a stream past its stream_min_bytes_per_s bound), "
            "revoked (its learner's token was revoked).",
            labels=["reason"],
        )
        counts = self.deadlines.cut_counts() if self.deadlines is not None else {}
        if self.auth is not None:
            counts["revoked"] = self.auth.revoked_calls
        for reason, count in sorted(counts.items()):
            cut.add_metric([reason], count)
        yield cut


class MergedTokens:
    """Tokens of accepted pushes whose round has closed, per fragment: the training that
    reached the global model (for metrics). A push counts once the version it was accepted
    for exists; one in a round that a crash loses never does."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._merged: collections.Counter[int] = collections.Counter()
        # fragment -> round version -> tokens of its accepted pushes, while the round is open
        self._open: dict[int, collections.Counter[int]] = {}

    def add(self, fragment_id: int, round_version: int, tokens: int, version: int) -> None:
        """A push of `tokens` accepted for `round_version`; the fragment is at `version`."""
        with self._lock:
            self._open.setdefault(fragment_id, collections.Counter())[round_version] += tokens
            self._close(fragment_id, version)

    def totals(self, version_of: Callable[[int], int]) -> dict[int, int]:
        """Merged tokens per fragment, given each fragment's current version."""
        with self._lock:
            for fragment_id in self._open:
                self._close(fragment_id, version_of(fragment_id))
            return dict(self._merged)

    def _close(self, fragment_id: int, version: int) -> None:
        rounds = self._open[fragment_id]
        for round_version in [v for v in rounds if v <= version]:
            self._merged[fragment_id] += rounds.pop(round_version)


class Counts:
    """Counts by a bounded set of keys, thread-safe (push results, waiting long-polls)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: collections.Counter[str] = collections.Counter()

    def add(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._counts[key] += n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)
