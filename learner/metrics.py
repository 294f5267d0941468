"""The learner's Prometheus metrics, read from its state at scrape time.

    registry = sync.metrics_registry()     # a DilocoSync's; learner_registry(sync) builds it
    serve_metrics("0.0.0.0:9101", registry)   # common/metrics_http

Nothing is updated in the training loop: a collector reads the DilocoSync's progress, sync
statistics and byte counters when Prometheus scrapes, so the daemon (whose rank 0 holds a
DilocoSync) and a library user's loop export the same metrics. Labels are bounded:
`fragment` (P values) and the one-sample `diloco_learner_info{learner_id}`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from learner.api import DilocoSync


def learner_registry(sync: DilocoSync) -> CollectorRegistry:
    """A fresh registry whose collector reads `sync` at each scrape."""
    registry = CollectorRegistry()
    registry.register(_LearnerCollector(sync))
    return registry


class _LearnerCollector(Collector):
    def __init__(self, sync: DilocoSync) -> None:
        self.sync = sync

    def collect(self) -> Iterator:
        p, stats, traffic = self.sync.progress, self.sync.stats, self.sync.traffic
        yield InfoMetricFamily(
            "diloco_learner", "Which learner this is.", value={"learner_id": p.learner_id}
        )
        counters = {
            "inner_steps": ("Inner optimizer steps taken.", p.inner_steps),
            "outer_steps": ("Outer steps (H inner steps each) completed.", p.outer_steps),
            "tokens": ("Training tokens processed.", p.tokens),
            "compute_seconds": ("Seconds spent computing inner steps.", p.compute_s),
            "sync_blocked_seconds": (
                "Seconds the training loop waited at a merge point for a fragment.",
                stats.blocked_s if stats else 0.0,
            ),
            "sent_bytes": ("Bytes of gRPC messages sent to the aggregator.", traffic.sent),
            "received_bytes": ("Bytes of gRPC messages received.", traffic.received),
            "rejoins": ("Times the learner joined again after losing its session.", p.rejoins),
            "fragment_syncs": ("Fragment syncs merged.", stats.syncs if stats else 0),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(f"diloco_learner_{name}", doc, value=value)
        yield GaugeMetricFamily(
            "diloco_learner_train_loss", "Loss of the last inner step.", value=p.last_loss
        )
        yield GaugeMetricFamily(
            "diloco_learner_inner_lr",
            "Inner learning rate of the last step (NaN where the training loop is the user's).",
            value=p.inner_lr,
        )
        last_eval = p.eval_losses[-1] if p.eval_losses else float("nan")
        yield GaugeMetricFamily(
            "diloco_learner_eval_loss",
            "Validation loss of the global parameters at the last outer step.",
            value=last_eval,
        )
        yield GaugeMetricFamily(
            "diloco_learner_shards_away",
            "Aggregator shards that do not know this learner's session now (down, restarted, "
            "or never reached); their fragments do not sync until they are joined again.",
            value=self.sync.shards_away,
        )
        versions = GaugeMetricFamily(
            "diloco_learner_fragment_version",
            "Version of the learner's replica of each global fragment.",
            labels=["fragment"],
        )
        staleness = GaugeMetricFamily(
            "diloco_learner_replica_staleness_versions",
            "Server version (at the last heartbeat) minus the replica's version, per fragment.",
            labels=["fragment"],
        )
        server_versions = self.sync.server_versions
        for fid, version in enumerate(self.sync.versions):  # replicas are in fragment order
            versions.add_metric([str(fid)], version)
            if fid < len(server_versions):
                staleness.add_metric([str(fid)], max(0, server_versions[fid] - version))
        yield versions
        yield staleness
