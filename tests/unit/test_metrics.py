"""Server and learner metrics: the aggregator's events and state reach the registry."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import torch
import yaml
from prometheus_client import generate_latest

from server.aggregator import Aggregator
from server.config import aggregator_config
from server.rpc.metrics import MergedTokens, ServerMetrics
from server.rpc.servicer import AggregatorServicer
from server.state.params import ParamSpec
from tests.support.fakes import FINGERPRINT, FakeClock, tensors

REPO = Path(__file__).resolve().parents[2]


def test_server_metrics_record_rounds_staleness_and_state() -> None:
    clock, metrics = FakeClock(), ServerMetrics()
    agg = Aggregator(
        aggregator_config(mode="quorum", min_contributors=2), clock=clock, events=metrics
    )
    servicer = AggregatorServicer(agg)
    metrics.watch(agg, servicer)
    a, b, c = (agg.join(name, FINGERPRINT).session_id for name in ("a", "b", "c"))
    agg.initialize(a, 0, tensors(0))
    get = metrics.registry.get_sample_value

    agg.push(a, 0, 0, tensors(1), tokens=10, inner_steps=1)
    clock.now = 3.0
    agg.push(b, 0, 0, tensors(2), tokens=10, inner_steps=1)  # K = 2, no grace: closes
    assert get("diloco_server_fragment_version", {"fragment": "0"}) == 1
    assert get("diloco_server_round_contributions_count") == 1
    assert get("diloco_server_round_contributions_sum") == 2
    assert get("diloco_server_round_duration_seconds_sum") == 3.0
    assert get("diloco_server_contribution_staleness_versions_sum") == 0

    agg.push(a, 0, 1, tensors(3), tokens=10, inner_steps=1)
    agg.push(c, 0, 0, tensors(4), tokens=10, inner_steps=1)  # one version behind
    assert get("diloco_server_contribution_staleness_versions_sum") == 1
    assert get("diloco_server_contribution_staleness_versions_bucket", {"le": "0.0"}) == 3
    assert get("diloco_server_contribution_discount_total") == 3.5  # 3 x 1 + 1/(1 + 1)
    assert get("diloco_server_fragment_version", {"fragment": "0"}) == 2
    assert get("diloco_server_live_learners") == 3
    agg.leave(b)
    assert get("diloco_server_live_learners") == 2

    servicer.count_push("accepted")
    servicer.count_push("failed_precondition")
    assert get("diloco_server_pushes_total", {"result": "accepted"}) == 1
    assert get("diloco_server_pushes_total", {"result": "failed_precondition"}) == 1
    servicer.traffic.count(0, sent=100, received=7)
    servicer.traffic.count(received=5)  # no fragment: Join, Heartbeat
    assert get("diloco_server_sent_bytes_total", {"fragment": "0"}) == 100
    assert get("diloco_server_received_bytes_total", {"fragment": "none"}) == 5
    servicer.merged_tokens.add(0, 3, 40, version=2)  # its round (version 3) is still open
    assert get("diloco_server_merged_tokens_total", {"fragment": "0"}) is None


def test_merged_tokens_count_a_push_once_its_round_has_closed() -> None:
    merged = MergedTokens()
    merged.add(0, 1, 100, version=0)  # fragment 0's round 1 is open
    merged.add(1, 1, 50, version=1)  # fragment 1's closed with this push (async mode)
    assert merged.totals({0: 0, 1: 1}.__getitem__) == {1: 50}
    merged.add(0, 1, 30, version=0)
    assert merged.totals({0: 1, 1: 1}.__getitem__) == {0: 130, 1: 50}
    merged.add(0, 2, 7, version=1)
    assert merged.totals({0: 1, 1: 1}.__getitem__) == {0: 130, 1: 50}
    assert merged.totals({0: 2, 1: 1}.__getitem__) == {0: 137, 1: 50}


def test_dashboard_has_a_panel_per_shard_for_versions_ingest_learners_and_memory() -> None:
    dashboard = json.loads((REPO / "deploy" / "grafana" / "diloco.json").read_text())
    per_shard = [
        t["expr"] for panel in dashboard["panels"] for t in panel["targets"] if "shard" in t["expr"]
    ]
    for metric in (
        "diloco_server_fragment_version",
        "diloco_server_received_bytes_total",
        "diloco_server_live_learners",
        "process_resident_memory_bytes",
    ):
        (expr,) = [e for e in per_shard if metric in e]
        assert re.search(r"by \(shard\b", expr), expr


def test_metrics_of_two_servers_do_not_mix() -> None:
    first, second = ServerMetrics(), ServerMetrics()
    first.contribution(3)
    assert first.registry.get_sample_value("diloco_server_contribution_staleness_versions_sum") == 3
    assert (
        second.registry.get_sample_value("diloco_server_contribution_staleness_versions_sum") == 0
    )


def test_snapshot_time_is_recorded(tmp_path) -> None:
    metrics = ServerMetrics()
    agg = Aggregator(aggregator_config(state_dir=str(tmp_path)), events=metrics)
    session = agg.join("a", [ParamSpec("w", (4,), "float32")]).session_id
    agg.initialize(session, 0, [torch.zeros(4)])
    count = "diloco_server_snapshot_write_seconds_count"
    stamp = "diloco_server_last_snapshot_timestamp_seconds"
    before, started = metrics.registry.get_sample_value(count), time.time()
    assert metrics.registry.get_sample_value(stamp) > 0  # initialize wrote the first one
    agg.checkpoint()
    assert metrics.registry.get_sample_value(count) == before + 1
    assert started <= metrics.registry.get_sample_value(stamp) <= time.time()


def test_no_snapshot_leaves_the_timestamp_at_zero() -> None:
    metrics = ServerMetrics()  # what the snapshot alert takes for "no state dir"
    assert metrics.registry.get_sample_value("diloco_server_last_snapshot_timestamp_seconds") == 0


def test_lease_expiries_count_sessions_closed_by_their_lease_only() -> None:
    clock, metrics = FakeClock(), ServerMetrics()
    agg = Aggregator(aggregator_config(lease_s=5.0), clock=clock, events=metrics)
    a, b, c = (agg.join(name, FINGERPRINT).session_id for name in ("a", "b", "c"))
    expiries = "diloco_server_lease_expiries_total"
    agg.leave(c)  # left: no expiry
    clock.now = 3.0
    agg.heartbeat(a)  # a's lease runs to 8 s, b's to 5 s
    clock.now = 6.0
    assert agg.expire_leases() == ["b"]
    assert metrics.registry.get_sample_value(expiries) == 1
    assert agg.expire_leases() == []
    assert metrics.registry.get_sample_value(expiries) == 1
    clock.now = 9.0
    agg.tick()  # the reaper's path
    assert metrics.registry.get_sample_value(expiries) == 2


def learner_exposition() -> str:
    """The learner's /metrics text, from a stand-in with the state a DilocoSync exposes."""
    from types import SimpleNamespace

    from common.traffic import Traffic
    from learner.metrics import learner_registry
    from learner.progress import Progress
    from learner.streaming import SyncStats

    sync = SimpleNamespace(
        progress=Progress(
            learner_id="a", inner_steps=5, tokens=640, eval_losses=[4.0, 3.5], inner_lr=2.5e-4
        ),
        stats=SyncStats(blocked_s=1.5),
        traffic=Traffic(),
        versions=[3],
        server_versions=[5],
        shards_away=1,
    )
    return generate_latest(learner_registry(sync)).decode()


