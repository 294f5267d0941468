"""The aggregator as 3 shard processes, 2 learner processes, P = 3: each fragment synced with
its owner only, a shard killed with -9 mid-round stalls only its own fragment, another shard
killed with -9 and restarted meanwhile is joined again and syncs on while the first is still
down, each restarts from its state dir without losing a served version, and the replicas end
bit-identical to the shards' parameters; and a learner that starts while a shard is down
trains and syncs with the others, then joins that shard when it comes up."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest

from common.generated.diloco.v1 import aggregator_pb2 as pb
from common.retry import wait_until
from deploy.launcher import Daemon
from learner.client import AggregatorClient
from tests.support.processes import learner_log, learner_process, metric, server_process

SHARDS = 3
# Generous bounds: the machine may be busy; each wait ends as soon as its outcome holds.
WAIT_S = 240.0


def start_shard(
    tmp_path: Path, index: int, name: str, port: int = 0, mode: str = "quorum"
) -> Daemon:
    flags = ["--shard-index", str(index), "--shard-count", str(SHARDS)]
    flags += ["--fragments", "3", "--layout", "balanced", "--mode", mode, "--lease-s", "10"]
    flags += ["--state-dir", str(tmp_path / f"state-{index}")]
    return server_process(tmp_path, name, *flags, port=port)


def shard_status(port: int) -> pb.StatusResponse | None:
    """The shard's Status answer; None while it cannot be reached."""
    client = AggregatorClient(f"127.0.0.1:{port}")
    try:
        return client.status()
    except grpc.RpcError:
        return None
    finally:
        client.close()


def shard_fragments(port: int) -> dict[int, tuple[int, int]]:
    """fragment -> (version, params_crc32) of the fragments the shard at `port` owns;
    empty while it cannot be reached."""
    status = shard_status(port)
    if status is None:
        return {}
    assert status.shard_count == SHARDS
    return {f.fragment_id: (f.version, f.params_crc32) for f in status.fragments}


def pushed_since_start(port: int) -> set[str]:
    """The live learners whose pushes the shard at `port` has taken since it started."""
    status = shard_status(port)
    learners = status.learners if status is not None else []
    return {s.learner_id for s in learners if s.live and s.last_push_fragment >= 0}


def all_versions(ports: list[int]) -> dict[int, int]:
    return {fid: v for port in ports for fid, (v, _) in shard_fragments(port).items()}


def wait_versions_beyond(ports: list[int], floor: dict[int, int], rise: int, what: str) -> None:
    """Until every fragment in `floor` is at least `rise` versions past it on `ports`."""

    def risen() -> bool:
        now = all_versions(ports)
        return all(now.get(fid, -1) >= v + rise for fid, v in floor.items())

    wait_until(risen, WAIT_S, what, interval_s=0.5)


