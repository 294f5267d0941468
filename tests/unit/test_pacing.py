"""Joining in phase (quorum mode) and dynamic local updates: the server's estimates and the
learner's pace, with a fake clock."""

import pytest
import torch

from learner.config import LearnerConfig
from learner.session import SyncSession
from learner.trainer import Progress
from server.aggregator import Aggregator, AggregatorConfig, ParamSpec
from server.policy import estimated_schedule_step, median_step_time_s
from tests.fakes import FakeClock

SPECS = [ParamSpec("w", (4,), "float32")]


def test_median_step_time_ignores_missing_reports() -> None:
    assert median_step_time_s([0.0, 0.2, 0.4, 0.3]) == pytest.approx(0.3)
    assert median_step_time_s([0.0]) == 0.0


def test_schedule_estimate_moves_reports_on_by_the_time_since() -> None:
    # Reported steps 100 at t=10 and 120 at t=14; now t=16 at 0.5 s per step.
    # 100 + 6 s / 0.5 s = 112 and 120 + 2 s / 0.5 s = 124: the median.
    assert estimated_schedule_step([(100, 10.0), (120, 14.0)], 16.0, 0.5) == 118
    assert estimated_schedule_step([(0, 0.0)], 5.0, 0.5) == 0  # nothing reported
    assert estimated_schedule_step([(40, 1.0)], 9.0, 0.0) == 40  # no step times: as reported


def test_a_joining_learner_is_told_where_the_others_are() -> None:
    clock = FakeClock()
    agg = Aggregator(AggregatorConfig(mode="quorum", pull_codec="fp32"), clock=clock)
    a = agg.join("a", SPECS).session_id
    assert agg.join("b", SPECS).schedule_step == 0  # a has not reported yet
    agg.initialize(a, 0, [torch.zeros(4)])
    clock.now = 10.0
    agg.heartbeat(a, step=30, step_time_s=0.25, schedule_step=500)
    clock.now = 12.0
    joined = agg.join("c", SPECS)
    assert joined.schedule_step == 508  # 500 + 2 s / 0.25 s
    assert agg.median_step_time_s() == pytest.approx(0.25)


def session(dynamic: bool, my_step_s: float, median_s: float, blocking: bool = False):
    config = LearnerConfig(
        learner_id="x", insecure=True, sync_every_steps=8, dynamic_local_updates=dynamic
    )
    progress = Progress(learner_id="x", inner_steps=10, compute_s=10 * my_step_s)
    s = SyncSession(config, [torch.zeros(1)], [], progress, tokens_per_step=1)
    s.median_step_time_s, s.blocking = median_s, blocking
    return s


@pytest.mark.parametrize(
    ("dynamic", "mine", "median", "blocking", "pace"),
    [
        (True, 0.6, 0.3, False, 2),  # twice as slow: two schedule steps per inner step
        (True, 0.3, 0.3, False, 1),
        (True, 0.2, 0.4, False, 1),  # faster than the median: never below 1
        (True, 9.0, 0.3, False, 8),  # capped at H
        (True, 0.6, 0.0, False, 1),  # no reports yet
        (True, 0.6, 0.3, True, 1),  # sync mode: every learner keeps the same schedule
        (False, 0.6, 0.3, False, 1),  # off
    ],
)
def test_pace(dynamic, mine, median, blocking, pace) -> None:
    s = session(dynamic, mine, median, blocking)
    try:
        assert s.pace() == pace
    finally:
        s.client.close()
