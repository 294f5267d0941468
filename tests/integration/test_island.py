"""A 2-rank island (torchrun, DDP over gloo) next to a 1-rank learner, against one server."""

from __future__ import annotations

import json
import os
import sys

import torch

from deploy.launcher import start_daemon
from tests.support.processes import TINY_LEARNER_FLAGS, learner_log

OUTER_STEPS = 3
TOKENS_PER_RANK_STEP = 4 * 32  # batch size x block size in TINY_LEARNER_FLAGS


def test_a_two_rank_island_acts_as_one_learner(start_service, start_learner, tmp_path):
    # sync mode and K = 2: every round needs both the island and the single learner.
    service = start_service(lease_s=10.0, min_contributors=2)
    corpus = tmp_path / "corpus"  # small: three processes load it at once on a shared CPU
    corpus.mkdir()
    for i in range(60):
        (corpus / f"doc{i}.txt").write_text(" ".join(f"word{(i * j) % 97}" for j in range(400)))
    outputs = {
        name: ["--corpus", str(corpus), "--summary-file", str(tmp_path / f"{name}.json")]
        for name in ("i", "s")
    }
    outputs["i"] += ["--save-params", str(tmp_path / "island.pt")]
    env = os.environ | {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}  # loopback only
    island = start_daemon(
        "island",
        [
            *(sys.executable, "-m", "torch.distributed.run", "--standalone"),
            *("--nproc-per-node", "2", "-m", "learner.main"),
            *("--server", f"127.0.0.1:{service.port}", "--learner-id", "island"),
            *TINY_LEARNER_FLAGS,
            *("--max-outer-steps", str(OUTER_STEPS), *outputs["i"]),
        ],
        tmp_path / "island.log",
        env=env,
    )
    try:
        single = start_learner(
            service.port, "single", "--max-outer-steps", str(OUTER_STEPS), *outputs["s"]
        )
        assert island.wait(120) == 0, learner_log(tmp_path, "island")
        assert single.wait(timeout=60) == 0, learner_log(tmp_path, "single")
    finally:
        island.kill()
    island_log = learner_log(tmp_path, "island")
    assert island_log.count("learner=island joined") == 1  # one session for the two ranks
    ((fid, indices, version),) = service.aggregator.layout()
    assert version == OUTER_STEPS  # every round closed with both learners' pushes
    summary = json.loads((tmp_path / "i.json").read_text())
    assert summary["island_size"] == 2 and summary["outer_steps"] == OUTER_STEPS
    assert summary["tokens"] == summary["inner_steps"] * 2 * TOKENS_PER_RANK_STEP
    c0, c1 = summary["rank_params_crc32"]
    assert c0 == c1  # both ranks end with the same parameters
    assert summary["eval_losses"][-1] < summary["eval_losses"][0]
    single_summary = json.loads((tmp_path / "s.json").read_text())
    assert single_summary["versions"] == summary["versions"] == [OUTER_STEPS]
    saved = list(torch.load(tmp_path / "island.pt").values())
    for got, want in zip(saved, service.aggregator.params(fid), strict=True):
        assert torch.equal(got, want)  # the island's parameters are the server's, bit for bit
