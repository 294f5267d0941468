"""common/lr_schedule.py: the inner learning rate's factor per step, and its settings' errors."""

from __future__ import annotations

import pytest

from common.lr_schedule import LrSchedule


def test_a_constant_schedule_keeps_the_full_rate() -> None:
    assert {LrSchedule().factor(s) for s in (1, 100, 10**6)} == {1.0}


def test_cosine_warms_up_decays_and_then_holds_its_floor() -> None:
    cosine = LrSchedule("cosine", steps=100, warmup_fraction=0.1, min_lr_ratio=0.2)
    assert cosine.factor(1) == pytest.approx(0.1)  # linear warm-up over 10 steps
    assert cosine.factor(10) == pytest.approx(1.0)
    assert cosine.factor(55) == pytest.approx(0.6)  # halfway down: 0.2 + 0.8 / 2
    assert cosine.factor(100) == pytest.approx(0.2)
    assert cosine.factor(5000) == pytest.approx(0.2)  # past the planned steps: the floor
    no_warmup = LrSchedule("cosine", steps=100, warmup_fraction=0.0)
    assert no_warmup.factor(1) == 1.0


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"kind": "linear"}, "lr_schedule must be one of constant, cosine, got 'linear'"),
        ({"kind": "cosine"}, "lr_schedule_steps must be >= 1 with a cosine schedule"),
        ({"warmup_fraction": 1.0}, "lr_warmup_fraction must be in [0, 1), got 1.0"),
        ({"min_lr_ratio": -0.1}, "lr_min_ratio must be in [0, 1], got -0.1"),
    ],
)
def test_bad_settings_name_what_to_fix(kw: dict, message: str) -> None:
    with pytest.raises(ValueError) as err:
        LrSchedule(**kw)
    assert str(err.value).startswith(message)
