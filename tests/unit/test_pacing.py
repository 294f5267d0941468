"""Joining in phase (quorum mode) and dynamic local updates: the server's estimates and the
learner's pace, with a fake clock."""

import pytest
import torch

from common.config import build_config
from learner.config import DilocoSyncConfig, SyncConfig
from learner.heartbeat import Pacer
from learner.progress import Progress
from learner.session import SyncSession
from learner.simulated_speed import Slowdown, StepPeriod
from learner.streaming import SyncStats
from server.aggregator import Aggregator
from server.config import aggregator_config
from server.learners import estimated_schedule_step, median_step_time_s
from server.state.params import ParamSpec
from tests.support.fakes import FakeClock

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
    agg = Aggregator(aggregator_config(mode="quorum", pull_codec="fp32"), clock=clock)
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
    config = build_config(
        DilocoSyncConfig,
        {
            "learner_id": "x",
            "insecure": True,
            "sync_every_steps": 8,
            "dynamic_local_updates": dynamic,
        },
    )
    progress = Progress(learner_id="x", inner_steps=10, compute_s=10 * my_step_s)
    s = SyncSession(config, [torch.zeros(1)], [], progress, tokens_per_step=1)
    s.pacer.median_step_time_s, s.pacer.blocking = median_s, blocking
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
    pacer = Pacer(SyncConfig(sync_every_steps=8, dynamic_local_updates=dynamic))
    pacer.median_step_time_s, pacer.blocking = median, blocking
    assert pacer.pace(Progress(learner_id="x", inner_steps=10, compute_s=10 * mine)) == pace


def test_the_server_reports_where_the_schedule_is() -> None:
    clock = FakeClock()
    agg = Aggregator(aggregator_config(mode="quorum", pull_codec="fp32"), clock=clock)
    a, b = agg.join("a", SPECS).session_id, agg.join("b", SPECS).session_id
    assert agg.schedule_estimate() == 0  # nobody reported
    clock.now = 1.0
    agg.heartbeat(a, step_time_s=0.5, schedule_step=100)
    agg.heartbeat(b, step_time_s=0.5, schedule_step=110)
    clock.now = 2.0
    assert agg.schedule_estimate() == 107  # median of 102 and 112
    assert agg.schedule_steps() == {"a": 102.0, "b": 112.0}  # each learner's: their phases
    agg.join("c", SPECS)
    assert set(agg.schedule_steps()) == {"a", "b"}  # c has not reported yet


class RecordingSync:
    """Stands in for StreamingSync: records which schedule steps the session walks."""

    def __init__(self) -> None:
        self.pushed: list[int] = []
        self.merged: list[int] = []
        self.stats = SyncStats()

    def push_phase(self, step: int, inner_step: int | None = None) -> None:
        self.pushed.append(step)

    def merge_phase(self, step: int) -> list[int]:
        self.merged.append(step)
        return []


def steered(blocking: bool = False) -> SyncSession:
    s = session(False, 0.3, 0.3, blocking)
    s.sync = RecordingSync()
    s.step = 100
    return s


def test_a_learner_behind_the_others_catches_up_one_step_at_a_time() -> None:
    s = steered()
    try:
        s.pacer.set_phase_error(cluster_step=103, my_step=100)
        for _ in range(5):
            s.after_inner_step()
        # Three inner steps advance the schedule by two (pushing sooner), then by one again.
        assert s.step == 100 + 3 * 2 + 2
        assert s.sync.pushed == list(range(101, 109))
    finally:
        s.client.close()


def test_a_learner_ahead_trains_extra_steps_without_pushing_or_waiting() -> None:
    s = steered()
    try:
        s.pacer.set_phase_error(cluster_step=97, my_step=100)
        for _ in range(4):
            s.after_inner_step()
        assert s.step == 101  # three inner steps gave a schedule step back, the fourth advanced
        assert s.sync.pushed == [101]
        assert s.sync.merged == [100, 100, 100, 101]  # arrivals still merge while it holds
    finally:
        s.client.close()


@pytest.mark.parametrize(
    ("blocking", "cluster", "mine"),
    [
        (False, 101, 100),  # within the deadband: noise, not drift
        (False, 99, 100),
        (False, 0, 100),  # the server has no reports
        (True, 130, 100),  # sync mode: rounds wait for everyone anyway
    ],
)
def test_no_steering(blocking, cluster, mine) -> None:
    s = steered(blocking)
    try:
        s.pacer.set_phase_error(cluster_step=cluster, my_step=mine)
        for _ in range(3):
            s.after_inner_step()
        assert s.step == 103
    finally:
        s.client.close()


