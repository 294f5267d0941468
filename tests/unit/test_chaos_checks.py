"""The chaos harness's log checks."""

from deploy.chaos import version_regressions


def line(versions: list[int]) -> str:
    return f"x outer_step=1 versions={versions} eval_loss=2.5 train_loss=2.4\n"


def test_monotonic_versions_have_no_regression() -> None:
    text = "".join(line(v) for v in ([0, 0], [0, 1], [1, 1], [1, 1], [3, 2]))
    assert version_regressions(text) == 0


def test_a_version_going_back_is_counted() -> None:
    text = "".join(line(v) for v in ([2, 2], [3, 2], [1, 2], [3, 3]))
    assert version_regressions(text) == 1
