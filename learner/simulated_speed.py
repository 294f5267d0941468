"""Simulated hardware speed for benchmarks, demos and tests ([simulation] settings).

    speed = SimulatedSpeed(config.simulation)
    ... an inner step that took step_s ...
    time.sleep(speed.idle_s(step_s))

Two ways to make a learner act like other hardware:
- --slowdown k (Slowdown): each step idles k - 1 times as long as it took, as on hardware k
  times slower than this machine. Relative to this machine, so a busy machine slows it too.
- --step-period-s T (StepPeriod): steps end on a clock that ticks every T seconds, as on
  hardware whose step takes T. As long as a step's own work fits in T, the pace holds
  whatever else runs here, so two learners' speeds differ by a ratio the caller sets.
"""

from __future__ import annotations

import statistics
import time
from collections import deque

from learner.config import SimulationConfig


class Slowdown:
    """--slowdown k: after each step, idle k - 1 times as long as it took, as if the
    hardware were k times slower.

    A step that took far longer than the recent ones was paused (SIGSTOP, a preempted VM),
    not slow: slower hardware would not stretch the pause. Unchecked, a 1-second pause
    became an 8-second one at k = 8, which threw learners out of phase by whatever amount
    happened to land in a step. So the idle time is based on at most PAUSE_FACTOR times the
    median of the last WINDOW steps.
    """

    WINDOW = 16
    PAUSE_FACTOR = 3.0

    def __init__(self, factor: float) -> None:
        self.factor = factor
        self._recent: deque[float] = deque(maxlen=self.WINDOW)

    def idle_s(self, step_s: float) -> float:
        typical = statistics.median(self._recent) if self._recent else step_s
        self._recent.append(step_s)
        return (self.factor - 1) * min(step_s, self.PAUSE_FACTOR * typical)


class StepPeriod:
    """--step-period-s T: each step ends T seconds after the previous one's end, on a clock.

    A step that ran past its tick (a busy moment) is made up by the following steps, which
    idle less, so the count of steps in a minute stays what T says. The time between steps
    (a sync, an evaluation) counts in full, as it would on real hardware. A lag of more than
    CATCH_UP_TICKS ticks was a pause (SIGSTOP, a preempted VM): the clock restarts from now
    instead of rushing through the missed steps, as real hardware would not run them faster.
    """

    CATCH_UP_TICKS = 10

    def __init__(self, period_s: float) -> None:
        self.period_s = period_s
        self._last_tick: float | None = None  # when the previous step was due to end
        self._last_end = 0.0  # when it did end, its idle time included

    def idle_s(self, started: float, now: float) -> float:
        """Seconds from `now` to the end of the step that ran from `started` (both on
        time.monotonic()'s clock)."""
        if self._last_tick is None:
            tick = started + self.period_s
        else:
            tick = self._last_tick + max(0.0, started - self._last_end) + self.period_s
        if now - tick > self.CATCH_UP_TICKS * self.period_s:
            tick = now  # a pause: not made up
        idle = max(0.0, tick - now)
        self._last_tick, self._last_end = tick, now + idle
        return idle


class SimulatedSpeed:
    """The idle time the [simulation] settings add after an inner step (0 when unset)."""

    def __init__(self, config: SimulationConfig) -> None:
        self._slowdown = Slowdown(config.slowdown) if config.slowdown > 1 else None
        self._period = StepPeriod(config.step_period_s) if config.step_period_s > 0 else None

    def idle_s(self, step_s: float) -> float:
        if self._slowdown is not None:
            return self._slowdown.idle_s(step_s)
        if self._period is not None:
            now = time.monotonic()
            return self._period.idle_s(now - step_s, now)
        return 0.0
