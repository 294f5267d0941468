"""Real servers on port 0 and real learner processes, shared by the integration tests."""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from common.config import build_config
from deploy.launcher import Daemon
from server.config import ServerConfig
from server.main import AggregatorService
from tests.support.processes import learner_process, server_process


@pytest.fixture
def start_service() -> Iterator[Callable[..., AggregatorService]]:
    """Start an in-process aggregator on a free loopback port; stopped after the test."""
    services: list[AggregatorService] = []

    def start(**config) -> AggregatorService:
        tls = any(key.startswith("tls_") for key in config)
        settings = {"listen": "127.0.0.1:0", "insecure": not tls, **config}
        service = AggregatorService(build_config(ServerConfig, settings))
        service.start()
        services.append(service)
        return service

    yield start
    for service in services:
        service.stop(grace_s=0)


@pytest.fixture
def start_learner(tmp_path: Path) -> Iterator[Callable[..., subprocess.Popen]]:
    """Start `diloco-learner` as a real process; killed after the test if still running."""
    procs: list[subprocess.Popen] = []

    def start(port: int, learner_id: str, *flags: str) -> subprocess.Popen:
        proc = learner_process(tmp_path, port, learner_id, *flags).proc
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture
def start_server_process(tmp_path: Path) -> Iterator[Callable[..., Daemon]]:
    """Start `diloco-server` processes by their flags, metrics on, logging to
    tmp_path/server.log, server1.log, ...; stopped after the test."""
    daemons: list[Daemon] = []

    def start(*flags: str) -> Daemon:
        name = f"server{len(daemons) or ''}"
        daemons.append(server_process(tmp_path, name, *flags, metrics=True))
        return daemons[-1]

    yield start
    for daemon in daemons:
        daemon.stop()
