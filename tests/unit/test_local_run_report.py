"""`make run`'s verdict judges the global model, so a learner that joined late passes."""

from __future__ import annotations

from deploy.local_run import report


def summary(learner_id: str, eval_losses: list[float]) -> dict:
    return {
        "learner_id": learner_id,
        "outer_steps": max(0, len(eval_losses) - 1),
        "tokens": 0,
        "bytes_sent": 0,
        "bytes_received": 0,
        "eval_losses": eval_losses,
    }


def test_a_late_joiner_with_a_small_drop_of_its_own_passes() -> None:
    # learner-1 joined when the global model was already at 3.0: its own drop is 0.2.
    summaries = [summary("learner-0", [5.5, 4.0, 2.8]), summary("learner-1", [3.0, 2.8])]
    assert report(summaries, min_loss_drop=0.5) == 0


def test_the_worst_final_view_of_the_global_model_is_judged() -> None:
    # learner-0 left early, its last view of the global model barely below the initial one.
    summaries = [summary("learner-0", [5.5, 5.2]), summary("learner-1", [5.5, 2.0])]
    assert report(summaries, min_loss_drop=0.5) == 1


def test_no_evaluation_at_all_fails() -> None:
    assert report([summary("learner-0", [])], min_loss_drop=0.5) == 1
