"""Real servers on port 0 and real learner processes, shared by the integration tests."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from common.config import build_config
from server.app import AggregatorService
from server.config import ServerConfig

REPO = Path(__file__).resolve().parents[2]

# A model and data small enough that an outer step takes well under a second on one core.
TINY_LEARNER_FLAGS = [
    "--n-layer",
    "1",
    "--n-head",
    "2",
    "--n-embd",
    "32",
    "--block-size",
    "32",
    "--batch-size",
    "4",
    "--sync-every-steps",
    "5",
    "--corpus-max-bytes",
    "300000",
    "--eval-batches",
    "2",
    "--torch-threads",
    "1",
    "--connect-timeout-s",
    "30",
    "--status-every-s",
    "0",  # tests wait for every outer step's log line
    "--insecure",
]


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
        log = open(tmp_path / f"{learner_id}.log", "w")
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "learner.main",
                "--server",
                f"127.0.0.1:{port}",
                "--learner-id",
                learner_id,
                *TINY_LEARNER_FLAGS,
                *flags,
            ],
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def learner_log(tmp_path: Path, learner_id: str) -> str:
    return (tmp_path / f"{learner_id}.log").read_text()
