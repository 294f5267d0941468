"""Islands whose model is sharded with FSDP2 (torchrun, gloo on the CPU), each rank syncing
its own slice (learner/sliced.py), through learner/examples/fsdp_island.py: beside a
one-process learner against one server and against two shards, every rank's slice equal to
the server's rows bit for bit; the same run as a DDP island; HSDP; a rank killed mid-round."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common.codec.fragment import params_crc32
from common.codec.slices import SliceCut
from common.retry import wait_until
from deploy.launcher import Daemon, start_daemon
from tests.support.processes import TINY_LEARNER_FLAGS

OUTER_STEPS = 3
EXAMPLE = ("-m", "learner.examples.fsdp_island", "--insecure", "--sync-every-steps", "6")
ENV = os.environ | {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}  # loopback only


def torchrun(ranks: int, *flags: str) -> list[str]:
    launch = (sys.executable, "-m", "torch.distributed.run", "--standalone")
    return [*launch, "--nproc-per-node", str(ranks), *flags]


def start_island(
    tmp_path: Path,
    name: str,
    servers: str,
    ranks: int,
    *flags: str,
    launch=(),
    learner_id: str = "",
) -> Daemon:
    argv = torchrun(ranks, *launch) if ranks else [sys.executable]
    argv += [*EXAMPLE, "--server", servers, "--learner-id", learner_id or name.split("-")[0]]
    argv += ["--outer-steps", str(OUTER_STEPS), "--summary-file", str(tmp_path / name), *flags]
    return start_daemon(name, argv, tmp_path / f"{name}.log", env=ENV)


def finish(daemon: Daemon, tmp_path: Path, name: str, timeout_s: float = 240) -> None:
    try:
        code = daemon.wait(timeout_s)
    finally:
        daemon.kill()
    assert code == 0, (tmp_path / f"{name}.log").read_text()[-6000:]


def summaries(tmp_path: Path, name: str, ranks: int) -> list[dict]:
    return [json.loads((tmp_path / f"{name}.{r}").read_text()) for r in range(max(ranks, 1))]


def served(services) -> dict[int, list[torch.Tensor]]:
    """Every fragment's parameters, from the shard that owns it (the others hold none)."""
    return {
        fid: service.aggregator.params(fid)
        for service in services
        for fid, _, version in service.aggregator.layout()
        if version >= 0
    }


def versions(services) -> dict[int, int]:
    return {
        fid: version
        for service in services
        for fid, _, version in service.aggregator.layout()
        if version >= 0
    }


def start_shards(start_service, count: int, **config) -> list:
    shards = [start_service(shard_index=i, shard_count=count, **config) for i in range(count)]
    addresses = ",".join(f"127.0.0.1:{s.port}" for s in shards)
    for shard in shards:
        shard.config.sharding.shard_addresses = addresses
    return shards


@pytest.mark.parametrize("shard_count", [1, 2])
def test_an_fsdp_island_and_a_single_learner_train_together(
    start_service, tmp_path, shard_count
) -> None:
    # Sync mode, K = 2: every round needs the island's push and the single learner's. A
    # width of 32 cuts the 32-value norms into 16-value slices, inside fp4 blocks.
    services = start_shards(start_service, shard_count, fragments=2, min_contributors=2)
    servers = ",".join(f"127.0.0.1:{s.port}" for s in services)
    width = ("--n-embd", "32")
    island = start_island(tmp_path, "island", servers, 2, *width)
    single = start_island(tmp_path, "single", servers, 0, "--parallel", "none", *width)
    finish(island, tmp_path, "island")
    finish(single, tmp_path, "single")
    assert (tmp_path / "island.log").read_text().count("learner=island joined") == 1
    params = served(services)
    assert sorted(params) == [0, 1]
    assert versions(services) == {0: OUTER_STEPS, 1: OUTER_STEPS}
    for rank in summaries(tmp_path, "island", 2):
        index, count = rank["slice_of"]
        assert count == 2 and rank["versions"] == [OUTER_STEPS] * 2
        for fid, tensors in params.items():
            cut = SliceCut([tuple(t.shape) for t in tensors], index, count)
            rows = [cut.of(t, i) for i, t in enumerate(tensors)]
            assert rank["params_crc32"][fid] == params_crc32(rows)  # bit for bit
    (single_summary,) = summaries(tmp_path, "single", 0)
    assert single_summary["params_crc32"] == [params_crc32(params[f]) for f in (0, 1)]


