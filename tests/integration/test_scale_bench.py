"""bench/scale.py measures real shard processes: what each shard owns, its memory, the pushes
and their CPU cost, and the pull latency, with no refused call."""

from __future__ import annotations

import json
import math
import sys

import pytest

from bench import scale
from bench.scale import FRAGMENTS, TENSORS, Model, payloads_of, run

# Minutes of real processes: the slow tier (make test-slow).
pytestmark = pytest.mark.slow


def test_two_shards_split_the_fragments_and_every_figure_is_measured() -> None:
    model = Model(64)
    report = run(2, 2, model, payloads_of(model), duration_s=1.0, rss_limit_mb=8192.0,
                 min_versions=3, timeout_s=120.0, quorum=2)  # fmt: skip
    assert report["errors"] == {} and not report["rss_limit_hit"] and report["quorum"] == 2
    owned = [s["owned_fragments"] for s in report["per_shard"]]
    assert sorted(f for fs in owned for f in fs) == list(range(FRAGMENTS))
    assert all(fs for fs in owned)  # balanced by bytes: two equal fragments each
    fragment_mb = 64 * 64 * 4 * TENSORS / FRAGMENTS / 2**20
    assert [s["owned_mb"] for s in report["per_shard"]] == [2 * fragment_mb] * 2
    # Three versions of each fragment, both learners in each round: 2 x 4 x 3 pushes at least.
    assert report["pushes"] >= 2 * FRAGMENTS * 3
    assert report["pushed_gb"] > 0 and math.isfinite(report["cpu_s_per_gb"])
    assert report["pulls_timed"] >= 1 and report["pull_p50_s"] > 0
    assert report["rss_per_owned_model"] == max(
        s["rss_per_owned_model"] for s in report["per_shard"]
    )


def test_quick_measures_every_figure_into_its_own_file(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(scale, "RESULTS", tmp_path)
    argv = ["scale.py", "--quick", "--side", "64", "--shards", "1"]
    flags = "--outer-state-dtype bfloat16 --push-memory-budget-mb 1"  # passed to each shard
    monkeypatch.setattr(sys, "argv", [*argv, "--shard-flags", flags])
    assert scale.main() == 0
    assert not (tmp_path / "scale.json").exists()  # the full run's figures stay as they are
    report = json.loads((tmp_path / "scale_quick.json").read_text())
    assert report["quick"] and [r["shards"] for r in report["runs"]] == [1]
    assert report["shard_flags"] == flags
    (only,) = report["runs"]
    figures = ("rss_per_owned_model", "pushes_per_s", "cpu_s_per_gb", "cpu_s_per_accepted_gb")
    figures += ("pull_p50_s", "pull_p99_s")
    assert all(only[k] is not None and only[k] > 0 for k in figures)
