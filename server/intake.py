"""What a push must pass before it counts, and how it joins its fragment's round.

Header rules, checked before the payload is read so that a stale or duplicate push costs no
bandwidth: the fragment has parameters (an initial push: has none yet), the base version is
not from the future, and the mode's policy takes the push (server/rounds.py). Body rules: the
shapes are the fragment's, the claimed tokens fit the rate declared at Join, values and
weights stay far from float32 overflow, and the norm guard (server/policy.py) refuses an
update far larger than the fragment's recent ones. The weight cap and the robust merge
(server/influence.py) then bound what an accepted push adds. Called with the Aggregator's
lock held.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Sequence

from common.errors import AlreadyExists, FailedPrecondition, InvalidArgument
from server.events import AggregatorEvents
from server.fragment import FragmentState, Round
from server.global_params import GlobalParams
from server.influence import check_claim, clip_scale
from server.ingest import DenseBody, PushBody
from server.membership import Membership, Session
from server.policy import NormGuard, staleness_discount
from server.round_adds import AddTicket
from server.rounds import RoundPolicy

log = logging.getLogger(__name__)

# No real pseudo-gradient comes near this; it keeps sums, momentum and the 4-bit encoding of
# the outer update finite whatever a learner sends.
MAX_DELTA_ABS = 1e12


# The round's float32 sum stays below this (float32 tops out at 3.4e38). A learner's claimed
# tokens and inner steps set its weight, and tokens²/steps reaches 8.5e37: weight times values
# could otherwise overflow to infinity, which the outer step cannot encode, and every later
# round of the fragment would fail with it.
MAX_ROUND_SUM_ABS = 1e37


class PushRefused(ValueError):
    """The norm guard or the token-claim check refused the push. Its learner is excused from
    the open round, which then does not wait for it; nothing else is kept of the push, so its
    next one (a new try at this round, or at the next) is taken as usual. The global
    parameters are untouched."""


class PushIntake:
    """The header and body rules of a push, and the per-fragment norm guards."""

    def __init__(
        self,
        members: Membership,
        params: GlobalParams,
        rounds: RoundPolicy,
        events: AggregatorEvents,
    ) -> None:
        self._members, self._params, self._rounds = members, params, rounds
        self._robust_merge, self._events = rounds.config.robust_merge, events
        max_norm_ratio = rounds.config.max_norm_ratio
        self.norm_guards: defaultdict[int, NormGuard] = defaultdict(
            lambda: NormGuard(max_norm_ratio)
        )  # per fragment

    def check_header(
        self, session_id: str, fragment_id: int, base_version: int, initial: bool
    ) -> tuple[Session, FragmentState]:
        """The push's session (its lease renewed) and fragment; refuses a push (an initial
        one: `initial`) the fragment cannot take now."""
        session = self._members.renew(session_id)
        fragment = self._params.fragment(fragment_id)
        if initial:
            if fragment.params is not None:
                raise AlreadyExists(
                    f"fragment {fragment_id} is already initialized at version "
                    f"{fragment.version}; pull it instead"
                )
            return session, fragment
        if fragment.params is None:
            raise FailedPrecondition(f"fragment {fragment_id} has no parameters yet")
        if base_version > fragment.version:
            raise InvalidArgument(
                f"base_version {base_version} is from the future: fragment {fragment_id} "
                f"is at version {fragment.version}"
            )
        self._rounds.check_base(fragment, session.learner_id, base_version)
        return session, fragment

    def add(
        self,
        session: Session,
        fragment: FragmentState,
        base_version: int,
        body: PushBody | DenseBody,
        tokens: int,
        inner_steps: int,
        add_later: bool = False,
    ) -> AddTicket | None:
        """Check a push's body (its header passed) and add it to the fragment's round;
        returns its queued add's ticket, if any (`add_later`: see FragmentState.add).
        InvalidArgument for a bad body; PushRefused from the token-claim check or the norm
        guard (the learner is excused from the round; nothing else changes)."""
        learner_id = session.learner_id
        check_shapes(fragment, body.shapes)
        if body.max_abs > MAX_DELTA_ABS:
            raise InvalidArgument(f"pseudo-gradient values exceed {MAX_DELTA_ABS:g} in magnitude")
        if tokens < 0 or inner_steps < 0:
            raise InvalidArgument("tokens and inner_steps must be >= 0")
        try:
            check_claim(tokens, inner_steps, session.tokens_per_step)
        except ValueError as err:
            self._events.influence_bounded("claim_refused")
            fragment.round.excused.add(learner_id)
            raise PushRefused(str(err)) from err
        live = self._members.live()
        weight, capped = self._rounds.weight(learner_id, tokens, inner_steps, live)
        discount = staleness_discount(fragment.version - base_version)
        _check_round_sum_fits(fragment.round, weight * discount, body.max_abs)
        guard = self.norm_guards[fragment.fragment_id]
        try:
            guard.check(body.norm)
        except ValueError as err:
            fragment.round.excused.add(learner_id)
            raise PushRefused(str(err)) from err
        clip = 1.0
        if self._robust_merge == "clip-to-median":
            clip = clip_scale(body.norm, guard.median())
        keep = self._robust_merge == "trimmed-mean"
        ticket = fragment.add(
            learner_id, body, tokens, weight, discount * clip, keep=keep, add_later=add_later
        )
        fragment.last_push_base[learner_id] = base_version
        guard.record(body.norm)
        self._rounds.accepted(fragment.round, learner_id, weight)
        if capped:
            self._events.influence_bounded("weight_capped")
        if clip < 1.0:
            self._events.influence_bounded("norm_clipped")
        log.info(
            "learner=%s pushed fragment=%d base=%d contributors=%d/%d",
            learner_id,
            fragment.fragment_id,
            base_version,
            len(fragment.round.contributors),
            len(self._members.live()),
        )
        return ticket


def check_shapes(fragment: FragmentState, shapes: Sequence[tuple[int, ...]]) -> None:
    """Refuse tensors whose count or shapes are not the fragment's."""
    shapes = [tuple(s) for s in shapes]
    if shapes != fragment.shapes:
        raise InvalidArgument(
            f"fragment {fragment.fragment_id} expects {len(fragment.shapes)} tensors with "
            f"shapes {fragment.shapes}, got {shapes}"
        )


def _check_round_sum_fits(rnd: Round, scale: float, max_abs: float) -> None:
    if not rnd.abs_bound + scale * max_abs <= MAX_ROUND_SUM_ABS:
        raise InvalidArgument(
            f"contribution weight {scale:.3g} (from tokens and inner_steps) times values up to "
            f"{max_abs:.3g} would overflow the round's sum; send the real tokens and inner_steps"
        )
