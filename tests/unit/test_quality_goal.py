"""bench/quality_goal.py: the goal's terms over seeds at a step count, from cached runs only."""

from __future__ import annotations

import json
import sys

import pytest

from bench import quality_goal
from bench.quality_goal import judge
from bench.quality_runs import Row, cache_key

TOKENS_PER_STEP = 16 * 4 * 128  # Setup's batch_size * learners * block_size


def cached(
    stored: dict, row: Row, losses: dict[int, float], bytes_per_step: float, **setup_kw
) -> None:
    """Put a run of `row` in `stored`: eval loss `losses[step]` at each of those steps."""
    curve = [(0, 5.0)] + [(s * TOKENS_PER_STEP, loss) for s, loss in sorted(losses.items())]
    result = {"variant": {}, "eval_loss": curve[-1][1], "curve": curve,
              "bytes_per_learner": int(bytes_per_step * row.steps)}  # fmt: skip
    stored[cache_key(row.setup(**setup_kw), row.variant())] = result


def test_each_seed_is_read_from_its_shortest_run_that_reaches_the_step() -> None:
    stored: dict = {}
    for seed, dp_loss in ((0, 1.0), (1, 2.0)):
        cached(stored, Row("dp", lr=2e-3, steps=5000, seed=seed), {5000: dp_loss}, 1000.0)
    # seed 0 from a longer run's curve (and a shorter run that does not reach 5,000 steps)
    cached(stored, Row("fp4", h=100, lr=2e-3, steps=3000, seed=0), {3000: 9.0}, 1.0)
    cached(stored, Row("fp4", h=100, lr=2e-3, steps=10000, seed=0), {5000: 1.02, 10000: 0.9}, 1.0)
    cached(stored, Row("fp4", h=100, lr=2e-3, steps=5000, seed=1), {5000: 2.0}, 1.0)
    cached(stored, Row("fp4", h=100, lr=2e-3, steps=20000, seed=1), {5000: 7.0}, 1.0)
    entries, missing = judge(stored, [Row("fp4", h=100, lr=2e-3)], [2e-3], [0, 1], 5000)
    assert missing == []
    (fp4,) = entries
    assert fp4["eval_losses"] == [1.02, 2.0] and fp4["gaps"] == pytest.approx([0.02, 0.0])
    assert fp4["gap_vs_dp"] == pytest.approx(0.01)
    assert fp4["gap_std"] == pytest.approx(0.01414, 1e-3)
    assert fp4["bytes_ratio_vs_dp"] == pytest.approx(1000.0)  # per step: the runs' lengths differ


def test_each_seed_is_judged_against_its_best_data_parallel_lr() -> None:
    stored: dict = {}
    cached(stored, Row("dp", lr=2e-3, steps=1000, seed=0), {1000: 1.5}, 10.0)
    cached(stored, Row("dp", lr=1e-3, steps=1000, seed=0), {1000: 1.2}, 10.0)
    cached(stored, Row("fp4", h=20, lr=2e-3, steps=1000, seed=0), {1000: 1.5}, 1.0)
    (fp4,), _ = judge(stored, [Row("fp4", h=20, lr=2e-3)], [2e-3, 1e-3], [0], 1000)
    assert fp4["gap_vs_dp"] == pytest.approx(0.25) and fp4["dp_lr"] == [1e-3]


def test_a_missing_run_is_named_and_its_row_left_out() -> None:
    stored: dict = {}
    cached(stored, Row("dp", lr=2e-3, steps=1000, seed=0), {1000: 1.5}, 10.0)
    cached(stored, Row("fp4", h=20, lr=2e-3, steps=1000, seed=0), {1000: 1.5}, 1.0)
    entries, missing = judge(stored, [Row("fp4", h=20, lr=2e-3)], [2e-3], [0, 1], 1000)
    assert entries == []  # a mean over fewer seeds than asked is not reported
    assert missing == [
        "data-parallel lr 0.002 seed 1, >= 1000 steps, constant lr",
        "fp4 H=20 lr 0.002 seed 1, >= 1000 steps, constant lr",
    ]
    with pytest.raises(ValueError, match="no eval at 500"):
        judge(stored, [Row("fp4", h=20, lr=2e-3)], [2e-3], [0], 500)


