"""The chaos harness's checks on what the learners reported."""

import math

from deploy.chaos import version_regressions
from deploy.watch import (
    LearnerPoint,
    ServerPoint,
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
