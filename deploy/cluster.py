"""A server and K learners as real processes on loopback, each learner behind a FaultProxy.

    cluster = Cluster(workdir, learners=3, fragments=2)
    cluster.start()                    # the server, then the proxies and learners
    cluster.learners[1].kill(); cluster.start_learner(1)    # kill -9 and restart
    cluster.proxies[0].cut(); cluster.proxies[0].restore()  # a network cut
    cluster.stop()

Every daemon serves Prometheus metrics on a free port (deploy/launcher.py reports it) and
each learner writes its summary to workdir/learner-I.json when it ends: the harnesses
(deploy/chaos.py, bench/decoupled.py) read those, never the logs. The server restarts on the
same gRPC port with the same state dir, so the proxies and learners find it again.
"""

from __future__ import annotations

import time
from pathlib import Path

from deploy.faultproxy import FaultProxy
from deploy.launcher import LEARNER, SERVER, Daemon, start_daemon, stop_all

# A model small enough for several learners on a shared CPU; an outer step takes seconds.
MODEL_FLAGS = [
    "--n-layer",
    "2",
    "--n-embd",
    "64",
    "--n-head",
    "4",
    "--block-size",
    "64",
    "--batch-size",
    "8",
    "--sync-every-steps",
    "20",
    "--eval-batches",
    "4",
    "--corpus-max-bytes",
    "1000000",
]


class Cluster:
    """A server and K learners, each learner behind its own FaultProxy."""

    def __init__(
        self,
        workdir: Path,
        learners: int,
        fragments: int,
        mode: str = "quorum",
        learner_flags: dict[int, list[str]] | None = None,
    ) -> None:
        """`learner_flags`: extra flags for some learners (e.g. a --slowdown)."""
        self.workdir, self.k, self.fragments = workdir, learners, fragments
        self.mode = mode
        self.learner_flags = learner_flags or {}
        workdir.mkdir(parents=True, exist_ok=True)
        self.port = 0
        self.server: Daemon | None = None
        self.learners: dict[int, Daemon] = {}
        self.proxies: dict[int, FaultProxy] = {}
        self.started = time.monotonic()

    def now(self) -> float:
        """Seconds since the cluster was made: the clock of its events and measurements."""
        return time.monotonic() - self.started

    def start(self) -> None:
        self.start_server()
        for i in range(self.k):
            self.proxies[i] = FaultProxy(("127.0.0.1", self.port))
            self.proxies[i].start()
            self.start_learner(i)

    def start_server(self) -> None:
        """Start the server (again: same port, same state dir); returns once it serves."""
        self.server = start_daemon(
            "server",
            [
                *SERVER,
                "--insecure",  # loopback only
                "--listen",
                f"127.0.0.1:{self.port}",
                "--state-dir",
                self.workdir / "state",
                "--mode",
                self.mode,
                "--fragments",
                self.fragments,
                "--lease-s",
                "3",
                "--grace-max-s",
                "1",
            ],
            self.workdir / "server.log",
            port_file=self.workdir / "server.port",
            metrics=True,
            append=True,
        )
        self.port = self.server.port

    def start_learner(self, i: int) -> None:
        """Start learner i (again); does not wait for it to join."""
        self.learners[i] = start_daemon(
            f"learner-{i}",
            [
                *LEARNER,
                "--insecure",
                "--server",
                f"127.0.0.1:{self.proxies[i].port}",
                "--learner-id",
                f"learner-{i}",
                "--learners-per-host",
                self.k,
                "--max-outer-steps",
                "100000000",
                "--summary-file",
                self.workdir / f"learner-{i}.json",
                *MODEL_FLAGS,
                *self.learner_flags.get(i, []),
            ],
            self.workdir / f"learner-{i}.log",
            metrics=True,
            append=True,
        )

    def daemons(self) -> dict[str, Daemon]:
        """The processes running now, by name ("server", "learner-I")."""
        named = {f"learner-{i}": daemon for i, daemon in self.learners.items()}
        return {"server": self.server, **named} if self.server else named

    def dead(self) -> list[str]:
        """Names of the processes that should run but do not."""
        return [name for name, daemon in self.daemons().items() if not daemon.running()]

    def stop_learners(self) -> None:
        """End every learner (SIGTERM: each merges what is in flight, then leaves)."""
        stop_all(list(self.learners.values()))

    def stop(self) -> None:
        """Learners first (they leave the run), then the server, then the proxies."""
        self.stop_learners()
        if self.server is not None:
            self.server.stop()
        for proxy in self.proxies.values():
            proxy.close()
