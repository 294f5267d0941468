"""Both daemons' /metrics pass `promtool check metrics`, and a real Prometheus scrapes them.

Needs Debian's `prometheus` package (prometheus and promtool on PATH). Without it the tests
skip, unless DILOCO_REQUIRE_PROMETHEUS=1 (set by .ci/run), when they fail instead.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from common.retry import wait_until
from deploy.launcher import Daemon, start_daemon, stop_all
from deploy.prometheus_api import instant_query
from tests.support.processes import free_ports, learner_process, server_process

DEADLINE_S = 90


def require(binary: str) -> str:
    path = shutil.which(binary)
    if path is None:
        if os.environ.get("DILOCO_REQUIRE_PROMETHEUS") == "1":
            pytest.fail(f"{binary} is not installed (apt-get install prometheus)")
        pytest.skip(f"{binary} is not installed (apt-get install prometheus)")
    return path


@pytest.fixture
def daemons(tmp_path: Path) -> Iterator[dict[str, int]]:
    """A server and a learner as real processes, each with a metrics endpoint on port 0."""
    started: list[Daemon] = []
    try:
        started.append(server_process(tmp_path, "server", metrics=True))
        port = started[0].port
        started.append(learner_process(tmp_path, port, "metrics-test", metrics=True))
        yield {
            name: wait_until(daemon.metrics_port, DEADLINE_S, f"{name} serving /metrics")
            for name, daemon in zip(("server", "learner"), started, strict=False)
        }
    finally:
        stop_all(started[::-1])


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        return reply.read().decode()


def poll(fetch, ready, what: str):
    """fetch() every half second until ready(its value); returns that value."""
    return wait_until(lambda: v if ready(v := fetch()) else None, DEADLINE_S, what, 0.5)


def test_promtool_accepts_both_endpoints(daemons: dict[str, int]) -> None:
    promtool = require("promtool")
    text = poll(
        lambda: scrape(daemons["learner"]),
        lambda t: "diloco_learner_outer_steps_total 0.0" not in t,
        "a completed outer step",
    )
    for name, body in (("learner", text), ("server", scrape(daemons["server"]))):
        result = subprocess.run(
            [promtool, "check", "metrics"], input=body, capture_output=True, text=True
        )
        assert result.returncode == 0, f"{name}: {result.stdout}{result.stderr}"
    server = scrape(daemons["server"])
    assert 'diloco_server_fragment_version{fragment="0"}' in server
    assert "process_resident_memory_bytes " in server  # the dashboard's memory per shard


def test_prometheus_scrapes_training_progress(daemons: dict[str, int], tmp_path: Path) -> None:
    binary = require("prometheus")
    (web_port,) = free_ports(1)  # Prometheus cannot report a port it picked itself
    config = tmp_path / "prometheus.yml"
    targets = [f"127.0.0.1:{daemons['server']}", f"127.0.0.1:{daemons['learner']}"]
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        f"  - job_name: diloco\n    static_configs: [{{targets: {json.dumps(targets)}}}]\n"
    )
    prometheus = start_daemon(
        "prometheus",
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{web_port}",
        ],
        tmp_path / "prometheus.log",
    )

    def query(expr: str) -> list:
        return instant_query(f"http://127.0.0.1:{web_port}", expr)

    try:
        poll(lambda: query("sum(up)"), lambda r: r and float(r[0]["value"][1]) == 2, "up")
        steps = poll(
            lambda: query("diloco_learner_inner_steps_total"),
            lambda r: r and float(r[0]["value"][1]) > 0,
            "learner inner steps",
        )
        assert steps[0]["metric"]["instance"] == targets[1]
        poll(
            lambda: query("min(diloco_server_fragment_version)"),
            lambda r: r and float(r[0]["value"][1]) >= 1,
            "a closed round on the server",
        )
        live = query("diloco_server_live_learners")
        assert float(live[0]["value"][1]) == 1
    finally:
        prometheus.stop()


def test_promtool_accepts_the_compose_prometheus_configs() -> None:
    # deploy/prometheus/k8s.yml needs Kubernetes service discovery, which Debian's
    # prometheus package leaves out; its shape is checked in tests/unit/test_deploy_manifests.py.
    promtool = require("promtool")
    for name in ("compose.yml", "host.yml"):
        path = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / name
        result = subprocess.run(
            [promtool, "check", "config", str(path)], capture_output=True, text=True
        )
        assert result.returncode == 0, f"{name}: {result.stdout}{result.stderr}"