@pytest.mark.slow
def test_three_shards_two_learners_kill_9_of_one_shard(tmp_path) -> None:
    shards = [start_shard(tmp_path, i, f"shard-{i}") for i in range(SHARDS)]
    ports = [shard.port for shard in shards]
    addresses = ",".join(f"127.0.0.1:{port}" for port in ports)
    learners: dict[str, Daemon] = {}

    def learner_flags(name: str, outer_steps: int = 1_000_000) -> list[str]:
        summary = ["--summary-file", str(tmp_path / f"{name}.json")]
        return ["--server", addresses, "--max-outer-steps", str(outer_steps), *summary]

    try:
        for name in ("a", "b"):
            learners[name] = learner_process(tmp_path, ports[0], name, *learner_flags(name))
        # P = N: each shard owns one fragment (the greedy rule, server/state/params.py).
        wait_until(
            lambda: all(len(shard_fragments(p)) == 1 for p in ports), WAIT_S, "every shard owns"
        )
        wait_until(
            lambda: all(pushed_since_start(p) == {"a", "b"} for p in ports),
            WAIT_S,
            "both learners pushing to every shard",
        )

        # kill -9 of shard 1 mid-run: what it served just before is the floor after restart.
        (killed_fid, (served, _)) = next(iter(shard_fragments(ports[1]).items()))
        live_ports = [ports[0], ports[2]]
        at_kill = all_versions(live_ports)
        shards[1].kill()
        wait_versions_beyond(live_ports, at_kill, 3, "the live shards' fragments moving on")
        assert not shards[1].running()
        assert shard_fragments(ports[1]) == {}  # measured during the outage
        assert all(learner.running() for learner in learners.values())

        # kill -9 and restart of shard 2 while shard 1 is still down: the learners join
        # shard 2 again on their own and go on syncing shards 0 and 2.
        (other_fid, (other_served, _)) = next(iter(shard_fragments(ports[2]).items()))
        shards[2].kill()
        shards[2] = start_shard(tmp_path, 2, "shard-2-restarted", port=ports[2])
        other_restored, _ = shard_fragments(ports[2])[other_fid]
        assert other_restored >= other_served
        wait_until(lambda: pushed_since_start(ports[2]) == {"a", "b"}, WAIT_S, "shard 2 rejoined")
        wait_versions_beyond(live_ports, all_versions(live_ports), 3, "syncing with shard 1 down")
        assert not shards[1].running() and shard_fragments(ports[1]) == {}

        shards[1] = start_shard(tmp_path, 1, "shard-1-restarted", port=ports[1])
        restored, _ = shard_fragments(ports[1])[killed_fid]
        assert restored >= served  # no version it served is lost
        wait_versions_beyond([ports[1]], {killed_fid: restored}, 3, "the restarted shard")
        # Both learners catch up: they join the restarted shard again and push to it.
        wait_until(lambda: pushed_since_start(ports[1]) == {"a", "b"}, WAIT_S, "both learners back")

        for name in ("a", "b"):
            assert learners[name].stop(60) == 0, learner_log(tmp_path, name)
        before = all_versions(ports)
        # A learner that ends on its own merges every sync it started: its replicas are the
        # shards' newest parameters (a learner stopped by a signal may leave one in flight).
        learners["c"] = learner_process(tmp_path, ports[0], "c", *learner_flags("c", 3))
        assert learners["c"].wait(WAIT_S) == 0, learner_log(tmp_path, "c")
        final = {fid: vc for port in ports for fid, vc in shard_fragments(port).items()}
    finally:
        for learner in learners.values():
            learner.stop(30)
        for shard in shards:
            shard.stop(30)
    summaries = {n: json.loads((tmp_path / f"{n}.json").read_text()) for n in learners}
    c = summaries["c"]
    assert all(final[fid][0] > before[fid] for fid in final)  # c's pushes made new versions
    assert {fid: (c["versions"][fid], c["params_crc32"][fid]) for fid in final} == final
    assert summaries["a"]["rejoins"] >= 1 and summaries["b"]["rejoins"] >= 1  # caught up


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["quorum", "sync"])  # sync: merges wait, but not for it
def test_a_learner_started_while_a_shard_is_down_joins_it_when_it_comes_up(
    tmp_path, mode: str
) -> None:
    shards = [start_shard(tmp_path, i, f"shard-{i}", mode=mode) for i in range(SHARDS)]
    ports = [shard.port for shard in shards]
    addresses = ",".join(f"127.0.0.1:{port}" for port in ports)
    shards[2].stop(30)  # down before any learner has joined it
    flags = ["--server", addresses, "--summary-file", str(tmp_path / "a.json")]
    learner = None
    try:
        learner = learner_process(
            tmp_path, ports[0], "a", *flags, "--max-outer-steps", "1000000", metrics=True
        )
        live_ports = ports[:2]
        wait_until(lambda: all(pushed_since_start(p) == {"a"} for p in live_ports), WAIT_S,
                   "the learner syncing with the live shards")  # fmt: skip
        wait_versions_beyond(live_ports, all_versions(live_ports), 2, "the live shards' rounds")
        assert learner.running() and not shards[2].running()
        assert metric(learner, "diloco_learner_shards_away") == 1

        shards[2] = start_shard(tmp_path, 2, "shard-2-late", port=ports[2], mode=mode)
        wait_until(lambda: pushed_since_start(ports[2]) == {"a"}, WAIT_S, "the late shard joined")
        (late_fid, (version, _)) = next(iter(shard_fragments(ports[2]).items()))
        wait_versions_beyond([ports[2]], {late_fid: version}, 2, "the late shard's rounds")
        assert metric(learner, "diloco_learner_shards_away") == 0
        assert learner.stop(60) == 0, learner_log(tmp_path, "a")
    finally:
        if learner is not None:
            learner.stop(30)
        for shard in shards:
            shard.stop(30)
    summary = json.loads((tmp_path / "a.json").read_text())
    assert summary["rejoins"] >= 1
    assert "unreachable at join" in learner_log(tmp_path, "a")
