"""When a round closes and how much each contribution counts (DESIGN.md section 4).

- `sync` (DiLoCo, Streaming DiLoCo): a round closes when every live learner has pushed.
- `quorum` (Decoupled DiLoCo): it closes when at least `min_contributors` have pushed and a
  grace window has passed since then, or when every live learner has pushed. The window is
  `grace_steps` times the median inner-step time the live learners report, clamped to
  [grace_min_s, grace_max_s]: long enough for a learner a few steps behind to make it, short
  enough that a stalled one costs little.
- `async`: every push closes its own round (with Delayed Nesterov as the outer optimizer).

Weights (Decoupled DiLoCo): `tokens_squared_per_step` gives w = tokens·tokens/steps, so a
learner that got through more data per step counts more; `tokens` gives w = tokens; `equal`
gives w = 1. A contribution computed against a version `s` behind the current one is
discounted by 1/(1+s); its weight still counts in full in the denominator, so stale work
shrinks the step rather than steering it.
"""

from __future__ import annotations

import statistics
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
    reported = [t for t in step_times_s if t > 0]
    if not reported:
        return min_s
    return min(max(grace_steps * statistics.median(reported), min_s), max_s)
