"""One round policy per mode: which pushes a round takes, when it closes, and the close itself.

    policy = round_policy(config.rounds, config.outer, clock)   # Sync, Quorum or Async
    summary = policy.close(fragment, learners.live(), record)    # None: the round stays open

- `Sync` (DiLoCo, Streaming DiLoCo): a round closes when every live learner has pushed for
  it (and at least min_contributors have); a push against an older version is refused, and
  so is a second push to the same round. Outer optimizer: Nesterov.
- `Quorum` (Decoupled DiLoCo): a round closes once min_contributors have pushed and a grace
  window has passed, or when every live learner has pushed. A push up to max_staleness
  versions behind is taken (discounted, admission.py); a partial round moves the model by
  its part of the live learners' usual weight. Outer optimizer: Nesterov.
- `Async`: every push closes its own round, with Delayed Nesterov, whose momentum period
  follows the number of live learners unless async_momentum_every fixes it.

Grace window (quorum): once `min_contributors` have pushed, a round waits `grace_steps` times
the median inner-step time the live learners report (server/learners.py), clamped to
[grace_min_s, grace_max_s]: long enough for a learner a few steps behind to make it, short
enough that a stalled one costs little.

In every mode a round does not wait for a learner whose push was refused (it is excused); a
round with no accepted push whose live learners are all excused ends without an outer step:
the version stays, the excuses are forgotten, and the next pushes start it again. A learner
counts at most once in a round. The close is write-ahead: the round's mean is logged durably
(`record`) before the outer step makes the next version, so no version exists in memory that
the state dir could not rebuild. The Aggregator picks its policy once, from the mode, and no
other code looks at the mode.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import asdict, dataclass, replace
from typing import cast

import torch

from common.errors import AlreadyExists, FailedPrecondition
from common.tracing import span
from server.learners import Learner, median_step_time_s
from server.rounds.admission import ROBUST_MERGES, WEIGHTINGS, check_untrusted
from server.rounds.outer import DelayedNesterov, NesterovOuter, OuterConfig
from server.rounds.round import Round, twice_fair_share
from server.state.fragment import FragmentState

log = logging.getLogger(__name__)

MODES = ("sync", "quorum", "async")

# record(version, mean, outer_setting): the durable log of the step about to be taken.
Record = Callable[[int, list[torch.Tensor], int], None]


@dataclass(kw_only=True)
class RoundsConfig:
    """When a round closes, what a push weighs and which pushes are refused."""

    mode: str = "sync"
    """sync (round closes when every live learner pushed), quorum or async (server/rounds/)."""
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
    scale_partial_rounds: bool = True
    """quorum: a round that carries only part of the live learners' usual weight moves the
    model by that part (missing work counts as zero), so closing rounds early and often does
    not make the outer step larger. Off: every round takes the plain weighted mean."""
    max_staleness: int = 4
    """quorum/async: refuse a push computed against a version more than this many behind."""
    async_momentum_every: int = 0
    """async: Delayed Nesterov applies momentum every N pushes (0: N = live learners)."""
    max_norm_ratio: float = 10.0
    """Refuse a push whose pseudo-gradient norm exceeds this many times the median of the
    fragment's recent accepted pushes (a poisoned or exploding update); 0: off."""
    max_weight_ratio: float = 4.0
    """A push weighs at most this many times the median of the other live learners' last
    weights, whatever tokens it claims (server/rounds/admission.py); 0: off. 4 lets an honest
    learner do twice the median's tokens per step under tokens_squared_per_step."""
    untrusted_learners: bool = False
    """Bound what any one learner can do, whatever it sends or claims: rounds take the
    trimmed mean (robust_merge trimmed-mean) and no learner holds more than 2/K of a
    round's weight (K: its contributors). Sync and quorum modes, min_contributors >= 3
    (docs/architecture.md, "Bounded influence")."""
    robust_merge: str = ""
    """none (the weighted mean) or trimmed-mean (value by value, drop the trim_fraction
    largest and smallest of a round's pushes; sync and quorum modes). Default: trimmed-mean
    with untrusted_learners, else none."""
    trim_fraction: float = 0.2
    """trimmed-mean: the share of a round's K pushes dropped at each end, at least one when
    K >= 3 (server/rounds/round.py)."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if not self.weighting:
            self.weighting = "equal" if self.mode == "sync" else "tokens_squared_per_step"
        if self.weighting not in WEIGHTINGS:
            raise ValueError(
                f"weighting must be one of {', '.join(WEIGHTINGS)}, got {self.weighting!r}"
            )
        if self.min_contributors < 1:
            raise ValueError(f"min_contributors must be >= 1, got {self.min_contributors}")
        if not 0 <= self.grace_min_s <= self.grace_max_s:
            raise ValueError("grace_min_s and grace_max_s must satisfy 0 <= min <= max")
        if self.grace_steps < 0 or self.max_staleness < 0 or self.async_momentum_every < 0:
            raise ValueError("grace_steps, max_staleness and async_momentum_every must be >= 0")
        if not self.max_norm_ratio >= 0:
            raise ValueError(f"max_norm_ratio must be >= 0, got {self.max_norm_ratio}")
        if not (self.max_weight_ratio == 0 or 1 <= self.max_weight_ratio < math.inf):
            raise ValueError(
                f"max_weight_ratio must be 0 (off) or >= 1, got {self.max_weight_ratio}"
            )
        if not self.robust_merge:
            self.robust_merge = "trimmed-mean" if self.untrusted_learners else "none"
        if self.robust_merge == "clip-to-median":
            raise ValueError(
                "robust_merge clip-to-median is not offered: it bounds a push's size but not "
                "its direction (one learner of eight moved a round's step by 77%); set "
                "untrusted_learners (sync or quorum mode) instead"
            )
        if self.robust_merge not in ROBUST_MERGES:
            raise ValueError(
                f"robust_merge must be one of {', '.join(ROBUST_MERGES)}, got {self.robust_merge!r}"
            )
        if self.untrusted_learners:
            check_untrusted(self)
        if self.robust_merge == "trimmed-mean" and self.mode == "async":
            raise ValueError(
                "robust_merge trimmed-mean needs rounds of several pushes (sync or quorum "
                "mode); in async mode each push is its own round"
            )
        if not 0 < self.trim_fraction < 0.5:
            raise ValueError(f"trim_fraction must be in (0, 0.5), got {self.trim_fraction}")

    def max_share(self, contributors: int) -> float:
        """The largest share of a round's weight one learner may hold (0: unbounded)."""
        return twice_fair_share(contributors) if self.untrusted_learners else 0.0


