"""The torchtitan recipe (learner/adapters/torchtitan.py): torchtitan's llama3 debug model,
built, sharded with FSDP2 and trained by torchtitan's own loop on two ranks (torchrun, gloo
on the CPU, tests/support/titan_island.py), syncs as one island through a real server and
ends holding the server's parameters bit for bit. Skips when torchtitan is not installed,
unless DILOCO_REQUIRE_TORCHTITAN=1, when it fails instead."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

H = 4
OUTER_STEPS = 3
RANKS = 2
BATCH, SEQ_LEN = 2, 32  # tests/support/titan_island.py's
REPO = str(Path(__file__).resolve().parents[2])


def torchtitan_or_skip() -> None:
    required = os.environ.get("DILOCO_REQUIRE_TORCHTITAN") == "1"
    try:
        import torchtitan.trainer  # noqa: F401  (imports triton too)
    except ImportError as error:
        reason = f"torchtitan does not import ({error}): pip install 'decoupled-diloco[torchtitan]'"
        (pytest.fail if required else pytest.skip)(reason)


def test_a_torchtitan_trainer_trains_an_fsdp_island(start_service, tmp_path) -> None:
    torchtitan_or_skip()
    service = start_service(fragments=2, min_contributors=1)
    env = os.environ | {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    flags = [
        *("--dump-folder", str(tmp_path), "--training.steps", str(H * OUTER_STEPS)),
        *("--diloco.connection.server", f"127.0.0.1:{service.port}"),
        *("--diloco.connection.learner-id", "titan", "--diloco.connection.insecure"),
        *("--diloco.sync.sync-every-steps", str(H)),
    ]
    argv = [*launch, "--nproc-per-node", str(RANKS), "-m", "tests.support.titan_island", *flags]
    log = tmp_path / "island.log"
    with log.open("w") as out:
        code = subprocess.run(argv, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=300)
    assert code.returncode == 0, log.read_text()[-6000:]

    ranks = [json.loads((tmp_path / f"rank.{r}.json").read_text()) for r in range(RANKS)]
    assert sorted(tuple(r["slice_of"]) for r in ranks) == [(0, RANKS), (1, RANKS)]
    for rank in ranks:
        assert (rank["inner_steps"], rank["outer_steps"]) == (H * OUTER_STEPS, OUTER_STEPS)
        assert rank["tokens"] == H * OUTER_STEPS * BATCH * SEQ_LEN
        assert rank["versions"] == [OUTER_STEPS] * 2
    assert [v for _, _, v in service.aggregator.layout()] == [OUTER_STEPS] * 2
    assert service.aggregator.live_learners() == []  # the island left when training ended
    # The model torchtitan trained holds the global parameters, gathered from its shards.
    params = torch.load(tmp_path / "params.pt")
    for fid, indices, _ in service.aggregator.layout():
        for i, want in zip(indices, service.aggregator.params(fid), strict=True):
            assert torch.equal(params[i], want)


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("spmd_backend", "spmd_types"),
        ("tensor_parallel_degree", 2),
        ("pipeline_parallel_degree", 2),
    ],
)
def test_a_torchtitan_trainer_refuses_what_an_island_cannot_sync(setting, value) -> None:
    torchtitan_or_skip()
    from torchtitan.config import ParallelismConfig, TrainingConfig

    from learner.adapters.torchtitan import DilocoTrainer

    parallelism = ParallelismConfig(**({"spmd_backend": "partial_dtensor"} | {setting: value}))
    training = TrainingConfig(disable_cuda_graphs=True)  # torchtitan's own check refuses PP
    config = DilocoTrainer.Config(parallelism=parallelism, training=training)
    with pytest.raises(ValueError, match=f"parallelism.{setting} is"):
        DilocoTrainer(config)  # before torchtitan builds anything
