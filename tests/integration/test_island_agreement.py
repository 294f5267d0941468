"""How the ranks of a sharded island agree at a merge (learner/sliced.py ShardedIsland.settle):
two real ranks (gloo on loopback, an FSDP2-sharded model), one collective a round."""

from __future__ import annotations

import json
import os
from pathlib import Path

import grpc
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

WORLD = 2


class CountedReplica:
    """A replica's version, and the versions it was brought to by a pull."""

    def __init__(self, version: int) -> None:
        self.version = version
        self.pulled: list[int] = []

    def apply(self, version: int) -> None:
        self.pulled.append(version)
        self.version = version


def _lost_pull(version: int) -> int:
    from learner.shard_sessions import SessionLost

    raise SessionLost(0, grpc.RpcError())  # the shard answered NOT_FOUND


def _rank(rank: int, store: str, out: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # loopback only
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    from learner.island import exit_without_teardown
    from learner.sliced import IslandRestart, ShardedIsland, shard_model

    finished, island = False, None
    try:
        model = nn.Linear(4, 4)
        shard_model(model, [], replicas=1, device=torch.device("cpu"))
        island = ShardedIsland(list(model.parameters()))
        result = {}
        for case, lost, pull in (
            ("settled", False, lambda version: version),
            ("rank 1 lost", rank == 1, lambda version: version),
            ("lost while pulling", False, _lost_pull),
        ):
            replica = CountedReplica(version=3 + 2 * rank)  # rank 0 behind: it pulls up to 5
            try:
                island.settle(replica, lost, pull)
                restart = None
            except IslandRestart as err:
                restart = str(err)
            result[case] = {
                "version": replica.version,
                "pulled": replica.pulled,
                "restart": restart,
            }
        Path(out, f"rank-{rank}.json").write_text(json.dumps(result))
        finished = True
    finally:  # as a learner's rank ends (a barrier after a finished run, then destroy)
        if island is not None:
            island.ranks.close(finished)
        else:
            dist.destroy_process_group()
    exit_without_teardown()


def test_ranks_settle_on_the_newest_version_and_restart_together_when_one_lost_it(
    tmp_path: Path,
) -> None:
    mp.spawn(_rank, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=WORLD, join=True)
    results = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(WORLD)]
    settled = [r["settled"] for r in results]
    assert [r["version"] for r in settled] == [5, 5] and [r["pulled"] for r in settled] == [[5], []]
    assert all(r["restart"] is None for r in settled)
    for result in results:  # every rank restarts, the ones that did not lose the session too
        for case in ("rank 1 lost", "lost while pulling"):
            assert "no longer knows the island's session" in (result[case]["restart"] or "")
    assert results[0]["rank 1 lost"]["pulled"] == []  # no rank pulls once one lost it
