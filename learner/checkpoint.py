"""A learner's checkpoint: enough to resume after `kill -9` instead of starting cold.

    save_checkpoint(Path("ckpt"), state)      # atomic: temp file, fsync, rename, fsync dir
    state = load_checkpoint(Path("ckpt"))     # None if there is none yet

What it holds (self-describing, as nanoGPT's checkpoints are): the local model parameters,
the inner optimizer's state, the data position, the schedule step and progress counters, the
global fragments the learner holds with their versions, and an echo of the config. A
restarted learner loads it, joins, and pulls only the updates since the saved versions
(learner/session.py); a fragment the run has not moved meanwhile keeps the local parameters,
so no inner step since the last push is lost. Steps taken after the last checkpoint are.
"""

from __future__ import annotations

import dataclasses
import io
import time
from pathlib import Path
from typing import Any

import torch

from common.atomic import atomic_write
from learner.progress import SavedReplica

CHECKPOINT_NAME = "checkpoint.pt"
FORMAT_VERSION = 1
PROGRESS_FIELDS = ("inner_steps", "outer_steps", "tokens", "compute_s", "eval_losses")


def save_checkpoint(directory: Path, state: dict[str, Any]) -> Path:
    """Write `state` as directory/checkpoint.pt, atomically: a crash at any point leaves
    either the previous checkpoint or the new one, never a torn file."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / CHECKPOINT_NAME
    buffer = io.BytesIO()
    torch.save(state, buffer)
    atomic_write(path, buffer.getbuffer())
    return path


def checkpoint_exists(directory: Path) -> bool:
    """Whether `directory` holds a checkpoint to resume from (readable or not)."""
    return (directory / CHECKPOINT_NAME).exists()


def load_checkpoint(directory: Path) -> dict[str, Any] | None:
    """The checkpoint in `directory`, or None if none was written yet."""
    path = directory / CHECKPOINT_NAME
    if not path.exists():
        return None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # a checkpoint from something else: say so in one sentence
        raise ValueError(f"checkpoint {path} cannot be read ({err.__class__.__name__})") from err
    if not isinstance(state, dict) or state.get("format") != FORMAT_VERSION:
        raise ValueError(f"checkpoint {path} is not a learner checkpoint of format 1")
    return state


def check_compatible(
    state: dict[str, Any], directory: Path, learner_id: str, fingerprint: list[tuple]
) -> None:
    """Refuse a checkpoint of another learner or model, naming what differs."""
    if state["learner_id"] != learner_id:
        raise ValueError(
            f"checkpoint in {directory} belongs to learner {state['learner_id']!r}, not "
            f"{learner_id!r}: pass that --learner-id or use another checkpoint_dir"
        )
    if [tuple(spec) for spec in state["fingerprint"]] != fingerprint:
        raise ValueError(
            f"checkpoint in {directory} was written for a different model (its parameters' "
            "names or shapes differ): use the same model settings or another checkpoint_dir"
        )


def replicas_to_state(replicas: list[SavedReplica]) -> list[dict[str, Any]]:
    return [dataclasses.asdict(r) for r in replicas]


def replicas_from_state(items: list[dict[str, Any]]) -> list[SavedReplica]:
    return [SavedReplica(**item) for item in items]


class CheckpointClock:
    """Says when a checkpoint is due: every N inner steps and/or every S seconds."""

    def __init__(self, every_steps: int, every_s: float) -> None:
        self.every_steps, self.every_s = every_steps, every_s
        self.last_s = time.monotonic()

    def due(self, inner_steps: int) -> bool:
        by_steps = self.every_steps > 0 and inner_steps % self.every_steps == 0
        by_time = self.every_s > 0 and time.monotonic() - self.last_s >= self.every_s
        if by_steps or by_time:
            self.last_s = time.monotonic()
            return True
        return False
