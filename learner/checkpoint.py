"""A learner's checkpoint: enough to resume after `kill -9` instead of starting cold.

    save_checkpoint(Path("ckpt"), state)      # atomic: temp file, fsync, rename, fsync dir
    state = load_checkpoint(Path("ckpt"))     # None if there is none yet

What it holds (self-describing, as nanoGPT's checkpoints are): the local model parameters,
the inner optimizer's state, the data position, the schedule step and progress counters (the
timing ones included, so that utilisation and step times go on across a resume), the global
fragments the learner holds with their versions, and an echo of the config. A
restarted learner loads it, joins, and pulls only the updates since the saved versions
(learner/session.py); a fragment the run has not moved meanwhile keeps the local parameters,
so no inner step since the last push is lost. Steps taken after the last checkpoint are.

The built-in job (learner/trainer.py) writes and restores its checkpoint through
JobCheckpoint, so that the format is written here, where it is read and checked:

    checkpoint = JobCheckpoint(learner, directory, specs)
    checkpoint.restore()                 # before the run, if the directory holds one
    if checkpoint.due(inner_steps): checkpoint.save()
"""

from __future__ import annotations

import dataclasses
import io
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from common.atomic import atomic_write
from common.config import flat_values
from learner.progress import TIMING_FIELDS, SavedReplica

if TYPE_CHECKING:
    from learner.trainer import Learner

log = logging.getLogger("diloco.learner")

CHECKPOINT_NAME = "checkpoint.pt"
# Changes only where a reader of one format would misread the other. The timing counters
# other than compute_s are optional fields: a reader that does not know them ignores them,
# and a checkpoint without them loads with its timing started again (Progress.resume_timing).
FORMAT_VERSION = 1
COUNT_FIELDS = ("inner_steps", "outer_steps", "tokens", "eval_losses")
PROGRESS_FIELDS = COUNT_FIELDS + TIMING_FIELDS


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
        raise ValueError(
            f"checkpoint {path} is not a learner checkpoint of format {FORMAT_VERSION}"
        )
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


class JobCheckpoint:
    """The built-in job's checkpoint: its model, inner optimizer, data position, schedule
    step, progress and the sync's replicas. On an island rank 0 reads and writes it, and
    hands the other ranks what they need to go on in step (optimizer, data, progress)."""

    def __init__(self, job: Learner, directory: Path, specs: list[tuple[str, list[int], str]]):
        """`specs`: the model's parameters as (name, shape, dtype), which a checkpoint must
        match to be restored."""
        self.job, self.directory, self.specs = job, directory, specs
        ckpt = job.config.checkpoint
        self._clock = CheckpointClock(ckpt.checkpoint_every_steps, ckpt.checkpoint_every_s)

    def due(self, inner_steps: int) -> bool:
        return self._clock.due(inner_steps)

    def save(self) -> None:
        """Write the checkpoint (rank 0; the ranks' states are identical)."""
        job = self.job
        if job.sync is None:
            return
        started = time.perf_counter()
        state = {
            "format": FORMAT_VERSION,
            "learner_id": job.config.connection.learner_id,
            "config": flat_values(job.config),
            "fingerprint": [list(spec) for spec in self.specs],
            "model": {k: v.detach().cpu().clone() for k, v in job.model.state_dict().items()},
            "optimizer": job.optimizer.state_dict(),
            "data": job.batches.state_dict(),
            "step": job.sync.schedule_step,
            "progress": {f: getattr(job.progress, f) for f in PROGRESS_FIELDS},
            "fragments": job.sync.state_dict()["fragments"],
            "island_size": job.island.world_size,
            "saved_unix_s": time.time(),
        }
        path = save_checkpoint(self.directory, state)
        log.info(
            "learner=%s checkpoint step=%d data_position=%d to %s in %.3f s",
            job.progress.learner_id,
            job.progress.inner_steps,
            job.batches.position,
            path,
            time.perf_counter() - started,
        )

    def restore(self) -> None:
        """Resume from the checkpoint in the directory, if there is one; rank 0 reads it and
        hands the other ranks the optimizer state, data position and progress."""
        job, island = self.job, self.job.island
        state, error = None, None
        if island.is_leader:
            try:
                state = load_checkpoint(self.directory)
                if state is not None:
                    check_compatible(state, self.directory, job.progress.learner_id, self.specs)
            except ValueError as err:
                error = str(err)
        # Every rank learns the outcome, so a bad checkpoint ends all of them with the same
        # one-line error instead of leaving the others waiting in the broadcast below.
        error = island.broadcast_object(error)
        if error is not None:
            raise ValueError(error)
        keys = ("optimizer", "data", "progress")
        shared = island.broadcast_object(state and {k: state[k] for k in keys})
        if shared is None:
            return
        job.batches.load_state_dict(shared["data"])
        job.optimizer.load_state_dict(shared["optimizer"])
        saved = shared["progress"]
        for name in COUNT_FIELDS:
            setattr(job.progress, name, saved[name])
        job.progress.resume_timing(saved)
        job.progress.resumed_at_inner_step = job.progress.inner_steps
        if state is not None and job.sync is not None:
            job.model.load_state_dict(state["model"])
            # Rank 0's progress is the sync's: the same counts, and the same timing.
            job.sync.load_state_dict(saved | {"fragments": state["fragments"]})
            log.info(
                "learner=%s resuming from checkpoint step=%d data_position=%d versions=%s",
                job.progress.learner_id,
                job.progress.inner_steps,
                job.batches.position,
                [f["version"] for f in state["fragments"]],
            )
