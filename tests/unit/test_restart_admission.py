"""What decides admission survives a restart on the same state dir: the norm guard's recent
norms and each learner's last weight (the weight cap's reference). Without them the first
pushes after a restart would go unguarded and uncapped."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.errors import FailedPrecondition
from server.aggregator import Aggregator
from server.config import aggregator_config
from server.state.params import ParamSpec

SPECS = [ParamSpec("w", (40,), "float32")]
# Sync mode needs every live learner each round; the guard refuses 10x the recent median.
CONFIG = {"pull_codec": "fp32", "max_norm_ratio": 10.0, "snapshot_every_versions": 3}


def start(state_dir: Path, **overrides) -> Aggregator:
    return Aggregator(aggregator_config(state_dir=str(state_dir), **(CONFIG | overrides)))


def stop(agg: Aggregator) -> None:
    """As if killed: nothing more is written, and the dir is free."""
    assert agg.wait_for_snapshot(timeout_s=30)
    with agg._cond:
        agg._store.close()


def delta(seed: int, scale: float = 0.01) -> list[torch.Tensor]:
    return [torch.randn(40, generator=torch.Generator().manual_seed(seed)) * scale]


def push_rounds(agg: Aggregator, session: str, seeds: range, tokens: int = 64) -> None:
    for seed in seeds:
        version = agg.push(session, 0, agg.version(0), delta(seed), tokens, inner_steps=4)
        assert agg.wait_for_version(0, version, timeout_s=30) == version


@pytest.mark.parametrize("rounds", [5, 6], ids=["records-after-a-snapshot", "a-snapshot-alone"])
def test_the_norm_guard_refuses_an_outsized_push_right_after_a_restart(tmp_path, rounds) -> None:
    agg = start(tmp_path)
    session = agg.join("l0", SPECS).session_id
    agg.initialize(session, 0, [torch.ones(40)])
    push_rounds(agg, session, range(rounds))
    stop(agg)
    restarted = start(tmp_path)
    session = restarted.join("l0", SPECS).session_id
    version = restarted.version(0)
    assert version == rounds
    with pytest.raises(FailedPrecondition, match="recent median"):
        restarted.push(session, 0, version, delta(99, scale=1.0), tokens=64, inner_steps=4)
    # A fresh state dir with the same pushes has no window yet: the same push goes through.
    fresh = start(tmp_path / "fresh")
    s = fresh.join("l0", SPECS).session_id
    fresh.initialize(s, 0, [torch.ones(40)])
    assert fresh.push(s, 0, 0, delta(99, scale=1.0), tokens=64, inner_steps=4) == 1


def test_the_weight_cap_holds_against_a_large_claim_right_after_a_restart(tmp_path) -> None:
    """Two learners push with equal claims, the server restarts, the honest one rejoins
    (and has not pushed since) and the other claims 100x: capped at max_weight_ratio x the
    honest one's last weight, as before the restart."""
    agg = start(tmp_path, weighting="tokens", max_weight_ratio=4.0)
    a, b = (agg.join(name, SPECS).session_id for name in ("honest", "liar"))
    agg.initialize(a, 0, [torch.ones(40)])
    for seed in range(2):
        base = agg.version(0)
        agg.push(b, 0, base, delta(100 + seed), tokens=64, inner_steps=4)
        version = agg.push(a, 0, base, delta(seed), tokens=64, inner_steps=4)
        assert agg.wait_for_version(0, version, timeout_s=30) == version
    stop(agg)
    restarted = start(tmp_path, weighting="tokens", max_weight_ratio=4.0)
    a, b = (restarted.join(name, SPECS).session_id for name in ("honest", "liar"))
    restarted.push(b, 0, restarted.version(0), delta(7), tokens=6400, inner_steps=4)
    liar = restarted._learners.get("liar")
    assert liar.last_weight == pytest.approx(4.0 * 64)  # claimed 6400
    assert restarted._learners.get("honest").last_weight == pytest.approx(64)
