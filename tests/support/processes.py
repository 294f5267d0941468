"""Real daemons for the integration tests: a server or a learner as a process on loopback.

    server = server_process(tmp_path, "server", "--mode", "quorum")    # serving on server.port
    learner = learner_process(tmp_path, server.port, "a", "--max-outer-steps", "3")
    assert learner.wait(120) == 0, learner_log(tmp_path, "a")

Both go through the one launcher (deploy/launcher.py): a log file per process in tmp_path,
port 0 and a port file, stopped by PID.
"""

from __future__ import annotations

import math
import socket
from pathlib import Path

from deploy.launcher import LEARNER, REPO, SERVER, Daemon, start_daemon
from deploy.prometheus_api import scrape

__all__ = [
    "REPO", "TINY_LEARNER_FLAGS", "free_ports", "learner_log", "learner_process", "metric",
    "server_process",
]  # fmt: skip

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


def server_process(
    tmp_path: Path, name: str, *flags: str, port: int = 0, metrics: bool = False
) -> Daemon:
    """`diloco-server --insecure` on 127.0.0.1:`port` (0: a free one), logging to
    tmp_path/NAME.log; returns once it serves (Daemon.port)."""
    return start_daemon(
        name,
        [*SERVER, "--insecure", "--listen", f"127.0.0.1:{port}", *flags],
        tmp_path / f"{name}.log",
        port_file=tmp_path / f"{name}.port",
        metrics=metrics,
    )


def learner_process(
    tmp_path: Path, port: int, learner_id: str, *flags: str, metrics: bool = False
) -> Daemon:
    """`diloco-learner` with TINY_LEARNER_FLAGS against 127.0.0.1:`port`, logging to
    tmp_path/LEARNER_ID.log (learner_log)."""
    argv = [*LEARNER, "--server", f"127.0.0.1:{port}", "--learner-id", learner_id]
    return start_daemon(
        learner_id,
        [*argv, *TINY_LEARNER_FLAGS, *flags],
        tmp_path / f"{learner_id}.log",
        metrics=metrics,
    )


def free_ports(count: int) -> list[int]:
    """`count` distinct free loopback ports, for daemons whose ports must be known before
    they start; the gap until they bind them is tiny."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def learner_log(tmp_path: Path, learner_id: str) -> str:
    return (tmp_path / f"{learner_id}.log").read_text()


def metric(daemon: Daemon, name: str, **labels: str) -> float:
    """One sample of a daemon started with metrics=True; NaN while it does not answer."""
    samples = scrape(daemon.metrics_port())
    return math.nan if samples is None else samples.value(name, **labels)
