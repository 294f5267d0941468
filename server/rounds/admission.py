"""What a push must pass before it counts, what it weighs, and how it joins its round.

    admission = Admission(config.rounds, policy, events, clock)
    fragment = admission.check_header(learner, fragment, base_version, initial=False)
    ticket = admission.admit(learner, fragment, base_version, body, tokens, inner_steps)

Header rules, checked before the payload is read so that a stale or duplicate push costs no
bandwidth: the fragment has parameters (an initial push: has none yet), the base version is
not from the future, and the mode's policy takes the push (policy.py: staleness, a retry, a
second push to the round). Body rules: the shapes are the fragment's, the claimed tokens fit
the rate declared at Join, values and weights stay far from float32 overflow, and the norm
guard refuses an update far larger than the fragment's recent ones.

What a push weighs (Decoupled DiLoCo): `tokens_squared_per_step` gives w = tokens·tokens/steps,
so a learner that got through more data per step counts more; `tokens` gives w = tokens;
`equal` gives w = 1. A contribution computed against a version `s` behind the current one is
discounted by 1/(1+s); its weight still counts in full in the round's weight, so stale work
shrinks the step rather than steering it.

Bounded influence. A learner's weight comes from what it claims, and its pseudo-gradient is
whatever it sends within the norm guard; an authenticated learner can lie about both. The
server alone bounds it (learners pull the result, so replicas stay bit-identical and a
replay of the log rebuilds it):
- Token claims: a learner may declare at Join how many tokens one inner step trains on; a
  push then claims at most TOKEN_CLAIM_SLACK times inner_steps times that. Undeclared (0):
  unchecked.
- Weight cap: a push weighs at most `max_weight_ratio` (c) times the median of the other live
  learners' last weights. The median of the others, so that with two learners one cannot
  raise its own bound; the last weights rather than the open round's pushes, so that the cap
  is known when the push is summed. A liar in a round of n honest learners carries at most
  c/(n + c) of the weight. Until another live learner has pushed (in the state dir's
  life: a restart keeps the last weights and the guards' norms), nothing caps a push.
- Robust merge (`robust_merge` trimmed-mean): each push's Δ is kept for round.py's trimmed
  mean, so one push cannot steer a value beyond the others' range.
- `untrusted_learners` turns on the trimmed mean and holds each learner to 2/K of a round's
  weight (round.py's cap_shares), in rounds of K >= 3 (check_untrusted).
Not bounded: how often a learner pushes in async mode (the rate limits bound that), nor how
many inner steps a push claims beyond the weight cap. Called with the Aggregator's lock held.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import defaultdict, deque
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import TYPE_CHECKING

from common.errors import AlreadyExists, FailedPrecondition, InvalidArgument
from server.learners import Learner, Learners
from server.rounds.ingest import DenseBody, PushBody
from server.rounds.round import AddTicket, Round

if TYPE_CHECKING:  # policy.py builds on this module's weights
    from server.aggregator import AggregatorEvents
    from server.rounds.policy import RoundPolicy, RoundsConfig
    from server.state.fragment import FragmentState

log = logging.getLogger(__name__)

WEIGHTINGS = ("equal", "tokens", "tokens_squared_per_step")
ROBUST_MERGES = ("none", "trimmed-mean")
# No real pseudo-gradient comes near this; it keeps sums, momentum and the 4-bit encoding of
# the outer update finite whatever a learner sends.
MAX_DELTA_ABS = 1e12
# The round's float32 sum stays below this (float32 tops out at 3.4e38). A learner's claimed
# tokens and inner steps set its weight, and tokens²/steps reaches 8.5e37: weight times values
# could otherwise overflow to infinity, which the outer step cannot encode.
MAX_ROUND_SUM_ABS = 1e37
# A push's claimed tokens may exceed inner_steps x the declared tokens per step by this
# factor: our learners claim exactly that product; a library user whose batches vary
# declares their mean and stays within 10% over a push.
TOKEN_CLAIM_SLACK = 1.1
# The most tokens per step a learner may declare (a batch of 2^40 tokens is no real step).
MAX_TOKENS_PER_STEP = 2**40


def check_untrusted(config: RoundsConfig) -> None:
    """untrusted_learners' bound needs rounds of several pushes and the trimmed mean."""
    if config.mode == "async":
        raise ValueError(
            "untrusted_learners needs rounds of several pushes: use mode sync or quorum "
            "(in async mode each push is its own round)"
        )
    if config.robust_merge != "trimmed-mean":
        raise ValueError(
            f"untrusted_learners merges rounds with robust_merge trimmed-mean, got "
            f"robust_merge {config.robust_merge!r}: leave robust_merge unset"
        )
    if config.min_contributors < 3:
        raise ValueError(
            f"untrusted_learners needs min_contributors >= 3 (a trimmed mean of fewer "
            f"pushes drops nothing), got {config.min_contributors}"
        )


