"""One round policy per mode: which pushes a round takes, when it closes, with which optimizer.

    policy = round_policy(config.rounds, config.outer, clock)   # Sync, Quorum or Async

- `Sync` (DiLoCo, Streaming DiLoCo): a round closes when every live learner has pushed for
  it (and at least min_contributors have); a push against an older version is refused, and
  so is a second push to the same round. Outer optimizer: Nesterov.
- `Quorum` (Decoupled DiLoCo): a round closes once min_contributors have pushed and a grace
  window has passed, or when every live learner has pushed. A push up to max_staleness
  versions behind is taken (discounted); a partial round moves the model by its part of the
  live learners' usual weight. Outer optimizer: Nesterov.
- `Async`: every push closes its own round, with Delayed Nesterov, whose momentum period
  follows the number of live learners unless async_momentum_every fixes it.

In every mode a round does not wait for a learner whose push was refused (by the norm guard
or the token-claim check: it is excused); a round with no accepted push whose live learners
are all excused ends without an outer step: the version stays, the excuses are forgotten,
and the next pushes start it again. A learner counts at most once in a round, and its
weight is capped against the others' (server/influence.py); with robust_merge trimmed-mean
the round's trimmed mean replaces its weighted mean at the close.

The Aggregator picks its policy once, from the mode, and no other code looks at the mode. The
formulas (weights, grace window, staleness discount) are server/policy.py's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from typing import cast

import torch

from common.errors import AlreadyExists, FailedPrecondition, InvalidArgument
from server.config import RoundsConfig
from server.fragment import FragmentState, Round, RoundSummary
from server.influence import capped_weight, trim_count, trimmed_mean_into
from server.membership import Session
from server.outer import DelayedNesterov, NesterovOuter
from server.outer_config import OuterConfig
from server.policy import contribution_weight, grace_window_s

log = logging.getLogger(__name__)


class RoundPolicy:
    """The rules the modes share; each mode's class overrides what differs."""

    mode = ""

    def __init__(
        self, rounds: RoundsConfig, outer: OuterConfig, clock: Callable[[], float]
    ) -> None:
        self.config = rounds
        self.outer_config = outer
        self._clock = clock
        self.last_weight: dict[str, float] = {}  # learner -> weight of its last push

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

    def check_base(self, fragment: FragmentState, learner_id: str, base_version: int) -> None:
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
        _refuse_retry(fragment, learner_id, base_version)
        _refuse_second(fragment, learner_id)

    def weight(
        self, learner_id: str, tokens: int, inner_steps: int, live: Collection[Session]
    ) -> tuple[float, bool]:
        """How much a push counts in its round (before the staleness discount), and whether
        the weight cap lowered its claim (server/influence.py)."""
        try:
            claimed = contribution_weight(self.config.weighting, tokens, inner_steps)
        except ValueError as err:
            raise InvalidArgument(str(err)) from err
        last = self.last_weight
        others = [
            last[s.learner_id] for s in live if s.learner_id != learner_id and s.learner_id in last
        ]
        weight = capped_weight(claimed, others, self.config.max_weight_ratio)
        return weight, weight < claimed

    def accepted(self, rnd: Round, learner_id: str, weight: float) -> None:
        """A push of `learner_id`, at `weight`, was just added to `rnd`."""
        self.last_weight[learner_id] = weight
        if rnd.opened_at is None:
            rnd.opened_at = self._clock()

    def ready(self, rnd: Round, live: Collection[Session]) -> bool:
        """Whether `rnd` closes now, with `live` the sessions holding a lease."""
        return rnd.delta_sum is not None and self._closes(rnd, live)

    def expected_weight(self, rnd: Round, live: Collection[Session]) -> float:
        """The weight a full round would carry (the mean's denominator is at least this)."""
        return 0.0

    def close_if_ready(
        self,
        fragment: FragmentState,
        live: Collection[Session],
        record: Callable[[list[torch.Tensor], int], None],
    ) -> RoundSummary | None:
        """Close the fragment's round if this mode's rule says so: one outer step, after
        which `record(mean, outer_setting)` logs it (before_replay takes the setting back).
        A round every live learner was refused from ends with no step (None)."""
        rnd = fragment.round
        if rnd.delta_sum is None and rnd.excused and _everyone(rnd, live):
            log.info(
                "fragment=%d round ended without an accepted push; version stays %d",
                fragment.fragment_id,
                fragment.version,
            )
            fragment.round = Round()
            return None
        if not self.ready(rnd, live):
            return None
        fragment.settle()
        if rnd.kept is not None:
            # The trimmed mean, times the weight the division below takes out again.
            trim = trim_count(len(rnd.kept), self.config.trim_fraction)
            trimmed_mean_into(rnd.delta_sum or [], rnd.kept, trim, rnd.weight_sum)
            rnd.kept = None
        setting = self.before_close(fragment, len(live))
        weight = self.expected_weight(fragment.round, live)
        return fragment.close_round(weight, lambda mean: record(mean, setting))

    def before_close(self, fragment: FragmentState, live: int) -> int:
        """Set the outer optimizer up for the step about to be taken with `live` learners;
        returns what the durable log must keep of that setting (0: nothing)."""
        return 0

    def before_replay(self, fragment: FragmentState, logged: int) -> None:
        """Restore what before_close returned (`logged`) before replaying that step."""

    def _closes(self, rnd: Round, live: Collection[Session]) -> bool:
        raise NotImplementedError