def test_learner_metrics_read_its_state() -> None:
    text = learner_exposition()
    assert "diloco_learner_tokens_total 640.0" in text
    assert "diloco_learner_eval_loss 3.5" in text
    assert "diloco_learner_sync_blocked_seconds_total 1.5" in text
    assert 'diloco_learner_replica_staleness_versions{fragment="0"} 2.0' in text
    assert 'diloco_learner_info{learner_id="a"} 1.0' in text
    assert "diloco_learner_shards_away 1.0" in text
    assert "diloco_learner_inner_lr 0.00025" in text


def server_exposition() -> str:
    """The server's /metrics text, a learner joined and a push counted."""
    server = ServerMetrics()
    agg = Aggregator(aggregator_config())
    agg.join("a", FINGERPRINT)
    servicer = AggregatorServicer(agg)
    servicer.traffic.count(0, sent=1, received=1)
    servicer.count_push("accepted")
    server.watch(agg, servicer)
    return generate_latest(server.registry).decode()


def test_dashboard_uses_only_metrics_the_code_exports() -> None:
    exported = server_exposition() + learner_exposition()
    dashboard = json.loads((REPO / "deploy" / "grafana" / "diloco.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    names = {name for expr in exprs for name in re.findall(r"(?:diloco|process)_\w+", expr)}
    assert len(names) >= 12 and "process_resident_memory_bytes" in names
    for name in names:
        assert re.search(rf"^{name}[{{ ]", exported, re.M), f"{name} is not exported"


def test_alerts_use_only_metrics_the_code_exports() -> None:
    """Every diloco_* series deploy/prometheus/alerts.yml reads is a family the server
    declares (a labelled family is declared before its first sample, so TYPE lines count)."""
    families = dict(re.findall(r"^# TYPE (\S+) (\S+)$", server_exposition(), re.M))
    exported = set(families)
    for name, kind in families.items():
        if kind == "histogram":
            exported |= {f"{name}_count", f"{name}_sum", f"{name}_bucket"}
    rules = yaml.safe_load((REPO / "deploy" / "prometheus" / "alerts.yml").read_text())
    exprs = [rule["expr"] for group in rules["groups"] for rule in group["rules"]]
    names = {name for expr in exprs for name in re.findall(r"diloco_\w+", expr)}
    assert len(names) >= 10 and "diloco_server_lease_expiries_total" in names
    assert not names - exported, f"not exported: {sorted(names - exported)}"
