"""The learner checkpoint file: atomic writes, self-description, refusals in one sentence."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from learner.checkpoint import (
    CHECKPOINT_NAME,
    CheckpointClock,
    check_compatible,
    load_checkpoint,
    replicas_from_state,
    replicas_to_state,
    save_checkpoint,
)
from learner.progress import SavedReplica

SPEC = [("w", [2, 3], "float32")]


def state(**changes) -> dict:
    replica = SavedReplica(0, [0], 7, [torch.ones(2, 3)])
    base = {
        "format": 1,
        "learner_id": "a",
        "fingerprint": [list(s) for s in SPEC],
        "model": {"w": torch.arange(6.0).view(2, 3)},
        "progress": {"inner_steps": 12, "eval_losses": [5.5, 4.25]},
        "fragments": replicas_to_state([replica]),
    }
    return base | changes


def test_a_checkpoint_round_trips_and_replaces_the_previous_one(tmp_path: Path) -> None:
    assert load_checkpoint(tmp_path) is None
    save_checkpoint(tmp_path, state())
    save_checkpoint(tmp_path, state(progress={"inner_steps": 15, "eval_losses": []}))
    loaded = load_checkpoint(tmp_path)
    assert loaded["progress"]["inner_steps"] == 15
    assert torch.equal(loaded["model"]["w"], torch.arange(6.0).view(2, 3))
    (replica,) = replicas_from_state(loaded["fragments"])
    assert replica.version == 7 and torch.equal(replica.params[0], torch.ones(2, 3))
    assert sorted(p.name for p in tmp_path.iterdir()) == [CHECKPOINT_NAME]  # no temp left


def test_a_torn_or_foreign_file_is_refused_in_one_sentence(tmp_path: Path) -> None:
    (tmp_path / CHECKPOINT_NAME).write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="cannot be read"):
        load_checkpoint(tmp_path)
    torch.save({"format": 99}, tmp_path / CHECKPOINT_NAME)
    with pytest.raises(ValueError, match="not a learner checkpoint of format 1"):
        load_checkpoint(tmp_path)


def test_another_learners_or_models_checkpoint_is_refused(tmp_path: Path) -> None:
    check_compatible(state(), tmp_path, "a", [("w", [2, 3], "float32")])
    with pytest.raises(ValueError, match="belongs to learner 'a', not 'b'"):
        check_compatible(state(), tmp_path, "b", SPEC)
    with pytest.raises(ValueError, match="for a different model"):
        check_compatible(state(), tmp_path, "a", [("w", [3, 2], "float32")])


def test_the_clock_is_due_by_steps_or_by_time() -> None:
    by_steps = CheckpointClock(every_steps=5, every_s=0)
    assert [s for s in range(1, 16) if by_steps.due(s)] == [5, 10, 15]
    by_time = CheckpointClock(every_steps=0, every_s=3600)
    assert not any(by_time.due(s) for s in range(1, 100))
    by_time.last_s -= 3600
    assert by_time.due(100) and not by_time.due(101)
