"""What a learner has done and what it holds: its progress counters and saved replicas.

    progress = Progress(learner_id="a")     # counted by DilocoSync.step(), summed up at close
    progress.resume_timing(saved)           # a resumed run's timing goes on from a checkpoint's
    SavedReplica(fragment_id, indices, version, params)   # a global fragment in a checkpoint

Plain data, shared by the library (learner/api.py), the daemon (learner/trainer.py), the
session that speaks the protocol (learner/session.py) and checkpoints (learner/checkpoint.py).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

# The counters the timing figures are made of (utilisation = compute_s / (train_wall_s -
# eval_s), the heartbeat's step time = step_time_s()): a resume file holds them all, so that
# a resumed run reports what the same run without the restart would (the time it was down
# not counted).
TIMING_FIELDS = ("compute_s", "train_wall_s", "eval_s", "blocked_on_sync_s", "untimed_steps")


@dataclass
class Progress:
    """What the learner has done so far; the final summary is this as a dict."""

    learner_id: str
    outer_steps: int = 0
    inner_steps: int = 0
    tokens: int = 0
    versions: list[int] = dataclasses.field(default_factory=list)  # per fragment
    eval_losses: list[float] = dataclasses.field(default_factory=list)
    compute_s: float = 0.0
    train_wall_s: float = 0.0  # from the first evaluation to the last inner step
    eval_s: float = 0.0  # of that, evaluating: utilisation = compute_s / (train_wall_s - eval_s)
    blocked_on_sync_s: float = 0.0
    untimed_steps: int = 0  # inner steps whose compute_s is not counted (resume_timing)
    fragment_syncs: int = 0
    late_merges: int = 0
    skipped_pushes: int = 0
    rejoins: int = 0
    stale_pushes: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_by_fragment: dict[int, dict[str, int]] = dataclasses.field(default_factory=dict)
    params_crc32: list[int] = dataclasses.field(default_factory=list)  # per fragment
    last_loss: float = math.nan
    inner_lr: float = math.nan  # of the last inner step, where the daemon's loop took it
    resumed_at_inner_step: int | None = None  # from a checkpoint; None: a cold start
    data_position: int = 0  # windows drawn from this rank's data shard so far
    island_size: int = 1  # ranks training data-parallel as this one learner
    rank_params_crc32: list[int] = dataclasses.field(default_factory=list)  # per rank, at the end

    def step_time_s(self) -> float:
        """Mean compute seconds of an inner step (0 before the first), as heartbeats report it."""
        return self.compute_s / max(1, self.inner_steps - self.untimed_steps)

    def timing_state(self) -> dict[str, float]:
        """The timing counters, for a resume file (TIMING_FIELDS)."""
        return {name: getattr(self, name) for name in TIMING_FIELDS}

    def resume_timing(self, saved: Mapping[str, Any]) -> None:
        """Go on with the timing counters of a resume file; call after inner_steps is set.

        A file that lacks any of them (a checkpoint that holds compute_s alone, a
        DilocoSync.state_dict() with none) starts them again at zero and counts the steps it
        holds as untimed, so that each figure covers the time since this resume instead of
        dividing counters of different spans (a utilisation above 1, a step time spread over
        steps never timed)."""
        if all(name in saved for name in TIMING_FIELDS):
            for name in TIMING_FIELDS:
                setattr(self, name, saved[name])
            return
        self.compute_s = self.train_wall_s = self.eval_s = self.blocked_on_sync_s = 0.0
        self.untimed_steps = self.inner_steps


@dataclass
class SavedReplica:
    """A global fragment as a checkpoint holds it, to resume from without a snapshot."""

    fragment_id: int
    indices: list[int]
    version: int
    params: list[torch.Tensor]
