"""The chaos harness's fault schedule: a fault waits until the cluster has recovered from the
last one, and every kind comes in turn (deploy/chaos_faults.py)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from deploy import cluster as cluster_module
from deploy.chaos_faults import KINDS, Faults, LastRounds, Target, is_back
from deploy.watch import LearnerPoint, ServerPoint, Watch, round_times


def learner(t: float, pid: int, versions: tuple[int, ...]) -> LearnerPoint:
    return LearnerPoint(t, pid, 0, 2.0, versions)


def server(t: float, versions: tuple[int, ...]) -> ServerPoint:
    return ServerPoint(t, 7, versions, (("merged_tokens", 0.0),))


def test_a_learner_is_back_once_its_versions_move_on_after_the_fault() -> None:
    points = [learner(1, 5, (3, 3)), learner(4, 5, (3, 3))]
    assert not is_back(points, pid=5, since=2)  # alive, but nothing new since the fault
    assert is_back([*points, learner(5, 5, (4, 3))], pid=5, since=2)
    assert not is_back([*points, learner(5, 5, (4, 3))], pid=5, since=5)


def test_a_restarted_learner_is_back_after_moving_on_from_what_it_joined_with() -> None:
    old = [learner(1, 5, (3, 3)), learner(2, 5, (4, 4))]
    joined = [*old, learner(6, 9, ()), learner(7, 9, (6, 6))]
    assert not is_back(joined, pid=9, since=3)  # joined: not yet seen a newer version
    assert is_back([*joined, learner(8, 9, (7, 6))], pid=9, since=3)
    assert not is_back([*joined, learner(8, 9, (7, 6))], pid=5, since=3)  # the old process


def test_rounds_must_have_closed_on_every_shard_since() -> None:
    watch = Watch(dict, lambda: 0.0)
    watch.servers = {"server": [server(1, (1, 1)), server(3, (2, 1))]}
    assert LastRounds().closed_since(watch, 2) and not LastRounds().closed_since(watch, 3)
    watch.servers["server-1"] = [server(1, (1,)), server(2, (1,))]
    assert not LastRounds().closed_since(watch, 0)  # shard 1 never closed one


def test_last_rounds_read_incrementally_agree_with_round_times() -> None:
    rng = random.Random(3)
    watch = Watch(dict, lambda: 0.0)
    points: list[ServerPoint] = []
    watch.servers = {"server": points}
    last_rounds = LastRounds()
    for t in range(300):  # versions that move on, stay, or restart lower (a new process)
        versions = () if rng.random() < 0.05 else (rng.randrange(-1, 20), rng.randrange(8))
        points.append(server(t, versions))
        since = rng.uniform(0, t)
        expected = any(r > since for r in round_times(points))
        assert last_rounds.closed_since(watch, since) == expected


@dataclass
class FakeDaemon:
    pid: int
    alive: bool = True

    def running(self) -> bool:
        return self.alive


@dataclass
class FakeCluster:
    k: int = 3
    shards: int = 1
    learners: dict[int, FakeDaemon] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.learners = {i: FakeDaemon(pid=100 + i) for i in range(self.k)}


def watch_of(cluster: FakeCluster, moved_after: dict[int, float], rounds_at: float) -> Watch:
    """Each learner seen at versions (1, 1) at t = 0 and (2, 2) at moved_after[i] (if any);
    the server closing a round at `rounds_at`."""
    watch = Watch(dict, lambda: 0.0)
    watch.servers = {"server": [server(0, (1, 1)), server(rounds_at, (2, 2))]}
    for i, daemon in cluster.learners.items():
        points = [learner(0, daemon.pid, (1, 1))]
        if i in moved_after:
            points.append(learner(moved_after[i], daemon.pid, (2, 2)))
        watch.learners[f"learner-{i}"] = points
    return watch


def test_no_fault_until_a_round_closed_after_the_last_one() -> None:
    cluster = FakeCluster()
    faults = Faults(KINDS, random.Random(0))
    faults.last_end = 5.0
    watch = watch_of(cluster, {i: 6.0 for i in range(3)}, rounds_at=4.0)
    assert faults.next_target(cluster, watch) is None
    watch.servers["server"].append(server(6.5, (3, 3)))  # a round closes after the fault
    target = faults.next_target(cluster, watch)
    assert target is not None and target.kind == "learner_kill"


def test_a_learner_fault_only_hits_a_learner_that_is_back() -> None:
    cluster = FakeCluster()
    faults = Faults(KINDS, random.Random(0))
    faults.last_end, faults.since = 5.0, {"learner-0": 5.0, "learner-2": 5.0}
    # learner-0 and learner-2 have not moved on since their faults; learner-1 had no fault.
    watch = watch_of(cluster, {0: 4.0, 1: 4.0, 2: 4.0}, rounds_at=6.0)
    assert {faults.next_target(cluster, watch) for _ in range(20)} == {Target("learner_kill", 1)}
    cluster.learners[1].alive = False  # a dead learner is not back either
    assert faults.next_target(cluster, watch) is None


def test_a_server_kill_waits_until_every_learner_is_back() -> None:
    cluster = FakeCluster()
    faults = Faults(KINDS, random.Random(0))
    faults.injected = KINDS.index("server_kill")  # its turn
    faults.last_end, faults.since = 5.0, {"learner-2": 5.0}
    waiting = watch_of(cluster, {0: 6.0, 1: 6.0, 2: 4.0}, rounds_at=6.0)
    assert faults.next_target(cluster, waiting) is None
    everyone = watch_of(cluster, {0: 6.0, 1: 6.0, 2: 6.0}, rounds_at=6.0)
    assert faults.next_target(cluster, everyone) == Target("server_kill", 0)
    assert faults.kind == "server_kill"  # asking does not move the turn on; injecting does


def test_a_server_kill_does_not_wait_for_a_learner_still_starting() -> None:
    cluster = FakeCluster()
    faults = Faults(KINDS, random.Random(0))
    faults.injected = KINDS.index("server_kill")
    faults.last_end, faults.since = 5.0, {"learner-2": 5.0}
    watch = watch_of(cluster, {0: 6.0, 1: 6.0}, rounds_at=6.0)
    cluster.learners[2] = FakeDaemon(pid=200)  # killed and started again: not joined yet
    assert faults.starting(cluster, watch) == [2]
    assert faults.next_target(cluster, watch) == Target("server_kill", 0)
    # Once it has joined, the kill waits for it to move on like any other learner.
    watch.learners["learner-2"].append(learner(7, 200, (2, 2)))
    assert faults.starting(cluster, watch) == [] and faults.next_target(cluster, watch) is None
    cluster.learners[2].alive = False  # nor does a dead one count as starting
    assert faults.starting(cluster, watch) == []


def test_learners_start_at_the_niceness_asked_for(monkeypatch, tmp_path) -> None:
    started: list[list[str]] = []

    def record(name: str, argv: list, *args, **kwargs) -> None:
        started.append([str(arg) for arg in argv])

    monkeypatch.setattr(cluster_module, "start_daemon", record)
    for nice in (10, 0):
        cluster = cluster_module.Cluster(tmp_path, 1, fragments=2, learner_nice=nice)
        cluster.proxies[0] = []
        cluster.start_learner(0)
    assert started[0][:3] == ["nice", "-n", "10"] and started[0][4:6] == ["-m", "learner.main"]
    assert started[1][1:3] == ["-m", "learner.main"]  # the interpreter itself, not nice
