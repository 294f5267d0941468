"""The chaos harness's checks on what the learners reported."""

import math

import pytest

from deploy.chaos import parse_args
from deploy.chaos_faults import KINDS, Event
from deploy.chaos_report import Report, Run, evaluate, verdict, version_regressions
from deploy.watch import (
    LearnerPoint,
    ServerPoint,
    Watch,
    eval_points,
    merged_tokens,
    recent_eval_loss,
    round_times,
    time_reaching,
)


def test_monotonic_versions_have_no_regression() -> None:
    assert version_regressions([[0, 0], [0, 1], [1, 1], [1, 1], [3, 2]]) == 0


def test_a_version_going_back_is_counted() -> None:
    assert version_regressions([[2, 2], [3, 2], [1, 2], [3, 3]]) == 1


def server(t: float, pid: int, versions: tuple[int, ...], tokens: float) -> ServerPoint:
    return ServerPoint(t, pid, versions, (("merged_tokens", tokens),))


def test_merged_tokens_add_up_over_server_restarts() -> None:
    points = [server(1, 7, (0, 0), 0), server(2, 7, (1, 1), 60), server(3, 8, (1, 1), 0)]
    points += [server(4, 8, (2, 1), 30)]
    assert merged_tokens(points) == [(1, 0), (2, 60), (3, 60), (4, 90)]
    assert time_reaching(merged_tokens(points), 61) == 4
    assert time_reaching(merged_tokens(points), 91) == math.inf


def test_rounds_are_versions_moving_on_not_initialisation() -> None:
    points = [server(1, 7, (-1, -1), 0), server(2, 7, (0, 0), 0), server(3, 7, (1, 0), 0)]
    points += [server(4, 8, (1, 0), 0), server(5, 8, (1, 2), 0)]
    assert round_times(points) == [3, 5]


def test_each_outer_step_is_one_evaluation_with_its_last_loss() -> None:
    def learner(t: float, pid: int, outer: int, loss: float) -> LearnerPoint:
        return LearnerPoint(t, pid, outer, loss, (0, 0))

    points = [learner(0, 5, 0, math.nan), learner(1, 5, 0, 4.0), learner(2, 5, 1, 4.0)]
    # The step was counted a moment before its loss was: same evaluation, newer loss.
    points += [learner(2.1, 5, 1, 3.0), learner(3, 5, 2, 2.0), learner(4, 6, 0, 2.5)]
    assert eval_points(points) == [(1, 4.0), (2, 3.0), (3, 2.0), (4, 2.5)]
    assert recent_eval_loss(points) == (3.0 + 2.0 + 2.5) / 3
    assert recent_eval_loss(points, before=2) == (4.0 + 3.0) / 2


# -- the report and its verdict ---------------------------------------------------------------


def passing_report(**changes: object) -> Report:
    report = Report(
        faults_by_kind={kind: 3 for kind in KINDS},
        invariants_ok=True,
        final_eval_loss=2.0,
        fault_free_eval_loss=2.0,
        loss_gap=0.0,
    )
    for key, value in changes.items():
        setattr(report, key, value)
    return report


def test_a_clean_run_passes() -> None:
    assert verdict(passing_report(), min_faults=12, max_loss_gap=0.03) == []


def test_each_broken_invariant_is_named() -> None:
    report = passing_report(
        version_regressions=2, dead_processes=["learner-1"], faults_without_progress=1
    )
    failures = verdict(report)
    assert len(failures) == 3
    assert "2 fragment versions went backwards" in failures[0]
    assert "learner-1" in failures[1]
    assert "1 faults not followed by a round" in failures[2]


def test_a_run_ended_early_fails() -> None:
    failures = verdict(passing_report(aborted="server_kill 0: server exited with 1"))
    assert failures == ["ended early: server_kill 0: server exited with 1"]


