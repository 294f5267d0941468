"""Short chaos runs: every kind of fault once, all invariants hold (the long run is in
bench/results/chaos.json)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.processes import REPO

# Minutes of real processes: the slow tier (make test-slow).
pytestmark = pytest.mark.slow


def chaos(tmp_path: Path, *flags: str, timeout_s: int = 420) -> dict:
    """`diloco-chaos` with 2 learners, a fault about every 3 s (once the cluster has
    recovered from the last) until 4 faults (one of each kind, as they come in turn) have
    been injected, beside a fault-free run; its report. The run's duration is only a bound:
    on a busy machine a server restart takes a good part of a minute, so a timed run could
    fit fewer kinds."""
    report_path = tmp_path / "chaos.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "deploy.chaos",
            "--learners",
            "2",
            "--duration-s",
            "240",
            "--faults",
            "4",
            "--fault-every-s",
            "3",
            "--seed",
            "1",
            "--report",
            str(report_path),
            *flags,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(report_path.read_text())
    assert report["invariants_ok"] and report["version_regressions"] == 0
    assert report["failures"] == [] and sum(report["faults_by_kind"].values()) == 4
    # Training went on through the faults. Goodput has no upper bound asserted here: it
    # compares two runs' throughput, which a loaded machine moves either way.
    assert report["goodput"] > 0
    return report


def test_short_chaos_run_keeps_every_invariant(tmp_path) -> None:
    report = chaos(tmp_path)
    assert set(report["faults_by_kind"]) == {
        "learner_kill",
        "learner_stall",
        "server_kill",
        "net_cut",
    }


def test_short_chaos_run_over_two_shards_kills_one_shard(tmp_path) -> None:
    # Shard kills come last in turn (the fourth fault); two clusters of four daemons or more
    # at once get a longer bound.
    report = chaos(tmp_path, "--shards", "2", timeout_s=600)
    assert "shard_kill" in report["faults_by_kind"]
    shard_kills = [e for e in report["timeline"] if e["kind"] == "shard_kill"]
    assert {e["target"] for e in shard_kills} <= {"server", "server-1"}
