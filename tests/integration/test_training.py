"""End to end: an in-process server on port 0 and real learner processes training."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import torch

from tests.integration.conftest import learner_log

OUTER_STEPS = 4


def test_two_learners_end_bit_identical_to_the_server(start_service, start_learner, tmp_path):
    service = start_service(lease_s=10.0, min_contributors=2)
    procs = {
        name: start_learner(
            service.port,
            name,
            "--max-outer-steps",
            str(OUTER_STEPS),
            "--save-params",
            str(tmp_path / f"{name}.pt"),
            "--summary-file",
            str(tmp_path / f"{name}.json"),
        )
        for name in ("a", "b")
    }
    for name, proc in procs.items():
        assert proc.wait(timeout=180) == 0, learner_log(tmp_path, name)
    agg = service.aggregator
    assert agg.version(0) == OUTER_STEPS
    server_params = agg.params(0)
    for name in procs:
        saved = torch.load(tmp_path / f"{name}.pt")
        assert len(saved) == len(server_params)
        for got, want in zip(saved.values(), server_params, strict=True):
            assert torch.equal(got, want), f"learner {name} differs from the server"
        summary = json.loads(Path(tmp_path / f"{name}.json").read_text())
        assert summary["outer_steps"] == OUTER_STEPS
        assert summary["version"] == OUTER_STEPS
        assert summary["bytes_sent"] > 0 and summary["bytes_received"] > 0
        assert len(summary["eval_losses"]) == OUTER_STEPS + 1
        assert summary["eval_losses"][-1] < summary["eval_losses"][0]


def test_a_killed_learner_does_not_stall_the_other(start_service, start_learner, tmp_path):
    service = start_service(lease_s=1.5)
    agg = service.aggregator
    survivor = start_learner(service.port, "survivor", "--max-outer-steps", "1000")
    victim = start_learner(service.port, "victim", "--max-outer-steps", "1000")
    # Both must have taken part in a round before the kill, so the kill really interrupts.
    assert agg.wait_for_version(0, 3, timeout_s=120) >= 3, learner_log(tmp_path, "victim")
    assert "victim" in agg.live_learners()
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=10)
    at_kill = agg.version(0)
    # Rounds go on once the victim's lease (1.5 s) expires.
    assert agg.wait_for_version(0, at_kill + 3, timeout_s=60) >= at_kill + 3
    assert agg.live_learners() == ["survivor"]
    # SIGTERM stops the survivor gracefully: it leaves the run and exits 0.
    survivor.send_signal(signal.SIGTERM)
    assert survivor.wait(timeout=60) == 0, learner_log(tmp_path, "survivor")
    assert agg.live_learners() == []
