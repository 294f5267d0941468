"""The round policies on their own: what each mode refuses, when its rounds close, its optimizer."""

import pytest
import torch

from common.errors import AlreadyExists, FailedPrecondition
from server.learners import Learner
from server.rounds.ingest import DenseBody
from server.rounds.outer import DelayedNesterov, NesterovOuter, OuterConfig
from server.rounds.policy import (
    MODES,
    POLICIES,
    Async,
    Quorum,
    RoundPolicy,
    RoundsConfig,
    Sync,
    round_policy,
)
from server.state.fragment import FragmentState
from tests.support.fakes import FakeClock


def policy(clock: FakeClock | None = None, outer: OuterConfig | None = None, **rounds):
    return round_policy(RoundsConfig(**rounds), outer or OuterConfig(), clock or FakeClock())


def fragment(rules: RoundPolicy, version: int = 0) -> FragmentState:
    state = FragmentState(0, [0], [(4,)], rules.new_outer(), "fp32", 16)
    state.initialize([torch.zeros(4)])
    state.version = version
    return state


# The learners' records, by id: their last weights and push bases, as admission leaves them.
LEARNERS: dict[str, Learner] = {}


def learner(name: str) -> Learner:
    return LEARNERS.setdefault(name, Learner(name, session_id=f"s-{name}", lease_deadline=1e9))


@pytest.fixture(autouse=True)
def fresh_learners():
    LEARNERS.clear()


def push(rules: RoundPolicy, state: FragmentState, name: str, weight: float = 1.0) -> None:
    state.round.add(name, DenseBody([torch.ones(4)]), tokens=10, weight=weight, now=rules._clock())
    learner(name).last_weight = weight
    rules.accepted(state.round)


def live(*learners: str) -> list[Learner]:
    return [learner(name) for name in learners]


def test_the_mode_picks_the_policy_and_every_mode_has_one() -> None:
    assert set(POLICIES) == set(MODES)
    for mode, cls in [("sync", Sync), ("quorum", Quorum), ("async", Async)]:
        assert type(policy(mode=mode)) is cls


def test_sync_refuses_stale_and_repeated_pushes_and_waits_for_everyone() -> None:
    rules = policy(mode="sync", min_contributors=2, max_staleness=4)
    state = fragment(rules, version=3)
    with pytest.raises(FailedPrecondition, match="stale push"):
        rules.check_base(state, learner("a"), base_version=2)
    rules.check_base(state, learner("a"), base_version=3)
    push(rules, state, "a")
    learner("a").push_bases[state.fragment_id] = 3
    with pytest.raises(AlreadyExists, match="retried push"):
        rules.check_base(state, learner("a"), base_version=3)
    assert not rules.ready(state.round, live("a", "b"))
    assert not rules.ready(state.round, live("a"))  # everyone, but below min_contributors
    push(rules, state, "b")
    assert rules.ready(state.round, live("a", "b"))
    assert rules.expected_weight(state.round, live("a", "b")) == 0.0
    assert isinstance(state.outer, NesterovOuter)


def test_sync_refuses_a_second_push_to_the_same_round() -> None:
    rules = policy(mode="sync")
    state = fragment(rules)
    push(rules, state, "a")  # its base is not on record: not caught as a retry
    with pytest.raises(AlreadyExists, match="already pushed for version 1"):
        rules.check_base(state, learner("a"), base_version=0)


def test_quorum_takes_stale_pushes_and_closes_after_the_grace_window() -> None:
    clock = FakeClock()
    rules = policy(
        clock,
        mode="quorum",
        min_contributors=1,
        max_staleness=2,
        grace_steps=5,
        grace_min_s=1.0,
        grace_max_s=60.0,
    )
    state = fragment(rules, version=5)
    rules.check_base(state, learner("a"), base_version=3)
    with pytest.raises(FailedPrecondition, match="too stale"):
        rules.check_base(state, learner("a"), base_version=2)
    sessions = live("a", "b")
    sessions[0].step_time_s = sessions[1].step_time_s = 2.0
    assert not rules.ready(state.round, sessions)  # nothing pushed yet
    clock.now = 100.0
    push(rules, state, "a", weight=3.0)
    assert state.round.quorum_since == 100.0
    clock.now = 109.9  # the window is 5 median steps of 2 s
    assert not rules.ready(state.round, sessions)
    clock.now = 110.0
    assert rules.ready(state.round, sessions)
    # A partial round counts as its part of the live learners' usual weight: b's last push
    # is unknown, so it counts at this round's average.
    assert rules.expected_weight(state.round, sessions) == 6.0
    learner("b").last_weight = 1.0
    assert rules.expected_weight(state.round, sessions) == 4.0
    off = policy(mode="quorum", scale_partial_rounds=False)
    assert off.expected_weight(state.round, sessions) == 0.0


def test_async_closes_every_push_with_delayed_nesterov_following_the_learners() -> None:
    rules = policy(mode="async")
    state = fragment(rules)
    assert isinstance(state.outer, DelayedNesterov)
    assert not rules.ready(state.round, live("a", "b"))
    push(rules, state, "a")
    assert rules.ready(state.round, live("a", "b", "c"))
    assert rules.before_close(state, live=3) == 3 and state.outer.every == 3
    rules.before_replay(state, logged=5)
    assert state.outer.every == 5
    fixed = policy(mode="async", async_momentum_every=2)
    pinned = fragment(fixed)
    assert fixed.before_close(pinned, live=7) == 2 and pinned.outer.every == 2


def test_the_outer_warm_up_reaches_nesterov_outside_async() -> None:
    outer = OuterConfig(outer_momentum_warmup_rounds=10, outer_momentum_warmup_start=0.2)
    state = fragment(policy(mode="quorum", outer=outer))
    assert state.outer.warmup_rounds == 10 and state.outer.warmup_start == 0.2
    plain = OuterConfig(outer_momentum_warmup_rounds=0)
    assert fragment(policy(mode="sync", outer=plain)).outer.warmup_rounds == 0
