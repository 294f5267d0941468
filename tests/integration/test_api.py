"""The library API (learner/api.py): a model that is not ours, trained in the user's own loop."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import torch
from torch import nn

from learner.api import DilocoSync
from tests.support.processes import REPO

H = 4
OUTER_STEPS = 5


class MLP(nn.Module):
    """Two blocks (`layers.0.`, `layers.1.`), so the server can split it into 2 fragments."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(2))
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def train(port: int, name: str, seed: int, results: dict) -> None:
    torch.manual_seed(seed)  # different initial models: the server's copy must win
    model = MLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    target = torch.linspace(-1, 1, 8)  # a fixed linear target, the same for both learners
    data = torch.Generator().manual_seed(100 + seed)  # each its own samples
    losses, merges = [], 0
    settings = {"server": f"127.0.0.1:{port}", "learner_id": name, "insecure": True}
    settings |= {"sync_every_steps": H, "overlap_steps": 1, "push_codec": "fp4_e2m1"}
    with DilocoSync(model, tokens_per_step=32, **settings) as sync:
        while sync.outer_steps < OUTER_STEPS:
            x = torch.randn(32, 8, generator=data)
            loss = nn.functional.mse_loss(model(x).squeeze(1), x @ target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            merges += sync.step(loss=loss.item())
            losses.append(loss.item())
        registry = sync.metrics_registry()  # what a library user serves with serve_metrics
        metrics = {
            m: registry.get_sample_value(f"diloco_learner_{m}_total")
            for m in ("inner_steps", "outer_steps", "tokens", "fragment_syncs")
        }
    results[name] = (sync.progress, model, losses, merges, metrics)


def test_two_user_loops_train_a_foreign_model_in_sync(start_service):
    service = start_service(lease_s=10.0, min_contributors=2, fragments=2, pull_codec="fp4_e2m1")
    results: dict = {}
    threads = [
        threading.Thread(target=train, args=(service.port, name, seed, results))
        for name, seed in (("a", 1), ("b", 2))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert set(results) == {"a", "b"}  # both loops finished (a thread's error shows above)
    agg = service.aggregator
    server_params: dict[int, torch.Tensor] = {}
    for fid, indices, version in agg.layout():
        assert version == OUTER_STEPS
        server_params.update(zip(indices, agg.params(fid), strict=True))
    assert len(server_params) == 6 and len(agg.layout()) == 2
    for name, (progress, model, losses, merges, metrics) in results.items():
        assert progress.inner_steps == OUTER_STEPS * H
        assert metrics["inner_steps"] == OUTER_STEPS * H
        assert metrics["outer_steps"] == OUTER_STEPS
        assert metrics["tokens"] == progress.tokens and metrics["fragment_syncs"] > 0
        assert progress.fragment_syncs == 2 * OUTER_STEPS and merges > 0
        assert progress.tokens == 32 * OUTER_STEPS * H
        for i, p in enumerate(model.parameters()):
            assert torch.equal(p.detach(), server_params[i]), f"learner {name} param {i}"
        assert sum(losses[-H:]) < sum(losses[:H])  # it learnt something


def test_unknown_settings_and_misuse_fail_in_one_sentence():
    with pytest.raises(ValueError, match="unknown setting 'batch_size' for DilocoSync"):
        DilocoSync(MLP(), server="127.0.0.1:1", batch_size=4)
    with pytest.raises(ValueError, match="tokens_per_step must be >= 1"):
        DilocoSync(MLP(), server="127.0.0.1:1", insecure=True, tokens_per_step=0)
    sync = DilocoSync(MLP(), server="127.0.0.1:1", insecure=True)
    with pytest.raises(RuntimeError, match="before open"):
        sync.step()
    sync.close()


def test_the_gpt2_example_without_transformers_says_how_to_install_it():
    hide = "import sys, runpy; sys.modules['transformers'] = None; "
    run = "runpy.run_module('learner.examples.hf_gpt2', run_name='__main__')"
    result = subprocess.run(
        [sys.executable, "-c", hide + run], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "hf_gpt2: needs Hugging Face transformers: pip install 'decoupled-diloco[hf]'"
    ]
