"""A server that cannot start says why in one error and leaves nothing running: a port in
use (gRPC would otherwise share it through SO_REUSEPORT and take half its connections), a
health port on the service's, a port file it cannot write."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from common.config import build_config
from common.rpc import create_health_server, create_server
from server.config import ServerConfig
from server.main import AggregatorService
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
