"""deploy/prometheus/alerts.yml passes `promtool check rules` and its unit tests
(alerts_test.yml), and every Prometheus config loads it from where its deployment mounts it.

Needs Debian's `prometheus` package (promtool on PATH). Without it the tests skip, unless
DILOCO_REQUIRE_PROMETHEUS=1 (set by .ci/run), when they fail instead.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.integration.test_metrics import require

PROMETHEUS = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"


def promtool(*args: str | Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [require("promtool"), *map(str, args)], capture_output=True, text=True, timeout=120
    )


def test_the_rules_are_valid() -> None:
    result = promtool("check", "rules", PROMETHEUS / "alerts.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    alerts = yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())["groups"][0]["rules"]
    assert f"SUCCESS: {len(alerts)} rules found" in result.stdout


def test_every_alert_fires_and_stays_silent_as_its_tests_expect() -> None:
    result = promtool("test", "rules", PROMETHEUS / "alerts_test.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    # Each alert has a case where it fires and one where it does not.
    tests = yaml.safe_load((PROMETHEUS / "alerts_test.yml").read_text())["tests"]
    cases = [case for test in tests for case in test["alert_rule_test"]]
    rules = yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())["groups"][0]["rules"]
    for alert in (rule["alert"] for rule in rules):
        expected = [case["exp_alerts"] for case in cases if case["alertname"] == alert]
        assert any(expected) and not all(expected), f"{alert}: a firing and a silent case"


def test_a_wrong_expectation_fails(tmp_path: Path) -> None:
    shutil.copy(PROMETHEUS / "alerts.yml", tmp_path / "alerts.yml")
    tests = yaml.safe_load((PROMETHEUS / "alerts_test.yml").read_text())
    state_dir = next(t for t in tests["tests"] if t["name"] == "the state dir failed")
    state_dir["alert_rule_test"][0]["exp_alerts"] = [{"exp_labels": {"severity": "critical"}}]
    (tmp_path / "wrong_test.yml").write_text(yaml.safe_dump({**tests, "tests": [state_dir]}))
    result = promtool("test", "rules", tmp_path / "wrong_test.yml")
    assert result.returncode != 0
    assert "FAILED" in result.stdout + result.stderr


@pytest.mark.parametrize("config", ["compose.yml", "host.yml", "k8s.yml"])
def test_each_config_loads_the_rules_from_its_mounted_folder(config: str, tmp_path: Path) -> None:
    """The config and the rules side by side, as docker-compose and the k8s ConfigMap mount
    them (named prometheus.yml there)."""
    loaded = yaml.safe_load((PROMETHEUS / config).read_text())
    if config == "k8s.yml":  # Debian's Prometheus is built without Kubernetes discovery
        loaded.pop("scrape_configs")
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(loaded))
    for rules in loaded["rule_files"]:
        shutil.copy(PROMETHEUS / rules, tmp_path / rules)
    result = promtool("check", "config", tmp_path / "prometheus.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(loaded['rule_files'])} rule files found" in result.stdout