class Sync(RoundPolicy):
    """Every live learner pushes for every version, against that version."""

    mode = "sync"

    def check_base(self, fragment: FragmentState, learner_id: str, base_version: int) -> None:
        if fragment.version > base_version:
            raise FailedPrecondition(
                f"stale push: base_version {base_version} but fragment {fragment.fragment_id} "
                f"is at version {fragment.version}; pull the new version and push again"
            )
        _refuse_retry(fragment, learner_id, base_version)
        _refuse_second(fragment, learner_id)

    def _closes(self, rnd: Round, live: Collection[Session]) -> bool:
        return _everyone(rnd, live) and len(rnd.contributors) >= self.config.min_contributors


class Quorum(RoundPolicy):
    """K pushes and a grace window close a round; stale and partial rounds count for less."""

    mode = "quorum"

    def accepted(self, rnd: Round, learner_id: str, weight: float) -> None:
        super().accepted(rnd, learner_id, weight)
        if rnd.quorum_since is None and len(rnd.contributors) >= self.config.min_contributors:
            rnd.quorum_since = self._clock()

    def expected_weight(self, rnd: Round, live: Collection[Session]) -> float:
        """Every live learner in the round, each at the weight of its last push (one never
        seen counts as this round's average); 0 with scale_partial_rounds off."""
        if not self.config.scale_partial_rounds:
            return 0.0
        average = rnd.weight_sum / max(1, rnd.pushes)
        return sum(self.last_weight.get(s.learner_id, average) for s in live)

    def _closes(self, rnd: Round, live: Collection[Session]) -> bool:
        if _everyone(rnd, live):
            return True
        if rnd.quorum_since is None:
            return False
        cfg = self.config
        step_times = (s.step_time_s for s in live)
        grace = grace_window_s(step_times, cfg.grace_steps, cfg.grace_min_s, cfg.grace_max_s)
        return self._clock() >= rnd.quorum_since + grace


class Async(RoundPolicy):
    """Each push is a round of its own, applied with Delayed Nesterov."""

    mode = "async"

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

    def _closes(self, rnd: Round, live: Collection[Session]) -> bool:
        return True


POLICIES: dict[str, type[RoundPolicy]] = {p.mode: p for p in (Sync, Quorum, Async)}


def round_policy(
    rounds: RoundsConfig, outer: OuterConfig, clock: Callable[[], float]
) -> RoundPolicy:
    """The policy of `rounds.mode`."""
    return POLICIES[rounds.mode](rounds, outer, clock)


def _everyone(rnd: Round, live: Collection[Session]) -> bool:
    """Every live learner pushed to the round or was excused from it."""
    return {s.learner_id for s in live} <= rnd.contributors | rnd.excused


def _refuse_retry(fragment: FragmentState, learner_id: str, base_version: int) -> None:
    if fragment.last_push_base.get(learner_id) == base_version:
        raise AlreadyExists(
            f"learner {learner_id} already pushed fragment {fragment.fragment_id} against "
            f"version {base_version} (a retried push counts once)"
        )


def _refuse_second(fragment: FragmentState, learner_id: str) -> None:
    """A learner counts once in a round: pushes against different base versions would
    otherwise each add its weight (its next push, against the new version, carries the work)."""
    if learner_id in fragment.round.contributors:
        raise AlreadyExists(
            f"learner {learner_id} already pushed for version "
            f"{fragment.version + 1} of fragment {fragment.fragment_id}"
        )
