"""diloco-export on a real run's state dir: the exported file loads into a fresh model of the
learners' kind with exactly the server's parameters, after a clean stop and after a crash
(the log replayed), as safetensors and as a torch state dict; and a learner started from it
(--init-params) carries the trained model over to a new server."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from learner.data import BatchSampler, load_corpus
from learner.model import GPT, GPTConfig
from server.aggregator import Aggregator
from server.config import aggregator_config
from server.state.params import ParamSpec
from tests.support.processes import REPO, learner_log

EXPORT = [sys.executable, "-m", "server.export"]  # what the diloco-export console script runs
OUTER_STEPS = 3
# The learners' model and eval set: TINY_LEARNER_FLAGS (tests/support/processes.py) with
# two blocks, one per fragment.
MODEL = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32)
EVAL_BATCHES, BATCH_SIZE, CORPUS_MAX_BYTES = 2, 4, 300_000


def export(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*EXPORT, *args], cwd=REPO, capture_output=True, text=True, timeout=120)


def fresh_model(params: dict[str, torch.Tensor]) -> GPT:
    """A new GPT holding `params`. The export holds each parameter once, under its
    named_parameters() name; head.weight is tok_emb.weight (tied), so it is added back for
    the strict load."""
    model = GPT(MODEL)
    model.load_state_dict({**params, "head.weight": params["tok_emb.weight"]}, strict=True)
    return model


def eval_loss(model: GPT) -> float:
    """The mean loss on the learners' eval set (learner/trainer.py builds it the same way)."""
    _, val = load_corpus("stdlib", CORPUS_MAX_BYTES)
    sampler = BatchSampler(val, BATCH_SIZE, MODEL.block_size, seed=1234)
    model.eval()
    with torch.no_grad():
        losses = [model(*sampler.next())[1].item() for _ in range(EVAL_BATCHES)]
    return sum(losses) / len(losses)


@pytest.mark.slow
def test_exported_model_is_the_servers(start_service, start_learner, tmp_path: Path) -> None:
    state = tmp_path / "state"
    service = start_service(lease_s=10.0, min_contributors=2, fragments=2, state_dir=str(state))
    procs = {
        name: start_learner(
            service.port,
            name,
            "--n-layer",
            "2",
            "--max-outer-steps",
            str(OUTER_STEPS),
            "--summary-file",
            str(tmp_path / f"{name}.json"),
        )
        for name in ("a", "b")
    }
    for name, proc in procs.items():
        assert proc.wait(timeout=180) == 0, learner_log(tmp_path, name)
    agg = service.aggregator
    names = [name for name, _ in GPT(MODEL).named_parameters()]  # the fingerprint's order
    server_params: dict[str, torch.Tensor] = {}
    for fid, indices, version in agg.layout():
        assert version == OUTER_STEPS
        server_params.update(zip((names[i] for i in indices), agg.params(fid), strict=True))
    # A copy as a crash would leave it: the log holds the rounds since the last snapshot.
    crashed = tmp_path / "crashed"
    shutil.copytree(state, crashed)
    assert max(crashed.glob("updates-*.log")).stat().st_size > 0
    service.stop(grace_s=0)  # a clean stop: a snapshot, and an empty log after it
    assert max(state.glob("updates-*.log")).stat().st_size == 0

    server_loss = eval_loss(fresh_model(server_params))
    summary = json.loads((tmp_path / "a.json").read_text())
    assert server_loss < summary["eval_losses"][0]  # trained: below the initial model's loss
    for state_dir in (state, crashed):
        out = tmp_path / f"{state_dir.name}.safetensors"
        result = export("--state-dir", str(state_dir), "--out", str(out))
        assert result.returncode == 0, result.stderr
        exported = load_file(out)
        assert sorted(exported) == sorted(names)  # safetensors keeps its own order
        for name in names:
            assert torch.equal(exported[name], server_params[name]), name
        assert eval_loss(fresh_model(exported)) == server_loss
        with safe_open(out, "pt") as f:
            versions = json.loads(f.metadata()["diloco_fragment_versions"])
        assert versions == [[OUTER_STEPS, OUTER_STEPS]]

    out = tmp_path / "model.pt"
    assert export("--state-dir", str(crashed), "--out", str(out)).returncode == 0
    state_dict = torch.load(out, weights_only=True)
    assert list(state_dict) == names
    assert all(torch.equal(state_dict[n], server_params[n]) for n in names)
    assert eval_loss(fresh_model(state_dict)) == server_loss

    # Carried over to a new server (docs/deploy.md, changing the shard count): a learner that
    # starts from the export is the first to join, so it hands the new server the trained
    # parameters, and its first evaluation (of the global parameters) is the trained loss.
    carried = start_service(min_contributors=1, fragments=2, state_dir=str(tmp_path / "new"))
    init = ["--init-params", str(tmp_path / "state.safetensors")]
    summary_c = tmp_path / "c.json"
    proc = start_learner(
        carried.port, "c", "--n-layer", "2", "--max-outer-steps", "1", *init,
        "--summary-file", str(summary_c),
    )  # fmt: skip
    assert proc.wait(timeout=180) == 0, learner_log(tmp_path, "c")
    first_loss = json.loads(summary_c.read_text())["eval_losses"][0]
    assert first_loss == pytest.approx(server_loss, rel=1e-5)  # torch's threads may differ
    assert first_loss < summary["eval_losses"][0]


def joined_only(state_dir: Path) -> Path:
    """A state dir whose server stopped after a learner joined, before it handed the
    initial parameters over: a snapshot without parameters."""
    agg = Aggregator(aggregator_config(state_dir=str(state_dir)))
    agg.join("a", [ParamSpec("w", (4,), "float32")])
    agg.checkpoint()
    return state_dir


@pytest.mark.parametrize(
    "make, out, message",
    [
        (lambda d: d / "missing", "m.pt", "does not exist or is not a directory"),
        (lambda d: d, "m.pt", "is empty: no server has written to it"),
        (joined_only, "m.safetensors", "has no parameters yet"),
        (lambda d: d, "no/such/dir/m.pt", "no/such/dir is not a writable directory"),
        (lambda d: d, "m.bin", "cannot tell the format of"),
    ],
    ids=["missing-dir", "empty-dir", "no-parameters", "unwritable-out", "unknown-suffix"],
)
def test_errors_are_one_line(tmp_path: Path, make, out: str, message: str) -> None:
    result = export("--state-dir", str(make(tmp_path)), "--out", str(tmp_path / out))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]  # after the restore's log line, if any
    assert last.startswith("diloco-export: error: ") and message in last, result.stderr
