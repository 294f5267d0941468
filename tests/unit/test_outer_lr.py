"""The outer lr that follows a power of the learners' cosine inner lr (server/outer_lr.py)."""

import pytest
import torch

from common.lr_schedule import LrSchedule
from server.config import aggregator_config
from server.outer import NesterovOuter, snapshot_settings
from server.outer_lr import outer_lr_factor
from server.rounds import round_policy


def test_a_constant_schedule_keeps_the_outer_lr() -> None:
    assert {outer_lr_factor("constant", 0, 0.25, n) for n in range(50)} == {1.0}


def test_the_outer_lr_holds_through_the_warm_up_then_follows_the_cosine_to_its_power() -> None:
    rounds = 200  # the learners' 5% warm-up: 10 outer steps
    rising = [outer_lr_factor("cosine", rounds, -0.25, n) for n in range(rounds + 20)]
    decaying = [outer_lr_factor("cosine", rounds, 1.0, n) for n in range(rounds + 20)]
    assert rising[:10] == decaying[:10] == [1.0] * 10
    after = rising[10:rounds]
    assert all(a <= b for a, b in zip(after, after[1:], strict=False)) and after[-1] > 1.7
    # From the end of the learners' decay on, their floor (10%) to the power.
    assert rising[rounds - 1 :] == pytest.approx([0.1**-0.25] * 21)
    assert decaying[rounds - 1 :] == pytest.approx([0.1] * 21)
    # The factor is the learners' own cosine factor at that outer step, to the power.
    inner = LrSchedule("cosine", steps=rounds)
    assert rising[100] == pytest.approx(inner.factor(101) ** -0.25)
    assert decaying[100] == pytest.approx(inner.factor(101))
    assert outer_lr_factor("cosine", rounds, 0.0, 150) == 1.0


def test_the_nesterov_step_takes_the_scheduled_lr_at_each_outer_step() -> None:
    """With no momentum each step moves the parameters by -lr·factor·g exactly."""
    outer = NesterovOuter(
        2.0, 0.0, lr_schedule="cosine", lr_schedule_rounds=20, lr_schedule_power=-0.25
    )
    param, grad = torch.zeros(3), torch.ones(3)
    moved = []
    for _ in range(25):
        before = param.clone()
        outer.step([param], [grad])
        moved.append(float((before - param)[0]))
    expected = [2.0 * outer_lr_factor("cosine", 20, -0.25, n) for n in range(25)]
    assert moved == pytest.approx(expected, rel=1e-6)
    assert moved[0] == 2.0 and moved[-1] == pytest.approx(2.0 * 0.1**-0.25, rel=1e-6)


def test_a_restored_optimizer_keeps_the_configs_schedule_and_export_replays_the_recorded() -> None:
    saved = NesterovOuter(3.0, 0.0, lr_schedule="cosine", lr_schedule_rounds=40)
    saved.steps_taken = 30
    restored = NesterovOuter(3.0, 0.0)  # a server started without the schedule
    restored.restore(dict(vars(saved)), version=30)
    assert (restored.lr_schedule, restored.steps_taken) == ("constant", 30)
    settings = snapshot_settings(dict(vars(saved)))
    assert settings["outer_lr_schedule"] == "cosine"
    assert settings["outer_lr_schedule_rounds"] == 40
    assert aggregator_config(**settings).outer.outer_lr_schedule_rounds == 40


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"outer_lr_schedule": "inverse"}, "outer_lr_schedule must be one of"),
        ({"outer_lr_schedule": "cosine"}, "outer_lr_schedule_rounds must be >= 1"),
        (
            {"outer_lr_schedule": "constant", "outer_lr_schedule_power": 2.0},
            "outer_lr_schedule_power must be in",
        ),
        (
            {
                "outer_lr_schedule": "cosine",
                "outer_lr_schedule_rounds": 100,
                "mode": "async",
                "outer_momentum_warmup_rounds": 0,
            },
            "outer_lr_schedule is for sync and quorum modes",
        ),
    ],
)
def test_bad_schedule_settings_name_what_to_fix(settings: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        aggregator_config(**settings)


@pytest.mark.parametrize("mode", ["sync", "quorum"])
def test_the_servers_outer_optimizer_follows_the_configured_schedule(mode: str) -> None:
    config = aggregator_config(
        mode=mode,
        outer_lr_schedule="cosine",
        outer_lr_schedule_rounds=100,
        outer_lr_schedule_power=-0.25,
    )
    outer = round_policy(config.rounds, config.outer, lambda: 0.0).new_outer()
    assert (outer.lr_schedule, outer.lr_schedule_rounds, outer.lr_schedule_power) == (
        "cosine",
        100,
        -0.25,
    )
    outer.steps_taken = 99  # the learners' last decay step: their floor, 0.1
    assert outer.current_lr() == pytest.approx(config.outer.outer_lr * 0.1**-0.25)
