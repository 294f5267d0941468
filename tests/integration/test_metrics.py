"""Both daemons' /metrics pass `promtool check metrics`, and a real Prometheus scrapes them.

Needs Debian's `prometheus` package (prometheus and promtool on PATH). Without it the tests
skip, unless DILOCO_REQUIRE_PROMETHEUS=1 (set by .ci/run), when they fail instead.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from deploy.prometheus_api import instant_query
from tests.integration.conftest import REPO, TINY_LEARNER_FLAGS

DEADLINE_S = 90


def require(binary: str) -> str:
    path = shutil.which(binary)
    if path is None:
        if os.environ.get("DILOCO_REQUIRE_PROMETHEUS") == "1":
            pytest.fail(f"{binary} is not installed (apt-get install prometheus)")
        pytest.skip(f"{binary} is not installed (apt-get install prometheus)")
    return path


def wait_for_file(path: Path, proc: subprocess.Popen) -> str:
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().endswith("\n"):
            return path.read_text().strip()
        assert proc.poll() is None, f"process exited with {proc.returncode}"
        time.sleep(0.05)
    raise AssertionError(f"{path} did not appear within {DEADLINE_S} s")


def free_port() -> int:
    # Prometheus cannot report a port it picked itself; the gap until it binds is tiny.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def daemons(tmp_path: Path) -> Iterator[dict[str, int]]:
    """A server and a learner as real processes, each with a metrics endpoint on port 0."""
    procs = []

    def spawn(module: str, *flags: str) -> subprocess.Popen:
        log = open(tmp_path / f"{module}.log", "w")
        proc = subprocess.Popen(
            [sys.executable, "-m", module, *flags], cwd=REPO, stdout=log, stderr=log
        )
        procs.append(proc)
        return proc

    try:
        server = spawn(
            "server.main",
            "--insecure",
            "--listen",
            "127.0.0.1:0",
            "--port-file",
            str(tmp_path / "port"),
            "--metrics-listen",
            "127.0.0.1:0",
            "--metrics-port-file",
            str(tmp_path / "server-metrics"),
        )
        port = wait_for_file(tmp_path / "port", server)
        learner = spawn(
            "learner.main",
            "--server",
            f"127.0.0.1:{port}",
            "--learner-id",
            "metrics-test",
            *TINY_LEARNER_FLAGS,
            "--metrics-listen",
            "127.0.0.1:0",
            "--metrics-port-file",
            str(tmp_path / "learner-metrics"),
        )
        yield {
            "server": int(wait_for_file(tmp_path / "server-metrics", server)),
            "learner": int(wait_for_file(tmp_path / "learner-metrics", learner)),
        }
    finally:
        for proc in reversed(procs):
            proc.send_signal(signal.SIGTERM)
        for proc in reversed(procs):
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        return reply.read().decode()


def wait_until(fetch, ready, what: str):
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        value = fetch()
        if ready(value):
            return value
        time.sleep(0.5)
    raise AssertionError(f"{what} not seen within {DEADLINE_S} s; last: {value}")


def test_promtool_accepts_both_endpoints(daemons: dict[str, int]) -> None:
    promtool = require("promtool")
    text = wait_until(
        lambda: scrape(daemons["learner"]),
        lambda t: "diloco_learner_outer_steps_total 0.0" not in t,
        "a completed outer step",
    )
    for name, body in (("learner", text), ("server", scrape(daemons["server"]))):
        result = subprocess.run(
            [promtool, "check", "metrics"], input=body, capture_output=True, text=True
        )
        assert result.returncode == 0, f"{name}: {result.stdout}{result.stderr}"
    assert 'diloco_server_fragment_version{fragment="0"}' in scrape(daemons["server"])


def test_prometheus_scrapes_training_progress(daemons: dict[str, int], tmp_path: Path) -> None:
    binary = require("prometheus")
    web_port = free_port()
    config = tmp_path / "prometheus.yml"
    targets = [f"127.0.0.1:{daemons['server']}", f"127.0.0.1:{daemons['learner']}"]
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        f"  - job_name: diloco\n    static_configs: [{{targets: {json.dumps(targets)}}}]\n"
    )
    log = open(tmp_path / "prometheus.log", "w")
    prometheus = subprocess.Popen(
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{web_port}",
        ],
        stdout=log,
        stderr=log,
    )

    def query(expr: str) -> list:
        return instant_query(f"http://127.0.0.1:{web_port}", expr)

    try:
        wait_until(lambda: query("sum(up)"), lambda r: r and float(r[0]["value"][1]) == 2, "up")
        steps = wait_until(
            lambda: query("diloco_learner_inner_steps_total"),
            lambda r: r and float(r[0]["value"][1]) > 0,
            "learner inner steps",
        )
        assert steps[0]["metric"]["instance"] == targets[1]
        wait_until(
            lambda: query("min(diloco_server_fragment_version)"),
            lambda r: r and float(r[0]["value"][1]) >= 1,
            "a closed round on the server",
        )
        live = query("diloco_server_live_learners")
        assert float(live[0]["value"][1]) == 1
    finally:
        prometheus.terminate()
        prometheus.wait(timeout=30)
