"""A server (or N shards of it) and K learners as real processes on loopback, each learner
behind a FaultProxy per shard.

    cluster = Cluster(workdir, learners=3, fragments=2, shards=2)
    cluster.start()                    # the shards, then the proxies and learners
    cluster.learners[1].kill(); cluster.start_learner(1)    # kill -9 and restart
    cluster.servers[1].kill(); cluster.start_server(1)      # kill -9 of shard 1 and restart
    for proxy in cluster.proxies[0]: proxy.cut()            # a network cut of learner 0
    cluster.stop()

Every daemon serves Prometheus metrics on a free port (deploy/launcher.py reports it) and
each learner writes its summary to workdir/learner-I.json when it ends: the harnesses
(deploy/chaos.py, bench/decoupled.py) read those, never the logs. A server restarts on the
same gRPC port with the same state dir, so the proxies and learners find it again. Shard 0
is named "server", shard s > 0 "server-s" (its log, port file and state dir too).
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
    """N shards and K learners, each learner behind its own FaultProxy to each shard."""

    def __init__(
        self,
        workdir: Path,
        learners: int,
        fragments: int,
        mode: str = "quorum",
        learner_flags: dict[int, list[str]] | None = None,
        shards: int = 1,
        learner_nice: int = 0,
    ) -> None:
        """`learner_flags`: extra flags for some learners (e.g. a --slowdown);
        `learner_nice`: run the learners at this niceness (`nice -n`), below the servers."""
        self.workdir, self.k, self.fragments = workdir, learners, fragments
        self.mode, self.shards = mode, shards
        self.learner_flags = learner_flags or {}
        self.learner_nice = learner_nice
        workdir.mkdir(parents=True, exist_ok=True)
        self.ports = [0] * shards
        self.servers: dict[int, Daemon] = {}
        self.learners: dict[int, Daemon] = {}
        self.proxies: dict[int, list[FaultProxy]] = {}  # learner -> one per shard
        self.started = time.monotonic()

    @staticmethod
    def shard_name(shard: int) -> str:
        return "server" if shard == 0 else f"server-{shard}"

    def now(self) -> float:
        """Seconds since the cluster was made: the clock of its events and measurements."""
        return time.monotonic() - self.started

    def start(self) -> None:
        for shard in range(self.shards):
            self.start_server(shard)
        for i in range(self.k):
            self.proxies[i] = [FaultProxy(("127.0.0.1", port)) for port in self.ports]
            for proxy in self.proxies[i]:
                proxy.start()
            self.start_learner(i)

    def start_server(self, shard: int = 0) -> None:
        """Start a shard (again: same port, same state dir); returns once it serves."""
        name = self.shard_name(shard)
        sharding = ["--shard-index", shard, "--shard-count", self.shards] if self.shards > 1 else []
        self.servers[shard] = start_daemon(
            name,
            [
                *SERVER,
                "--insecure",  # loopback only
                "--listen",
                f"127.0.0.1:{self.ports[shard]}",
                "--state-dir",
                self.workdir / name.replace("server", "state"),
                "--mode",
                self.mode,
                "--fragments",
                self.fragments,
                "--lease-s",
                "3",
                "--grace-max-s",
                "1",
                *sharding,
            ],
            self.workdir / f"{name}.log",
            port_file=self.workdir / f"{name}.port",
            metrics=True,
            append=True,
        )
        self.ports[shard] = self.servers[shard].port

    def start_learner(self, i: int) -> None:
        """Start learner i (again); does not wait for it to join."""
        self.learners[i] = start_daemon(
            f"learner-{i}",
            [
                *(["nice", "-n", self.learner_nice] if self.learner_nice else []),  # same PID
                *LEARNER,
                "--insecure",
                "--server",
                ",".join(f"127.0.0.1:{proxy.port}" for proxy in self.proxies[i]),
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
        """The processes running now, by name ("server", "server-S", "learner-I")."""
        named = {self.shard_name(s): daemon for s, daemon in self.servers.items()}
        return named | {f"learner-{i}": daemon for i, daemon in self.learners.items()}

    def dead(self) -> list[str]:
        """Names of the processes that should run but do not."""
        return [name for name, daemon in self.daemons().items() if not daemon.running()]

    def stop_learners(self) -> None:
        """End every learner (SIGTERM: each merges what is in flight, then leaves)."""
        stop_all(list(self.learners.values()))

    def stop(self) -> None:
        """Learners first (they leave the run), then the server, then the proxies."""
        self.stop_learners()
        for server in self.servers.values():
            server.stop()
        for proxies in self.proxies.values():
            for proxy in proxies:
                proxy.close()
