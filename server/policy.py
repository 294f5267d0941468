"""The formulas behind the round policies of server/rounds.py.

Grace window (quorum): once `min_contributors` have pushed, a round waits `grace_steps` times
the median inner-step time the live learners report, clamped to [grace_min_s, grace_max_s]:
long enough for a learner a few steps behind to make it, short enough that a stalled one
costs little. In that median each learner's report counts at most 10 times the median of
the others' (STEP_TIME_CAP_RATIO), so one learner's report cannot stretch it.

Weights (Decoupled DiLoCo): `tokens_squared_per_step` gives w = tokens·tokens/steps, so a
learner that got through more data per step counts more; `tokens` gives w = tokens; `equal`
gives w = 1. A contribution computed against a version `s` behind the current one is
discounted by 1/(1+s); its weight still counts in full in the denominator, so stale work
shrinks the step rather than steering it.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable

MODES = ("sync", "quorum", "async")
WEIGHTINGS = ("equal", "tokens", "tokens_squared_per_step")


def contribution_weight(weighting: str, tokens: int, steps: int) -> float:
    if weighting == "equal":
        return 1.0
    if tokens <= 0 or steps <= 0:
        raise ValueError(f"{weighting} weighting needs tokens and inner_steps > 0")
    if weighting == "tokens":
        return float(tokens)
    return tokens * tokens / steps


def staleness_discount(staleness: int) -> float:
    return 1.0 / (1 + staleness)


def grace_window_s(
    step_times_s: Iterable[float], grace_steps: float, min_s: float, max_s: float
) -> float:
    """`grace_steps` median inner steps of the live learners, clamped; min_s without reports."""
    median = median_step_time_s(step_times_s)
    if median <= 0:
        return min_s
    return min(max(grace_steps * median, min_s), max_s)


def median_step_time_s(step_times_s: Iterable[float]) -> float:
    """The median reported inner-step time, each report first capped at STEP_TIME_CAP_RATIO
    times the median of the others': one learner cannot drag the median that every learner
    paces to (with three or more, it cannot move it past the honest ones). 0 when nobody
    reported one."""
    reported = sorted(t for t in step_times_s if t > 0)
    if len(reported) < 2:
        return reported[0] if reported else 0.0
    capped = [
        min(t, STEP_TIME_CAP_RATIO * _median_without(reported, i)) for i, t in enumerate(reported)
    ]
    return statistics.median(capped)


def _median_without(ordered: list[float], skip: int) -> float:
    """The median of the sorted list `ordered` without its element `skip`, in O(1)."""
    n = len(ordered) - 1

    def at(k: int) -> float:  # the k-th of the others
        return ordered[k if k < skip else k + 1]

    return at(n // 2) if n % 2 else (at(n // 2 - 1) + at(n // 2)) / 2


STEP_TIME_CAP_RATIO = 10.0


def estimated_schedule_step(
    reports: Iterable[tuple[int, float]], now: float, step_time_s: float
) -> int:
    """Where the live learners' schedule is now, for a learner that joins mid-run.

    Each report (schedule step, clock time it was reported) is moved on by the time since, at
    one schedule step per median step time (with dynamic local updates a slower learner's
    schedule advances at that rate too); the median of those. 0 without reports. In quorum
    mode rounds can close more than once per H steps, so fragment versions do not tell the
    schedule step (Schedule.resume_step assumes they do, which holds in sync mode only).
    """
    estimates = [moved_on(step, at, now, step_time_s) for step, at in reports if step > 0]
    if not estimates:
        return 0
    # Learners report any int64 and any step time (a subnormal one makes the estimate inf):
    # keep the answer an exact integer that fits the reply's int64 field.
    median = statistics.median(estimates)
    return int(median) if median < MAX_SCHEDULE_STEP else MAX_SCHEDULE_STEP


def moved_on(step: int, at: float, now: float, step_time_s: float) -> float:
    """A schedule step reported at clock time `at`, moved on to `now` at one step per
    `step_time_s` (as reported when that is 0)."""
    return step + (max(0.0, now - at) / step_time_s if step_time_s > 0 else 0.0)


MAX_SCHEDULE_STEP = 2**53  # exact in float64; no run takes this many steps


class NormGuard:
    """Refuses a pseudo-gradient whose norm is far above the recent median for its fragment.

    A poisoned or exploding update would otherwise move the global model arbitrarily far in
    one round. The first `warmup` pushes are only recorded: there is no median to compare to.
    """

    def __init__(self, max_ratio: float, window: int = 32, warmup: int = 4) -> None:
        self.max_ratio = max_ratio
        self.warmup = warmup
        self._recent: deque[float] = deque(maxlen=window)

    def check(self, norm: float) -> None:
        """Raise ValueError (with the reason) if `norm` is out of bounds; records nothing."""
        if not math.isfinite(norm):
            raise ValueError("pseudo-gradient norm is not finite")
        if self.max_ratio <= 0 or len(self._recent) < self.warmup:
            return
        median = statistics.median(self._recent)
        if median > 0 and norm > self.max_ratio * median:
            raise ValueError(
                f"pseudo-gradient norm {norm:.4g} is {norm / median:.1f}x the recent median "
                f"{median:.4g} (max_norm_ratio {self.max_ratio:g})"
            )

    def record(self, norm: float) -> None:
        self._recent.append(norm)

    def median(self) -> float | None:
        """The recent median norm, once past the warm-up (None before)."""
        if len(self._recent) < max(1, self.warmup):
            return None
        return statistics.median(self._recent)