def test_only_the_phase_is_corrected_not_whole_periods() -> None:
    s = steered()  # H = 8
    try:
        # 5 periods ahead, 3 behind
        s.pacer.set_phase_error(cluster_step=100 - 5 * 8 + 3, my_step=100)
        assert s.pacer.phase_debt == 3
        s.pacer.set_phase_error(cluster_step=100 + 7, my_step=100)  # 7 behind = 1 ahead: in phase
        assert s.pacer.phase_debt == 0
        s.pacer.set_phase_error(cluster_step=100 + 4 * 8 - 3, my_step=100)
        assert s.pacer.phase_debt == -3
    finally:
        s.client.close()


def test_slowdown_idles_in_proportion_but_does_not_stretch_a_pause() -> None:
    slow = Slowdown(8.0)
    assert slow.idle_s(0.04) == pytest.approx(7 * 0.04)  # the first step: nothing to compare
    for _ in range(10):
        assert slow.idle_s(0.05) == pytest.approx(7 * 0.05)
    assert slow.idle_s(0.12) == pytest.approx(7 * 0.12)  # a slow step (< 3x usual) counts
    # A step that held a 1-second pause (SIGSTOP) idles as for 3 usual steps, not 8 s.
    assert slow.idle_s(1.05) == pytest.approx(7 * 3 * 0.05)
    assert Slowdown(1.0).idle_s(0.5) == 0.0


def test_a_step_period_holds_the_pace_through_late_steps_but_not_through_a_pause() -> None:
    clock = StepPeriod(0.1)
    assert clock.idle_s(started=5.0, now=5.01) == pytest.approx(0.09)  # ends at 5.1
    assert clock.idle_s(started=5.1, now=5.13) == pytest.approx(0.07)  # ends at 5.2
    assert clock.idle_s(started=5.2, now=5.45) == 0.0  # ran past its tick (5.3): no idle
    assert clock.idle_s(started=5.45, now=5.47) == 0.0  # nor for the next (5.4): made up
    assert clock.idle_s(started=5.47, now=5.49) == pytest.approx(0.01)  # on the clock: 5.5
    # 0.2 s between steps (an evaluation) counts in full: the next tick moves by as much.
    assert clock.idle_s(started=5.7, now=5.72) == pytest.approx(0.08)  # ends at 5.8
    # A step 2 s late, more than 10 ticks: a pause, not made up; the clock goes on from it.
    assert clock.idle_s(started=5.8, now=7.9) == 0.0
    assert clock.idle_s(started=7.9, now=7.93) == pytest.approx(0.07)  # ends at 8.0


def test_one_learners_step_time_counts_at_most_ten_times_the_others() -> None:
    assert median_step_time_s([0.1, 3000.0]) == pytest.approx(0.55)  # 3000 counts as 1.0
    assert median_step_time_s([0.1, 0.12, 3000.0]) == pytest.approx(0.12)
    assert median_step_time_s([0.1, 0.2, 0.3, 0.4]) == pytest.approx(0.25)  # honest: as is


@pytest.mark.parametrize("in_model", [True, False])
def test_a_join_gives_the_sync_the_configured_residual_rule(monkeypatch, in_model) -> None:
    """--push-feedback-in-model (or its absence) reaches the StreamingSync a join builds."""
    from types import SimpleNamespace

    from learner.streaming import FragmentReplica

    config = build_config(
        DilocoSyncConfig,
        {"learner_id": "x", "insecure": True, "sync_every_steps": 8,
         "push_codec": "sparse_2bit", "push_feedback_in_model": in_model},
    )  # fmt: skip
    s = SyncSession(config, [torch.zeros(4)], [], Progress(learner_id="x"), tokens_per_step=1)
    replica = FragmentReplica(0, [0], [(4,)])
    replica.params, replica.version = [torch.zeros(4)], 0
    reply = SimpleNamespace(session_id=1, fragments=[], mode="sync", schedule_step=0,
                            server_epoch=1, layout="strided")  # fmt: skip
    monkeypatch.setattr(s.client, "join", lambda *args: reply)
    monkeypatch.setattr(s.client, "away", lambda: set())
    monkeypatch.setattr(s.replicas, "load", lambda *args: ([replica], set()))
    s._join()
    assert s.sync.push_feedback_in_model is in_model
    s.client.close()