def test_every_kind_and_enough_faults_are_required_when_faults_are_asked_for() -> None:
    report = passing_report(faults_by_kind={"learner_kill": 5, "net_cut": 4})
    failures = verdict(report, min_faults=10)
    assert failures == [
        "faults never injected: learner_stall, server_kill",
        "9 faults injected, fewer than 10",
    ]
    # A timed run (no count asked for) that fitted only some kinds breaks nothing.
    assert verdict(report) == []


def test_the_loss_gap_is_judged_both_ways_and_only_when_asked() -> None:
    worse, better = passing_report(loss_gap=0.031), passing_report(loss_gap=-0.031)
    assert verdict(worse) == [] and verdict(better) == []
    assert len(verdict(worse, max_loss_gap=0.03)) == 1
    assert len(verdict(better, max_loss_gap=0.03)) == 1
    assert verdict(passing_report(loss_gap=0.029), max_loss_gap=0.03) == []
    assert len(verdict(passing_report(loss_gap=math.nan), max_loss_gap=0.03)) == 1


def fake_run(duration_s: float, events: list[Event], tokens: list[float], losses: list) -> Run:
    watch = Watch(dict, lambda: 0.0)
    # One server process whose fragments move on once a second, merging `tokens` so far.
    watch.servers = {"server": [server(t, 7, (t, t), total) for t, total in enumerate(tokens)]}
    points = [LearnerPoint(t, 5, step, loss, (0, 0)) for step, (t, loss) in enumerate(losses)]
    watch.learners = {"learner-0": points}
    return Run(events, [], watch, fragments=2, duration_s=duration_s)


def test_evaluate_compares_losses_at_equal_tokens_and_rates_faults() -> None:
    events = [
        Event(0.5, "server_kill", "server", "start"),
        Event(1.5, "server_kill", "server", "end"),
    ]
    # The run with faults merged 40 tokens (20 per fragment) and ended at loss 3.0; the
    # fault-free run had 40 at t = 2, when its recent loss was (4.0 + 2.5) / 2, and ended
    # at (4.0 + 2.5 + 1.0) / 3.
    faulty = fake_run(30.0, events, [0, 20, 40], [(1, 4.0), (2, 3.0), (2.5, 3.0)])
    fault_free = fake_run(30.0, [], [0, 20, 40, 80], [(1, 4.0), (2, 2.5), (3, 1.0)])
    report = evaluate(faulty, fault_free)
    assert report.faults_by_kind == {"server_kill": 1}
    assert report.fault_s_by_kind == {"server_kill": 1.0}
    assert report.faults_per_min == 2.0
    assert report.useful_tokens == 20 and report.capacity_tokens == 40
    assert report.final_eval_loss == (4.0 + 3.0 + 3.0) / 3
    assert report.fault_free_eval_loss == (4.0 + 2.5) / 2
    assert report.fault_free_final_eval_loss == (4.0 + 2.5 + 1.0) / 3
    assert math.isclose(report.loss_gap, (10 / 3) / 2.5 - 1)
    assert math.isclose(report.loss_gap_equal_tokens, (10 / 3) / 3.25 - 1)
    assert report.invariants_ok


def test_presets_fill_only_what_the_command_line_left_out() -> None:
    soak = parse_args(["--soak", "--faults", "30"])
    assert soak.faults == 30 and soak.fault_every_s == 0.5 and soak.max_loss_gap == 0.03
    assert soak.fault_length_s == [0.2, 1.0] and soak.report.name == "chaos_soak.json"
    assert soak.quiet_tail_s == 60.0
    plain = parse_args([])
    assert plain.duration_s == 600.0 and plain.faults == 0 and plain.max_loss_gap is None
    assert plain.report is None
    assert plain.learner_nice == 10 and parse_args(["--learner-nice", "0"]).learner_nice == 0


@pytest.mark.parametrize(
    "argv",
    [
        ["--fault-length-s", "2", "1"],
        ["--fault-length-s", "0", "1"],
        ["--faults", "-1"],
        ["--quiet-tail-s", "-1"],
        ["--max-loss-gap", "0"],
        ["--quick", "--soak"],
        ["--learner-nice", "-1"],
        ["--learner-nice", "20"],
    ],
)
def test_bad_schedules_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(argv)