def test_cosine_runs_are_read_at_their_own_length_or_at_the_run_steps_asked() -> None:
    stored: dict = {}
    for steps, losses in ((3000, {3000: 1.0}), (5000, {3000: 1.4, 5000: 0.8})):
        cached(stored, Row("dp", lr=2e-3, steps=steps), losses, 10.0, lr_schedule="cosine")
    cached(stored, Row("fp4", h=5, lr=2e-3, steps=5000), {3000: 1.54, 5000: 0.84}, 1.0,
           lr_schedule="cosine")  # fmt: skip
    cached(stored, Row("fp4", h=5, lr=2e-3, steps=3000), {3000: 9.0}, 1.0)  # constant lr
    fp4 = [Row("fp4", h=5, lr=2e-3)]
    # at 3,000 steps: the 5,000-step cosine run is mid-schedule, the constant-lr run is another
    entries, missing = judge(stored, fp4, [2e-3], [0], 3000, "cosine")
    assert entries == [] and missing == ["fp4 H=5 lr 0.002 seed 0, 3000 steps, cosine lr"]
    (mid,), _ = judge(stored, fp4, [2e-3], [0], 3000, "cosine", run_steps=5000)
    assert mid["eval_losses"] == [1.54] and mid["gap_vs_dp"] == pytest.approx(0.1)
    (end,), _ = judge(stored, fp4, [2e-3], [0], 5000, "cosine")
    assert end["gap_vs_dp"] == pytest.approx(0.05)
    with pytest.raises(ValueError, match="3000 steps has no eval at 5000"):
        judge(stored, fp4, [2e-3], [0], 5000, "cosine", run_steps=3000)


def test_the_command_exits_1_naming_what_to_train(tmp_path, monkeypatch, capsys) -> None:
    stored: dict = {}
    cached(stored, Row("dp", lr=2e-3, steps=1000, seed=0), {1000: 1.5}, 1500.0)
    cached(stored, Row("fp4", h=20, lr=2e-3, steps=1000, seed=0), {1000: 1.51}, 1.0)
    (tmp_path / "quality_runs.json").write_text(json.dumps(stored))
    argv = ["quality_goal.py", "--rows", "fp4:20", "--seeds", "0", "--at", "1000",
            "--out", str(tmp_path)]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    assert quality_goal.main() == 0
    assert "1000 steps: best bytes ratio at mean gap <= 1%: 1500x" in capsys.readouterr().out
    goal = json.loads((tmp_path / "quality_sweep.json").read_text())["goal"]
    assert goal["rows"][0]["gap_vs_dp"] == pytest.approx(0.01 / 1.5)
    monkeypatch.setattr(sys, "argv", [*argv[:4], "0", "1", *argv[5:]])
    assert quality_goal.main() == 1
    assert "seed 1, >= 1000 steps" in capsys.readouterr().out
    cosine = [*argv, "--lr-schedule", "cosine"]
    monkeypatch.setattr(sys, "argv", cosine)
    assert quality_goal.main() == 1  # only constant-lr runs are cached
    assert "seed 0, 1000 steps, cosine lr" in capsys.readouterr().out
    cached(stored, Row("dp", lr=2e-3, steps=1000), {1000: 1.0}, 1500.0, lr_schedule="cosine")
    cached(stored, Row("fp4", h=20, lr=2e-3, steps=1000), {1000: 1.02}, 1.0, lr_schedule="cosine")
    (tmp_path / "quality_runs.json").write_text(json.dumps(stored))
    assert quality_goal.main() == 0
    report = json.loads((tmp_path / "quality_sweep.json").read_text())
    assert report["goal_cosine"]["rows"][0]["gap_vs_dp"] == pytest.approx(0.02)
    assert report["goal"]["seeds"] == [0]  # the constant-lr table is kept
    monkeypatch.setattr(sys, "argv", [*cosine, "--run-steps", "500"])
    with pytest.raises(SystemExit) as exit_:
        quality_goal.main()
    assert exit_.value.code == 2
    assert "--run-steps 500 is shorter than --at 1000" in capsys.readouterr().err
