"""The aggregator's settings, validated on construction (one sentence names the field)."""

from __future__ import annotations

from dataclasses import dataclass

from common.codec import CODECS
from common.fragments import LAYOUTS
from server.policy import MODES, WEIGHTINGS


@dataclass(kw_only=True)
class AggregatorConfig:
    """How the aggregator runs rounds and leases."""

    mode: str = "sync"
    """sync (round closes when every live learner pushed), quorum or async (server/policy.py)."""
    lease_s: float = 10.0
    """A learner that neither heartbeats nor calls for this long is dropped from rounds."""
    min_contributors: int = 1
    """K: a round closes only once at least this many learners pushed to it (in sync mode,
    also every live learner): in sync mode, the expected count makes everyone start together."""
    grace_steps: float = 5.0
    """quorum: after K pushes, wait this many median inner-step times for more."""
    grace_min_s: float = 0.0
    """quorum: the shortest grace window (also used before any learner reported step times)."""
    grace_max_s: float = 10.0
    """quorum: the longest grace window."""
    weighting: str = ""
    """equal, tokens or tokens_squared_per_step (default: equal in sync mode, else the last)."""
    max_norm_ratio: float = 10.0
    """Refuse a push whose pseudo-gradient norm exceeds this many times the median of the
    fragment's recent accepted pushes (a poisoned or exploding update); 0: off."""
    scale_partial_rounds: bool = True
    """quorum: a round that carries only part of the live learners' usual weight moves the
    model by that part (missing work counts as zero), so closing rounds early and often does
    not make the outer step larger. Off: every round takes the plain weighted mean."""
    max_staleness: int = 4
    """quorum/async: refuse a push computed against a version more than this many behind."""
    async_momentum_every: int = 0
    """async: Delayed Nesterov applies momentum every N pushes (0: N = live learners)."""
    state_dir: str = ""
    """Directory for snapshots and the update log; empty keeps state in memory only."""
    snapshot_every_versions: int = 100
    """Write a full snapshot (and start a new log) after this many closed rounds."""
    outer_lr: float = 0.7
    """Outer learning rate of the Nesterov step (0.7 in DiLoCo)."""
    outer_momentum: float = 0.9
    """Outer Nesterov momentum (0.9 in DiLoCo)."""
    outer_momentum_warmup_rounds: int = 0
    """sync/quorum: raise the outer momentum linearly from outer_momentum_warmup_start to
    outer_momentum over each fragment's first N outer steps (0: off, torch's SGD exactly).
    Helps a model trained from scratch (README, quality results)."""
    outer_momentum_warmup_start: float = 0.5
    """The outer momentum of the first outer step when the warm-up is on."""
    fragments: int = 1
    """P, the number of fragments the parameters are split into (Streaming DiLoCo)."""
    layout: str = "strided"
    """How parameters are split: strided, sequential or balanced (common/fragments.py)."""
    pull_codec: str = "fp4_e2m1"
    """Codec of the outer updates learners pull (with error feedback); fp32 pulls snapshots."""
    update_log_versions: int = 16
    """Quantized updates kept per fragment; a learner further behind gets a snapshot."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if not self.weighting:
            self.weighting = "equal" if self.mode == "sync" else "tokens_squared_per_step"
        if self.weighting not in WEIGHTINGS:
            raise ValueError(
                f"weighting must be one of {', '.join(WEIGHTINGS)}, got {self.weighting!r}"
            )
        if not 0 <= self.grace_min_s <= self.grace_max_s:
            raise ValueError("grace_min_s and grace_max_s must satisfy 0 <= min <= max")
        if self.snapshot_every_versions < 1:
            raise ValueError(
                f"snapshot_every_versions must be >= 1, got {self.snapshot_every_versions}"
            )
        if self.grace_steps < 0 or self.max_staleness < 0 or self.async_momentum_every < 0:
            raise ValueError("grace_steps, max_staleness and async_momentum_every must be >= 0")
        if not self.lease_s > 0:
            raise ValueError(f"lease_s must be > 0, got {self.lease_s}")
        if not self.max_norm_ratio >= 0:
            raise ValueError(f"max_norm_ratio must be >= 0, got {self.max_norm_ratio}")
        if self.min_contributors < 1:
            raise ValueError(f"min_contributors must be >= 1, got {self.min_contributors}")
        if not self.outer_lr > 0:
            raise ValueError(f"outer_lr must be > 0, got {self.outer_lr}")
        if not 0 <= self.outer_momentum < 1:
            raise ValueError(f"outer_momentum must be in [0, 1), got {self.outer_momentum}")
        if self.outer_momentum_warmup_rounds < 0:
            raise ValueError(
                "outer_momentum_warmup_rounds must be >= 0, "
                f"got {self.outer_momentum_warmup_rounds}"
            )
        if not 0 <= self.outer_momentum_warmup_start < 1:
            raise ValueError(
                "outer_momentum_warmup_start must be in [0, 1), "
                f"got {self.outer_momentum_warmup_start}"
            )
        if (
            self.outer_momentum_warmup_rounds
            and self.outer_momentum_warmup_start > self.outer_momentum
        ):
            raise ValueError(
                f"outer_momentum_warmup_start ({self.outer_momentum_warmup_start}) must not "
                f"exceed outer_momentum ({self.outer_momentum}): a warm-up raises the momentum"
            )
        if self.outer_momentum_warmup_rounds and self.mode == "async":
            raise ValueError(
                "outer_momentum_warmup_rounds is for sync and quorum modes; async mode's "
                "Delayed Nesterov has no warm-up"
            )
        if self.fragments < 1:
            raise ValueError(f"fragments must be >= 1, got {self.fragments}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {self.layout!r}")
        if self.pull_codec not in CODECS or self.pull_codec == "bf16":
            raise ValueError(
                f"pull_codec must be fp32, fp4_e2m1 or fp4_e3m0, got {self.pull_codec!r}"
            )
        if self.update_log_versions < 1:
            raise ValueError(f"update_log_versions must be >= 1, got {self.update_log_versions}")