class PushRefused(ValueError):
    """The norm guard or the token-claim check refused the push. Its learner is excused from
    the open round, which then does not wait for it; nothing else is kept of the push, so its
    next one is taken as usual. The global parameters are untouched."""


class Admission:
    """The header and body rules of a push, its weight, and the per-fragment norm guards."""

    def __init__(
        self,
        config: RoundsConfig,
        policy: RoundPolicy,
        events: AggregatorEvents,
        clock: Callable[[], float],
    ) -> None:
        self.config, self._policy, self._events, self._clock = config, policy, events, clock
        ratio = config.max_norm_ratio
        self.norm_guards: defaultdict[int, NormGuard] = defaultdict(lambda: NormGuard(ratio))

    def durable(self, learners: Learners, fragment_id: int | None) -> dict:
        """What a restart must keep (the state dir records it): the recent norms of one
        fragment's guard (None: every fragment's) and each learner's last weight, the weight
        cap's reference. Without them the first pushes after a restart go unguarded."""
        fids = self.norm_guards if fragment_id is None else [fragment_id]
        return {
            "norms": {str(f): list(self.norm_guards[f].recent) for f in fids},
            "weights": {
                x.learner_id: x.last_weight
                for x in learners.everyone()
                if x.last_weight is not None
            },
        }

    def restore(self, state: dict, learners: Learners) -> None:
        """Take back what `durable` gave, as a state dir restores it."""
        for fid, norms in state.get("norms", {}).items():
            self.norm_guards[int(fid)].recent.extend(float(n) for n in norms)
        for learner_id, weight in state.get("weights", {}).items():
            learners.record(learner_id).last_weight = float(weight)

    def check_header(
        self, learner: Learner, fragment: FragmentState, base_version: int, initial: bool
    ) -> None:
        """Refuse a push (an initial one: `initial`) the fragment cannot take now."""
        if initial:
            if fragment.params is not None:
                raise AlreadyExists(
                    f"fragment {fragment.fragment_id} is already initialized at version "
                    f"{fragment.version}; pull it instead"
                )
            return
        if fragment.params is None:
            raise FailedPrecondition(f"fragment {fragment.fragment_id} has no parameters yet")
        if base_version > fragment.version:
            raise InvalidArgument(
                f"base_version {base_version} is from the future: fragment "
                f"{fragment.fragment_id} is at version {fragment.version}"
            )
        self._policy.check_base(fragment, learner, base_version)

    def admit(
        self,
        learner: Learner,
        fragment: FragmentState,
        base_version: int,
        body: PushBody | DenseBody,
        tokens: int,
        inner_steps: int,
        live: Collection[Learner],
        add_later: bool = False,
    ) -> AddTicket | None:
        """Check a push's body (its header passed), weigh it and add it to the fragment's
        round; returns its queued add's ticket, if any (Round.add). InvalidArgument for a
        bad body; PushRefused from the token-claim check or the norm guard (the learner is
        excused from the round; nothing else changes)."""
        rnd, fid = fragment.round, fragment.fragment_id
        check_shapes(fragment.fragment_id, fragment.shapes, body.shapes)
        if body.max_abs > MAX_DELTA_ABS:
            raise InvalidArgument(f"pseudo-gradient values exceed {MAX_DELTA_ABS:g} in magnitude")
        if tokens < 0 or inner_steps < 0:
            raise InvalidArgument("tokens and inner_steps must be >= 0")
        try:
            check_claim(tokens, inner_steps, learner.tokens_per_step)
        except ValueError as err:
            self._events.influence_bounded("claim_refused")
            raise refused(rnd, learner, err) from err
        weight, capped = self._weight(learner, tokens, inner_steps, live)
        discount = staleness_discount(fragment.version - base_version)
        _check_round_sum_fits(rnd, weight * discount, body.max_abs)
        guard = self.norm_guards[fid]
        try:
            guard.check(body.norm)
        except ValueError as err:
            raise refused(rnd, learner, err) from err
        keep = self.config.robust_merge == "trimmed-mean"
        now = self._clock()
        ticket = rnd.add(learner.learner_id, body, tokens, weight, discount, keep, add_later, now)
        learner.push_bases[fid] = base_version
        learner.last_weight = weight
        learner.pushed_tokens[fid] = learner.pushed_tokens.get(fid, 0) + tokens
        learner.last_push = (fid, fragment.version + 1, now)
        guard.record(body.norm)
        self._policy.accepted(rnd)
        if capped:
            self._events.influence_bounded("weight_capped")
        self._events.contribution(fragment.version - base_version)
        log.info(
            "learner=%s pushed fragment=%d base=%d contributors=%d/%d",
            learner.learner_id,
            fid,
            base_version,
            len(rnd.contributors),
            len(live),
        )
        return ticket

    def _weight(
        self, learner: Learner, tokens: int, inner_steps: int, live: Collection[Learner]
    ) -> tuple[float, bool]:
        """How much a push counts (before the staleness discount), and whether the weight
        cap lowered its claim."""
        try:
            claimed = contribution_weight(self.config.weighting, tokens, inner_steps)
        except ValueError as err:
            raise InvalidArgument(str(err)) from err
        others = [
            other.last_weight
            for other in live
            if other is not learner and other.last_weight is not None
        ]
        weight = capped_weight(claimed, others, self.config.max_weight_ratio)
        return weight, weight < claimed


