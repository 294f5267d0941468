"""The inner learning rate over a run: constant, or a linear warm-up then a cosine decay.

    schedule = LrSchedule("cosine", steps=5000)       # 5% warm-up, decay to 10% at step 5000
    lr = inner_lr * schedule.factor(step)              # step counts from 1

One definition for the learner daemon (learner/trainer.py) and the quality benchmark's
simulation (bench/simulate.py), so that the schedule measured is the schedule users run.
"""

from __future__ import annotations

import math
from dataclasses import KW_ONLY, dataclass

LR_SCHEDULES = ("constant", "cosine")


@dataclass(frozen=True)
class LrSchedule:
    """A factor on the inner learning rate per inner step. The names in its errors are the
    learner's settings (lr_schedule, lr_schedule_steps, lr_warmup_fraction, lr_min_ratio)."""

    kind: str = "constant"
    _: KW_ONLY  # two floats side by side: named at every call, never swapped
    steps: int = 0
    """Inner steps the warm-up and the decay span; after them the factor stays at
    min_lr_ratio. Only a cosine schedule needs it."""
    warmup_fraction: float = 0.05
    """Of `steps`, the first this fraction ramp up linearly from 1/warm-up steps to 1."""
    min_lr_ratio: float = 0.1
    """Where the cosine ends, as a fraction of the full rate."""

    def __post_init__(self) -> None:
        if self.kind not in LR_SCHEDULES:
            raise ValueError(
                f"lr_schedule must be one of {', '.join(LR_SCHEDULES)}, got {self.kind!r}"
            )
        if self.kind == "cosine" and self.steps < 1:
            raise ValueError(
                "lr_schedule_steps must be >= 1 with a cosine schedule (the inner steps it "
                f"decays over), got {self.steps}"
            )
        if not 0 <= self.warmup_fraction < 1:
            raise ValueError(f"lr_warmup_fraction must be in [0, 1), got {self.warmup_fraction}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"lr_min_ratio must be in [0, 1], got {self.min_lr_ratio}")

    @property
    def warmup_steps(self) -> int:
        """The steps the linear warm-up spans (cosine only)."""
        return max(1, round(self.warmup_fraction * self.steps))

    def factor(self, step: int) -> float:
        """The learning rate at inner step `step` (from 1) over the full rate."""
        if self.kind == "constant":
            return 1.0
        warmup = self.warmup_steps
        if step <= warmup:
            return step / warmup
        progress = min(1.0, (step - warmup) / max(1, self.steps - warmup))
        cosine = 0.5 * (1 + math.cos(math.pi * progress))
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * cosine
