"""The status report and page, built from a real Aggregator (no sockets)."""

from __future__ import annotations

import json

import pytest
import torch

from common.config import build_config
from common.traffic import Traffic
from server.aggregator import Aggregator
from server.config import ServerConfig
from server.state.params import ParamSpec
from server.status_page import render_status
from server.status_report import shard_report
from tests.support.fakes import FakeClock

SPECS = [ParamSpec("w", (4,), "float32"), ParamSpec("b", (4,), "float32")]


def server_config(**settings) -> ServerConfig:
    return build_config(ServerConfig, {"insecure": True, **settings})


def started(config: ServerConfig, learners: list[str], clock: FakeClock) -> tuple:
    agg = Aggregator(config, clock)
    sessions = [agg.join(name, SPECS, 100).session_id for name in learners]
    for fragment, indices, _ in agg.layout():
        if agg.has_fragment(fragment) and fragment in {f for f, _, _ in agg.owned()[1]}:
            agg.initialize(sessions[0], fragment, [torch.zeros(4) for _ in indices])
    return agg, sessions


def test_a_quorum_round_in_its_grace_window_and_each_learners_row() -> None:
    clock = FakeClock()
    config = server_config(mode="quorum", min_contributors=2, grace_min_s=3.0, grace_max_s=3.0)
    agg, (a, b, c) = started(config, ["a", "b", "c"], clock)
    agg.push(a, 0, 0, [torch.ones(4)] * 2, 1000, 10)
    clock.now += 5.0
    report = shard_report(agg, Traffic(), config, 9100)
    (fragment,) = report["fragments"]
    assert fragment["round"] == {"pushes": 1, "awaited": 2, "quorum": 2, "grace_left_s": None}
    assert fragment["last_close_s_ago"] is None  # no round closed yet
    agg.push(b, 0, 0, [torch.ones(4)] * 2, 1000, 10)  # the quorum: 3 s of grace for c
    clock.now += 1.0
    (fragment,) = shard_report(agg, Traffic(), config, 9100)["fragments"]
    assert fragment["round"]["grace_left_s"] == pytest.approx(2.0)
    clock.now += 2.5
    agg.tick()  # the reaper's tick closes the round once the grace is over
    report = shard_report(agg, Traffic(), config, 9100)
    assert report["fragments"][0]["version"] == 1
    rows = {x["learner_id"]: x for x in report["learners"]}
    assert rows["a"]["last_push_version"] == 1 and rows["a"]["staleness"] == 0
    assert rows["a"]["tokens"] == 1000 and rows["c"]["tokens"] == 0  # its accepted pushes
    assert rows["a"]["weight_share"] == pytest.approx(0.5)  # a and b pushed, alike
    assert rows["c"]["last_push_version"] == -1 and rows["c"]["weight_share"] == 0.0
    json.dumps(report)  # /status.json serves it as it is


def test_the_state_dir_shows_its_snapshot_and_log_and_links_the_shards(tmp_path) -> None:
    config = server_config(
        state_dir=str(tmp_path / "state"),
        shard_count=2,
        fragments=2,
        layout="balanced",
        shard_addresses="10.0.0.1:50051,10.0.0.2:50051",
    )
    agg, _ = started(config, ["a"], FakeClock())
    agg.checkpoint()
    report = shard_report(agg, Traffic(), config, 9100)
    state = report["state"]
    assert state["error"] is None and state["snapshot"]["bytes"] > 0 and state["log"] is not None
    assert [s["status_url"] for s in report["shards"]] == ["/status", "http://10.0.0.2:9100/status"]


def test_the_page_escapes_what_learners_name_themselves() -> None:
    config = server_config(mode="sync")
    agg, _ = started(config, ["<script>alert(1)</script>"], FakeClock())
    page = render_status(shard_report(agg, Traffic(), config, 9100))
    assert "<script>" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "http-equiv='refresh'" in page and "src=" not in page  # no external asset


def test_status_urls_must_list_every_shard() -> None:
    with pytest.raises(ValueError, match="shard_status_urls lists 1 URLs"):
        server_config(shard_count=2, fragments=2, shard_status_urls="http://a:9100/status")
    with pytest.raises(ValueError, match="must be http"):
        server_config(shard_status_urls="ftp://a/status")