def refused(rnd: Round, learner: Learner, err: ValueError) -> PushRefused:
    """A refusal of `learner`'s push for `err`: it is excused from the round (which then
    does not wait for it) and counted against it (the status page's refused pushes)."""
    rnd.excuse(learner.learner_id)
    learner.refused += 1
    return PushRefused(str(err))


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


def check_tokens_per_step(tokens_per_step: int) -> None:
    """InvalidArgument unless a declared tokens_per_step is 0 (none) or a sane count."""
    if not 0 <= tokens_per_step <= MAX_TOKENS_PER_STEP:
        raise InvalidArgument(
            f"tokens_per_step {tokens_per_step} is out of range: declare 0 (none) or the "
            f"tokens of one inner step, at most 2^40"
        )


def check_claim(tokens: int, inner_steps: int, tokens_per_step: int) -> None:
    """Raise ValueError (the reason) if a push claims more tokens than its inner steps at the
    declared rate allow; a learner that declared none (0) is not checked."""
    if tokens_per_step and 10 * tokens > 11 * inner_steps * tokens_per_step:
        raise ValueError(
            f"push claims {tokens} tokens for {inner_steps} inner steps, more than "
            f"{TOKEN_CLAIM_SLACK:g} x the {tokens_per_step} tokens per step declared at Join"
        )


def capped_weight(weight: float, others: Iterable[float], max_ratio: float) -> float:
    """`weight`, at most `max_ratio` times the median of `others` (the other live learners'
    last weights); unchanged when the cap is off (0) or there are no others."""
    others = list(others)
    if not max_ratio or not others:
        return weight
    return min(weight, max_ratio * statistics.median(others))


def check_shapes(
    fragment_id: int, expected: Sequence[tuple[int, ...]], shapes: Sequence[tuple[int, ...]]
) -> None:
    """Refuse tensors whose count or shapes are not the fragment's."""
    shapes = [tuple(s) for s in shapes]
    if shapes != list(expected):
        raise InvalidArgument(
            f"fragment {fragment_id} expects {len(expected)} tensors with shapes "
            f"{list(expected)}, got {shapes}"
        )


def _check_round_sum_fits(rnd: Round, scale: float, max_abs: float) -> None:
    if not rnd.abs_bound + scale * max_abs <= MAX_ROUND_SUM_ABS:
        raise InvalidArgument(
            f"contribution weight {scale:.3g} (from tokens and inner_steps) times values up to "
            f"{max_abs:.3g} would overflow the round's sum; send the real tokens and inner_steps"
        )


class NormGuard:
    """Refuses a pseudo-gradient whose norm is far above the recent median for its fragment.

    A poisoned or exploding update would otherwise move the global model arbitrarily far in
    one round. The first `warmup` pushes are only recorded: there is no median to compare to.
    """

    def __init__(self, max_ratio: float, window: int = 32, warmup: int = 4) -> None:
        self.max_ratio = max_ratio
        self.warmup = warmup
        self.recent: deque[float] = deque(maxlen=window)

    def check(self, norm: float) -> None:
        """Raise ValueError (with the reason) if `norm` is out of bounds; records nothing."""
        if not math.isfinite(norm):
            raise ValueError("pseudo-gradient norm is not finite")
        if self.max_ratio <= 0 or len(self.recent) < self.warmup:
            return
        median = statistics.median(self.recent)
        if median > 0 and norm > self.max_ratio * median:
            raise ValueError(
                f"pseudo-gradient norm {norm:.4g} is {norm / median:.1f}x the recent median "
                f"{median:.4g} (max_norm_ratio {self.max_ratio:g})"
            )

    def record(self, norm: float) -> None:
        self.recent.append(norm)

    def median(self) -> float | None:
        """The recent median norm, once past the warm-up (None before)."""
        if len(self.recent) < max(1, self.warmup):
            return None
        return statistics.median(self.recent)