@dataclass(frozen=True)
class RoundState:
    """An open round: pushes taken, live learners not heard from, the quorum, and the grace
    window's time left once the quorum is reached (quorum mode; None: not in grace)."""

    pushes: int
    awaited: int
    quorum: int
    grace_left_s: float | None


@dataclass(frozen=True)
class RoundSummary:
    version: int
    contributors: int
    tokens: int
    outer_step_s: float
    largest_share: float = 0.0  # of the round's weight one learner held


class RoundPolicy:
    """The rules the modes share; each mode's class overrides what differs."""

    mode = ""
    one_push_per_round = False

    def __init__(
        self, rounds: RoundsConfig, outer: OuterConfig, clock: Callable[[], float]
    ) -> None:
        self.config = rounds
        self.outer_config = outer
        self._clock = clock

    def new_outer(self) -> NesterovOuter | DelayedNesterov:
        """A fresh outer optimizer for one fragment."""
        cfg = self.outer_config
        return NesterovOuter(
            cfg.outer_lr,
            cfg.outer_momentum,
            warmup_rounds=cfg.outer_momentum_warmup_rounds,
            warmup_start=cfg.outer_momentum_warmup_start,
            state_dtype=cfg.outer_state_dtype,
        )

    def check_base(self, fragment: FragmentState, learner: Learner, base_version: int) -> None:
        """Refuse a push this mode does not take (`base_version` is not ahead of the
        fragment's: the caller checked): too stale, a retry of one already counted, or a second
        push to the open round."""
        staleness = fragment.version - base_version
        if staleness > self.config.max_staleness:
            raise FailedPrecondition(
                f"push too stale: base_version {base_version} is {staleness} versions behind "
                f"fragment {fragment.fragment_id} (max_staleness {self.config.max_staleness}); "
                f"pull and push again"
            )
        _refuse_retry(fragment, learner, base_version)
        _refuse_second(fragment, learner.learner_id)

    def accepted(self, rnd: Round) -> None:
        """A push was just added to `rnd`."""

    def ready(self, rnd: Round, live: Collection[Learner]) -> bool:
        """Whether `rnd` closes now, with `live` the learners holding a lease."""
        return rnd.delta_sum is not None and self._closes(rnd, live)

    def expected_weight(self, rnd: Round, live: Collection[Learner]) -> float:
        """The weight a full round would carry (the mean's denominator is at least this)."""
        return 0.0

    def close(
        self, fragment: FragmentState, live: Collection[Learner], record: Record
    ) -> RoundSummary | None:
        """Close the fragment's round if this mode's rule says so: its mean is logged (`record`,
        durable when it returns), then one outer step makes the next version. A round every live
        learner was refused from ends with no step (None: no step taken). If the record fails, the
        round's pushes are dropped (as in a crash) and the error raised: the version stays."""
        rnd = fragment.round
        if rnd.delta_sum is None and rnd.excused and _everyone(rnd, live):
            log.info(
                "fragment=%d round ended without an accepted push; version stays %d",
                fragment.fragment_id,
                fragment.version,
            )
            fragment.round = rnd.next()
            return None
        if not self.ready(rnd, live):
            return None
        started = time.perf_counter()
        closing = span("diloco.round_close", fragment=fragment.fragment_id)
        with closing as traced, fragment.state_lock:  # a snapshot copies before or after the step
            setting = self.before_close(fragment, len(live))
            rnd.cap_shares(self.config.max_share(len(rnd.contributors)))
            mean = rnd.mean(self.expected_weight(rnd, live), self.config.trim_fraction)
            mean_s = time.perf_counter() - started
            try:
                record(fragment.version + 1, mean, setting)
            finally:
                fragment.round = rnd.next()  # the mean's buffers are the next round's sum
            started = time.perf_counter()
            fragment.apply_mean(mean)
            step_s = mean_s + time.perf_counter() - started
            fragment.closed_at = self._clock()
            summary = RoundSummary(
                fragment.version, rnd.pushes, rnd.tokens, step_s, rnd.largest_share
            )
            if traced.is_recording():
                traced.set_attributes(asdict(summary))
        return summary

    def before_close(self, fragment: FragmentState, live: int) -> int:
        """Set the outer optimizer up for the step about to be taken with `live` learners;
        returns what the durable log must keep of that setting (0: nothing)."""
        return 0

    def before_replay(self, fragment: FragmentState, logged: int) -> None:
        """Restore what before_close returned (`logged`) before replaying that step."""

    def _closes(self, rnd: Round, live: Collection[Learner]) -> bool:
        raise NotImplementedError

    def round_state(self, rnd: Round, live: Collection[Learner]) -> RoundState:
        """The open round as the status page shows it."""
        awaited = {x.learner_id for x in live} - rnd.contributors - rnd.excused
        return RoundState(rnd.pushes, len(awaited), self.config.min_contributors, None)


