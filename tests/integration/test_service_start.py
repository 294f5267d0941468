"""A server that cannot start says why in one error and leaves nothing running: a port in
use (gRPC would otherwise share it through SO_REUSEPORT and take half its connections), a
health port on the service's, a port file it cannot write. One that stops says what a
restart resumes from."""

from __future__ import annotations

import logging
import socket
import subprocess
import sys

import pytest
import torch

from common.config import build_config
from common.rpc import create_health_server, create_server
from server.config import ServerConfig
from server.main import AggregatorService
from server.state.params import ParamSpec
from tests.support.processes import REPO


def free_to_bind(port: int) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def test_a_port_in_use_is_an_error_not_a_shared_port() -> None:
    server, port = create_server("127.0.0.1:0")
    server.start()
    try:
        with pytest.raises(OSError, match=f"could not bind the gRPC server to 127.0.0.1:{port}"):
            create_server(f"127.0.0.1:{port}")
        with pytest.raises(OSError, match=f"could not bind the health server to 127.0.0.1:{port}"):
            create_health_server(f"127.0.0.1:{port}")
    finally:
        server.stop(grace=0)


def test_the_health_port_may_not_be_the_services_on_another_host() -> None:
    with pytest.raises(ValueError, match="health_listen must have a port of its own"):
        build_config(
            ServerConfig,
            {"listen": "0.0.0.0:7000", "insecure": True, "health_listen": "127.0.0.1:7000"},
        )


def test_a_failed_start_stops_what_had_started(tmp_path) -> None:
    settings = {
        "listen": "127.0.0.1:0",
        "insecure": True,
        "health_listen": "127.0.0.1:0",
        "port_file": str(tmp_path / "absent-dir" / "port"),
    }
    service = AggregatorService(build_config(ServerConfig, settings))
    with pytest.raises(OSError):
        service.start()
    assert free_to_bind(service.port) and free_to_bind(service.health_port)


def test_the_daemon_reports_a_bind_failure_in_one_line() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "server.main", "--insecure", "--listen", "127.0.0.1:0",
             "--health-listen", f"127.0.0.1:{port}"],
            cwd=REPO, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert f"error: could not bind the health server to 127.0.0.1:{port}" in result.stderr


def stop_lines(caplog: pytest.LogCaptureFixture, state_dir: str) -> list[str]:
    """The log lines of a server on `state_dir` that a learner joined, as it stops."""
    settings = {"listen": "127.0.0.1:0", "insecure": True, "state_dir": state_dir}
    service = AggregatorService(build_config(ServerConfig, {**settings, "fragments": 2}))
    service.start()
    try:
        specs = [ParamSpec(f"blocks.{i}.w", (4,), "float32") for i in (0, 1)]
        session = service.aggregator.join("a", specs).session_id
        service.aggregator.initialize(session, 0, [torch.ones(4)])
    finally:
        caplog.clear()
        with caplog.at_level(logging.INFO):
            service.stop(grace_s=0)
    return [r.getMessage() for r in caplog.records]


def test_a_stopping_server_logs_the_snapshot_it_wrote_and_where_the_state_is(
    tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    state_dir = tmp_path / "state"
    lines = stop_lines(caplog, str(state_dir))
    snapshot = next(line for line in lines if line.startswith("snapshot written to "))
    assert snapshot.startswith(f"snapshot written to {state_dir}/snapshot-")
    assert "fragment versions {0: 0, 1: -1}, in " in snapshot and snapshot.endswith(" s")
    assert lines[-1] == f"stopped; the state is in {state_dir}"


def test_a_stopping_server_without_a_state_dir_says_nothing_was_saved(
    caplog: pytest.LogCaptureFixture,
) -> None:
    lines = stop_lines(caplog, "")
    assert not any(line.startswith("snapshot written") for line in lines)
    assert lines[-1] == (
        "stopped; no state_dir, so nothing was saved: a restart starts from the first join"
    )