def test_an_fsdp_island_matches_a_ddp_island(start_service, tmp_path) -> None:
    # Each alone against a server of its own, with the same learner id (so the same data);
    # a width of 64 puts every slice edge on an fp4 block edge, so both islands push the
    # same quantized values.
    finals, sent = {}, {}
    for mode in ("fsdp", "ddp"):
        service = start_service(fragments=2, min_contributors=1)
        name = f"island-{mode}"
        saved = tmp_path / f"{mode}.pt"
        daemon = start_island(
            tmp_path,
            name,
            f"127.0.0.1:{service.port}",
            2,
            "--parallel",
            mode,
            "--save-params",
            str(saved),
        )
        finish(daemon, tmp_path, name)
        finals[mode] = torch.load(saved)
        sent[mode] = sum(r.get("bytes_sent", 0) for r in summaries(tmp_path, name, 2))
    for a, b in zip(finals["fsdp"], finals["ddp"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # The same pseudo-gradients in slices: their bytes within 1% of one process's.
    assert sent["ddp"] <= sent["fsdp"] <= 1.01 * sent["ddp"]


def test_a_four_rank_hsdp_island(start_service, tmp_path) -> None:
    service = start_service(fragments=2, min_contributors=1)
    island = start_island(
        tmp_path, "hsdp", f"127.0.0.1:{service.port}", 4, "--parallel", "hsdp", "--replicas", "2"
    )
    finish(island, tmp_path, "hsdp", timeout_s=360)
    params = served([service])
    ranks = summaries(tmp_path, "hsdp", 4)
    assert sorted(tuple(r["slice_of"]) for r in ranks) == [(0, 2), (0, 2), (1, 2), (1, 2)]
    for rank in ranks:
        index, count = rank["slice_of"]
        for fid, tensors in params.items():
            cut = SliceCut([tuple(t.shape) for t in tensors], index, count)
            assert rank["params_crc32"][fid] == params_crc32(
                [cut.of(t, i) for i, t in enumerate(tensors)]
            )
    # Replica 0 carries the slices: the other replica's ranks send nothing.
    assert sorted(r["bytes_sent"] > 0 for r in ranks) == [False, False, True, True]


def rank_pids(daemon: Daemon) -> list[int]:
    """The rank processes torchrun started (its children), in pid order."""
    out = subprocess.run(
        ["ps", "-o", "pid=", "--ppid", str(daemon.proc.pid)], capture_output=True, text=True
    )
    return sorted(int(pid) for pid in out.stdout.split())


def test_a_rank_killed_mid_round_restarts_the_island_as_the_same_learner(
    start_service, tmp_path
) -> None:
    service = start_service(fragments=1, min_contributors=1, lease_s=10.0)
    servers = f"127.0.0.1:{service.port}"
    island = start_island(
        tmp_path, "island", servers, 2, "--outer-steps", "6", launch=("--max-restarts", "1")
    )
    # Fewer outer steps: it leaves first, and the island's last version is the server's.
    single = start_island(
        tmp_path, "single", servers, 0, "--parallel", "none", "--outer-steps", "2"
    )
    wait_until(lambda: "island" in service.aggregator.live_learners(), 180, "the island joined")
    joined_at = versions([service]).get(0, -1)
    wait_until(lambda: versions([service]).get(0, -1) > joined_at, 180, "a round with the island")
    pids = rank_pids(island)
    assert len(pids) == 2, f"the island's ranks are gone before the kill: {pids}"
    os.kill(pids[1], signal.SIGKILL)  # rank 1, while the next round is open
    at_kill = service.aggregator.version(0)
    finish(island, tmp_path, "island", timeout_s=300)
    finish(single, tmp_path, "single", timeout_s=120)
    log = (tmp_path / "island.log").read_text()
    assert log.count("learner=island joined") == 2  # the restarted island joined again
    assert service.aggregator.version(0) > at_kill
    params = served([service])[0]
    for rank in summaries(tmp_path, "island", 2):
        cut = SliceCut([tuple(t.shape) for t in params], rank["slice_of"][0], 2)
        assert rank["params_crc32"] == [params_crc32([cut.of(t, i) for i, t in enumerate(params)])]


def test_the_built_in_learner_as_an_fsdp_island(start_service, tmp_path) -> None:
    service = start_service(fragments=2, min_contributors=1)
    argv = torchrun(2, "-m", "learner.main", "--server", f"127.0.0.1:{service.port}")
    argv += ["--learner-id", "builtin", *TINY_LEARNER_FLAGS, "--n-layer", "2"]
    argv += ["--island-sharding", "fsdp", "--max-outer-steps", str(OUTER_STEPS)]
    argv += ["--summary-file", str(tmp_path / "s.json"), "--save-params", str(tmp_path / "p.pt")]
    finish(start_daemon("builtin", argv, tmp_path / "builtin.log", env=ENV), tmp_path, "builtin")
    assert "learner=builtin joined" in (tmp_path / "builtin.log").read_text()
    assert "island_ranks=2 slices=2" in (tmp_path / "builtin.log").read_text()
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["outer_steps"] == OUTER_STEPS and summary["island_size"] == 2
    assert len(summary["eval_losses"]) == OUTER_STEPS + 1
    assert versions([service]) == {0: OUTER_STEPS, 1: OUTER_STEPS}
    saved = list(torch.load(tmp_path / "p.pt").values())
    for fid, indices, _ in service.aggregator.layout():
        for i, want in zip(indices, service.aggregator.params(fid), strict=True):
            assert torch.equal(saved[i], want)  # gathered from the slices: the server's


def test_an_fsdp_island_in_quorum_mode(start_service, tmp_path) -> None:
    # Quorum, K = 1, beside a one-process learner: nobody waits, and the island's ranks merge
    # only when every rank's sync is back, at one version. Every pull checks the slice's CRC
    # against the server's (a mismatch fails the island), so finishing is the bit-exactness
    # check here; whoever pushes last decides the server's final versions.
    service = start_service(fragments=2, min_contributors=1, mode="quorum")
    servers, width = f"127.0.0.1:{service.port}", ("--n-embd", "32")
    island = start_island(tmp_path, "island", servers, 2, *width, "--outer-steps", "6")
    single = start_island(
        tmp_path, "single", servers, 0, "--parallel", "none", *width, "--outer-steps", "2"
    )
    finish(single, tmp_path, "single")
    finish(island, tmp_path, "island")
    ranks = summaries(tmp_path, "island", 2)
    assert ranks[0]["versions"] == ranks[1]["versions"]  # every slice at one version
    final = [versions([service])[f] for f in (0, 1)]
    assert all(3 <= v <= f for v, f in zip(ranks[0]["versions"], final, strict=True))


def test_an_fsdp_island_resumes_from_each_ranks_state(start_service, tmp_path) -> None:
    # Each rank saves its slices and DilocoSync.state_dict(); started again, the island
    # continues its outer steps and keeps its local slices for every fragment the server
    # has not moved meanwhile (nobody did): nothing but "up to date" is pulled.
    service = start_service(fragments=2, min_contributors=1)
    servers, state = f"127.0.0.1:{service.port}", ("--state-dir", str(tmp_path / "state"))
    first = start_island(
        tmp_path, "first", servers, 2, *state, "--outer-steps", "2", learner_id="a"
    )
    finish(first, tmp_path, "first")
    assert versions([service]) == {0: 2, 1: 2}
    again = start_island(
        tmp_path, "again", servers, 2, *state, "--outer-steps", "4", learner_id="a"
    )
    finish(again, tmp_path, "again")
    log = (tmp_path / "again.log").read_text()
    assert log.count("resumed versions=[2, 2] kept_local=[0, 1] pulled_bytes=") == 2  # each rank
    assert versions([service]) == {0: 4, 1: 4}  # two more outer steps, not four
    params = served([service])
    for rank in summaries(tmp_path, "again", 2):
        for fid, tensors in params.items():
            cut = SliceCut([tuple(t.shape) for t in tensors], rank["slice_of"][0], 2)
            rows = [cut.of(t, i) for i, t in enumerate(tensors)]
            assert rank["params_crc32"][fid] == params_crc32(rows)