class Sync(RoundPolicy):
    """Every live learner pushes for every version, against that version."""

    mode = "sync"

    def check_base(self, fragment: FragmentState, learner: Learner, base_version: int) -> None:
        if fragment.version > base_version:
            raise FailedPrecondition(
                f"stale push: base_version {base_version} but fragment {fragment.fragment_id} "
                f"is at version {fragment.version}; pull the new version and push again"
            )
        _refuse_retry(fragment, learner, base_version)
        _refuse_second(fragment, learner.learner_id)

    def _closes(self, rnd: Round, live: Collection[Learner]) -> bool:
        return _everyone(rnd, live) and len(rnd.contributors) >= self.config.min_contributors


class Quorum(RoundPolicy):
    """K pushes and a grace window close a round; stale and partial rounds count for less."""

    mode = "quorum"

    def accepted(self, rnd: Round) -> None:
        if len(rnd.contributors) >= self.config.min_contributors:
            rnd.reached_quorum(self._clock())

    def expected_weight(self, rnd: Round, live: Collection[Learner]) -> float:
        """Every live learner in the round, each at its weight in this round or else that of
        its last push (one never seen counts as this round's average); 0 with
        scale_partial_rounds off."""
        if not self.config.scale_partial_rounds:
            return 0.0
        average = rnd.weight_sum / max(1, rnd.pushes)
        last = {x.learner_id: average if x.last_weight is None else x.last_weight for x in live}
        return sum((last | rnd.weights).get(x.learner_id, 0.0) for x in live)

    def _closes(self, rnd: Round, live: Collection[Learner]) -> bool:
        if _everyone(rnd, live):  # untrusted_learners: never a round too small to trim
            untrusted = self.config.untrusted_learners
            return not untrusted or len(rnd.contributors) >= self.config.min_contributors
        return rnd.quorum_since is not None and self._grace_left_s(rnd, live) <= 0

    def _grace_left_s(self, rnd: Round, live: Collection[Learner]) -> float:
        cfg, since = self.config, cast(float, rnd.quorum_since)
        step_times = (learner.step_time_s for learner in live)
        grace = grace_window_s(step_times, cfg.grace_steps, cfg.grace_min_s, cfg.grace_max_s)
        return since + grace - self._clock()

    def round_state(self, rnd: Round, live: Collection[Learner]) -> RoundState:
        state = super().round_state(rnd, live)
        if rnd.quorum_since is None:
            return state
        return replace(state, grace_left_s=max(0.0, self._grace_left_s(rnd, live)))


