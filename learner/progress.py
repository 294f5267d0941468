"""What a learner has done and what it holds: its progress counters and saved replicas.

    progress = Progress(learner_id="a")     # counted by DilocoSync.step(), summed up at close
    SavedReplica(fragment_id, indices, version, params)   # a global fragment in a checkpoint

Plain data, shared by the library (learner/api.py), the daemon (learner/trainer.py), the
session that speaks the protocol (learner/session.py) and checkpoints (learner/checkpoint.py).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch


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
    train_wall_s: float = 0.0  # from the first inner step to the last
    eval_s: float = 0.0  # of that, evaluating: utilisation = compute_s / (train_wall_s - eval_s)
    blocked_on_sync_s: float = 0.0
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


@dataclass
class SavedReplica:
    """A global fragment as a checkpoint holds it, to resume from without a snapshot."""

    fragment_id: int
    indices: list[int]
    version: int
    params: list[torch.Tensor]
