"""The outer learning rate over a run: constant, or a power of the learners' cosine schedule.

    lr = outer_lr * outer_lr_factor("cosine", rounds=1000, power=1.0, taken=n)

The learners' cosine schedule (common/lr_schedule.py) shrinks every round's pseudo-gradient
with their inner learning rate, down to a tenth of it at the end. With "cosine" the outer lr
follows that decay to `power`: (inner factor)^power, so 1 decays it with the learners, a
negative power raises it as they decay (each round's update then shrinks more slowly than
their steps), 0 keeps it. Neither direction trained better than the constant outer lr on the
quality benchmark (docs/RESULTS.md, "The outer lr under the cosine schedule"), so the
default is constant. The server counts outer steps, not inner ones, so it follows the
learners' cosine over its rounds: `rounds` is each fragment's outer steps over which the
learners decay (their lr_schedule_steps / H), with the learners' default warm-up (5%) and
floor (10%); during the warm-up the factor is 1.
"""

from __future__ import annotations

from common.lr_schedule import LrSchedule

OUTER_LR_SCHEDULES = ("constant", "cosine")


def check_outer_lr_schedule(kind: str, rounds: int, power: float) -> None:
    """Raise ValueError, naming the setting, for a schedule that cannot be followed."""
    if kind not in OUTER_LR_SCHEDULES:
        raise ValueError(
            f"outer_lr_schedule must be one of {', '.join(OUTER_LR_SCHEDULES)}, got {kind!r}"
        )
    if kind != "constant" and rounds < 1:
        raise ValueError(
            f"outer_lr_schedule_rounds must be >= 1 with outer_lr_schedule {kind} (each "
            f"fragment's outer steps the learners' cosine spans), got {rounds}"
        )
    if not -1 <= power <= 1:
        raise ValueError(f"outer_lr_schedule_power must be in [-1, 1], got {power}")


def outer_lr_factor(kind: str, rounds: int, power: float, taken: int) -> float:
    """The outer lr of outer step `taken` (0-based) over the configured outer_lr."""
    if kind == "constant":
        return 1.0
    cosine = LrSchedule("cosine", steps=rounds)
    step = taken + 1  # the learners' cosine counts from 1
    if step <= cosine.warmup_steps:
        return 1.0
    return cosine.factor(step) ** power