class Async(RoundPolicy):
    """Each push is a round of its own, applied with Delayed Nesterov."""

    mode = "async"
    one_push_per_round = True  # a push waits for its round to be closable (a snapshot's write)

    def new_outer(self) -> DelayedNesterov:
        cfg = self.outer_config
        return DelayedNesterov(
            cfg.outer_lr, cfg.outer_momentum, self.config.async_momentum_every or 1
        )

    def before_close(self, fragment: FragmentState, live: int) -> int:
        """Momentum every N pushes: N is the number of live learners unless configured."""
        outer = cast(DelayedNesterov, fragment.outer)
        if not self.config.async_momentum_every:
            outer.every = max(1, live)
        return outer.every

    def before_replay(self, fragment: FragmentState, logged: int) -> None:
        if logged:
            cast(DelayedNesterov, fragment.outer).every = logged

    def _closes(self, rnd: Round, live: Collection[Learner]) -> bool:
        return True


POLICIES: dict[str, type[RoundPolicy]] = {p.mode: p for p in (Sync, Quorum, Async)}


def round_policy(
    rounds: RoundsConfig, outer: OuterConfig, clock: Callable[[], float]
) -> RoundPolicy:
    """The policy of `rounds.mode`."""
    return POLICIES[rounds.mode](rounds, outer, clock)


def grace_window_s(
    step_times_s: Iterable[float], grace_steps: float, min_s: float, max_s: float
) -> float:
    """`grace_steps` median inner steps of the live learners, clamped; min_s without reports."""
    median = median_step_time_s(step_times_s)
    if median <= 0:
        return min_s
    return min(max(grace_steps * median, min_s), max_s)


def _everyone(rnd: Round, live: Collection[Learner]) -> bool:
    """Every live learner pushed to the round or was excused from it."""
    return {learner.learner_id for learner in live} <= rnd.contributors | rnd.excused


def _refuse_retry(fragment: FragmentState, learner: Learner, base_version: int) -> None:
    if learner.push_bases.get(fragment.fragment_id) == base_version:
        raise AlreadyExists(
            f"learner {learner.learner_id} already pushed fragment {fragment.fragment_id} "
            f"against version {base_version} (a retried push counts once)"
        )


def _refuse_second(fragment: FragmentState, learner_id: str) -> None:
    """A learner counts once in a round: pushes against different base versions would
    otherwise each add its weight (its next push, against the new version, carries the work)."""
    if learner_id in fragment.round.contributors:
        raise AlreadyExists(
            f"learner {learner_id} already pushed for version "
            f"{fragment.version + 1} of fragment {fragment.fragment_id}"
        )
