"""The learner's Prometheus metrics, read from its state at scrape time.

    registry = learner_registry(learner)   # then common/metrics_http.serve_metrics(...)

Nothing is updated in the training loop: a collector reads the learner's progress, sync
statistics and byte counters when Prometheus scrapes. Labels are bounded: `fragment` (P
values) and the one-sample `diloco_learner_info{learner_id}`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from learner.trainer import Learner


def learner_registry(learner: Learner) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(_LearnerCollector(learner))
    return registry


class _LearnerCollector(Collector):
    def __init__(self, learner: Learner) -> None:
        self.learner = learner

    def collect(self) -> Iterator:
        learner = self.learner
        p, sync, traffic = learner.progress, learner.sync, learner.client.traffic
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
                sync.stats.blocked_s if sync else 0.0,
            ),
            "sent_bytes": ("Bytes of gRPC messages sent to the aggregator.", traffic.sent),
            "received_bytes": ("Bytes of gRPC messages received.", traffic.received),
            "rejoins": ("Times the learner joined again after losing its session.", p.rejoins),
            "fragment_syncs": ("Fragment syncs merged.", sync.stats.syncs if sync else 0),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(f"diloco_learner_{name}", doc, value=value)
        yield GaugeMetricFamily(
            "diloco_learner_train_loss", "Loss of the last inner step.", value=p.last_loss
        )
        last_eval = p.eval_losses[-1] if p.eval_losses else float("nan")
        yield GaugeMetricFamily(
            "diloco_learner_eval_loss",
            "Validation loss of the global parameters at the last outer step.",
            value=last_eval,
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
        server_versions = learner.server_versions
        for replica in sync.replicas if sync else []:
            fid = replica.fragment_id
            versions.add_metric([str(fid)], replica.version)
            if fid < len(server_versions):
                staleness.add_metric([str(fid)], max(0, server_versions[fid] - replica.version))
        yield versions
        yield staleness
