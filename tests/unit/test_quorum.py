"""quorum and async modes: grace window, weighting, staleness; a fake clock, no sleeps."""

import pytest
import torch

from common.errors import AlreadyExists, FailedPrecondition, InvalidArgument
from server.aggregator import Aggregator
from server.config import aggregator_config
from server.rounds.admission import contribution_weight, staleness_discount
from server.rounds.outer import DelayedNesterov, NesterovOuter
from server.rounds.policy import grace_window_s
from server.state.params import ParamSpec
from tests.support.fakes import FakeClock

SPECS = [ParamSpec("w", (4,), "float32")]


def make(n: int, **config):
    clock = FakeClock()
    # The expected steps below are torch's Nesterov SGD exactly: no momentum warm-up.
    config = {"pull_codec": "fp32", "outer_momentum_warmup_rounds": 0, **config}
    agg = Aggregator(aggregator_config(**config), clock=clock)
    sessions = [agg.join(f"l{i}", SPECS).session_id for i in range(n)]
    agg.initialize(sessions[0], 0, [torch.zeros(4)])
    return agg, sessions, clock


def push(agg, session, base, value, tokens=100, steps=10):
    return agg.push(session, 0, base, [torch.full((4,), float(value))], tokens, steps)


def test_quorum_closes_after_the_grace_window_without_the_straggler() -> None:
    agg, (a, b, c), clock = make(
        3, mode="quorum", min_contributors=2, grace_steps=5, grace_min_s=0.0, grace_max_s=60.0
    )
    for s in (a, b, c):
        agg.heartbeat(s, step_time_s=0.2)  # grace = 5 * 0.2 s = 1 s
    push(agg, a, 0, 1.0)
    agg.tick()
    assert agg.version(0) == 0  # one push: below K
    clock.now = 0.5
    push(agg, b, 0, 1.0)  # K reached at t = 0.5
    clock.now = 1.4
    agg.tick()
    assert agg.version(0) == 0  # still inside the window
    clock.now = 1.5
    agg.tick()
    assert agg.version(0) == 1  # c never pushed; the round did not wait for it


def test_quorum_closes_at_once_when_every_live_learner_pushed() -> None:
    agg, (a, b), _ = make(2, mode="quorum", min_contributors=1, grace_min_s=30.0, grace_max_s=30.0)
    push(agg, a, 0, 1.0)
    assert agg.version(0) == 0
    push(agg, b, 0, 1.0)
    assert agg.version(0) == 1


def test_grace_window_is_bounded_and_uses_the_median() -> None:
    assert grace_window_s([0.1, 0.2, 10.0], 5, 0.0, 60.0) == pytest.approx(1.0)
    assert grace_window_s([100.0], 5, 0.0, 7.0) == 7.0
    assert grace_window_s([0.001], 5, 0.5, 7.0) == 0.5
    assert grace_window_s([], 5, 0.25, 7.0) == 0.25


def test_token_weighting_and_staleness_discount() -> None:
    assert contribution_weight("tokens_squared_per_step", 400, 4) == 40_000
    assert contribution_weight("tokens", 400, 4) == 400
    assert contribution_weight("equal", 0, 0) == 1
    with pytest.raises(ValueError, match="needs tokens"):
        contribution_weight("tokens", 0, 4)
    assert staleness_discount(0) == 1 and staleness_discount(3) == 0.25


def test_weighted_mean_drives_the_outer_step() -> None:
    # Plain SGD outer step (momentum 0, lr 1): the new value is minus the weighted mean.
    agg, (a, b), _ = make(
        2,
        mode="quorum",
        min_contributors=2,
        weighting="tokens",
        outer_lr=1.0,
        outer_momentum=0.0,
    )
    push(agg, a, 0, 1.0, tokens=300)
    push(agg, b, 0, 5.0, tokens=100)
    assert agg.params(0)[0].tolist() == [-2.0] * 4  # (300*1 + 100*5) / 400


def test_stale_contribution_is_discounted_then_refused_past_the_bound() -> None:
    agg, (a, b, c), _ = make(
        3,
        mode="quorum",
        min_contributors=2,
        weighting="equal",
        outer_lr=1.0,
        outer_momentum=0.0,
        max_staleness=2,
    )
    push(agg, a, 0, 1.0)
    push(agg, b, 0, 1.0)  # K = 2 reached, no step times reported: no grace, closes
    # Two of three live learners: a partial round takes 2/3 of the mean step.
    assert agg.version(0) == 1 and float(agg.params(0)[0][0]) == pytest.approx(-2 / 3)
    push(agg, a, 1, 2.0)  # fresh
    push(agg, c, 0, 2.0)  # c missed version 1: one stale, counts half, weight in full
    # Again two of three (b's last weight still expected): (2 + 0.5·2) / 3.
    assert float(agg.params(0)[0][0]) == pytest.approx(-2 / 3 - (2.0 + 0.5 * 2.0) / 3)
    agg.leave(b)
    agg.leave(c)
    push(agg, a, 2, 0.0)
    push(agg, a, 3, 0.0)
    with pytest.raises(FailedPrecondition, match="too stale"):
        push(agg, a, 1, 9.0)  # 3 behind, bound 2
    assert agg.version(0) == 4


def test_a_retried_push_counts_once() -> None:
    agg, (a, b), _ = make(2, mode="quorum", min_contributors=2, weighting="equal")
    push(agg, a, 0, 1.0)
    with pytest.raises(AlreadyExists, match="counts once"):
        push(agg, a, 0, 1.0)  # the same push again, e.g. retried after a lost reply
    push(agg, b, 0, 1.0)
    assert agg.version(0) == 1


def test_huge_or_malformed_input_is_refused_before_it_touches_state() -> None:
    agg, (a,), _ = make(1, mode="async", weighting="equal")
    with pytest.raises(InvalidArgument, match="exceed"):
        push(agg, a, 0, 3e38)
    assert agg.version(0) == 0 and agg.params(0)[0].tolist() == [0.0] * 4
    with pytest.raises(InvalidArgument, match="negative dimension"):
        agg.join("x", [ParamSpec("w", (-4,), "float32")])
    with pytest.raises(InvalidArgument, match="more than"):
        agg.join("x", [ParamSpec("w", (1 << 21, 1 << 21), "float32")])


def test_quorum_refuses_pushes_without_tokens_when_weighting_needs_them() -> None:
    agg, (a,), _ = make(1, mode="quorum")
    with pytest.raises(InvalidArgument, match="needs tokens"):
        push(agg, a, 0, 1.0, tokens=0)
    assert agg.version(0) == 0


def test_async_applies_every_push_with_delayed_nesterov() -> None:
    agg, (a, b), _ = make(2, mode="async", weighting="equal", outer_lr=0.5, outer_momentum=0.9)
    reference = DelayedNesterov(lr=0.5, momentum=0.9, every=2)
    expected = [torch.zeros(4)]
    for i, value in enumerate([1.0, 3.0, -2.0, 0.5]):
        push(agg, (a, b)[i % 2], i, value)
        assert agg.version(0) == i + 1  # no waiting for the other learner
        reference.step(expected, [torch.full((4,), value)])
        assert torch.equal(agg.params(0)[0], expected[0])


def test_delayed_nesterov_over_n_pushes_equals_one_nesterov_step_on_their_mean() -> None:
    grads = [[torch.tensor([1.0, -2.0])], [torch.tensor([3.0, 0.5])], [torch.tensor([0.0, 1.0])]]
    delayed, nesterov = DelayedNesterov(0.7, 0.9, every=3), NesterovOuter(0.7, 0.9)
    p_delayed, p_nesterov = [torch.zeros(2)], [torch.zeros(2)]
    for _ in range(2):
        for g in grads:
            delayed.step(p_delayed, g)
        nesterov.step(p_nesterov, [sum(g[0] for g in grads) / 3])
        torch.testing.assert_close(p_delayed[0], p_nesterov[0])


def partial_round_setup(n: int, scale: bool = True):
    """n learners in quorum mode, K = 1, a 10 s grace window; outer step = plain SGD."""
    return make(
        n,
        mode="quorum",
        outer_lr=1.0,
        outer_momentum=0.0,
        grace_min_s=10.0,
        grace_max_s=10.0,
        lease_s=100.0,
        scale_partial_rounds=scale,
    )


@pytest.mark.parametrize("scale, expected", [(True, 0.25), (False, 1.0)])
def test_a_partial_round_takes_a_partial_step(scale: bool, expected: float) -> None:
    agg, sessions, clock = partial_round_setup(4, scale)
    for s in sessions:  # a full round first: every learner now has a known weight
        push(agg, s, 0, 1.0)
    assert agg.version(0) == 1
    before = agg.params(0)[0].clone()
    push(agg, sessions[0], 1, 1.0)
    clock.now = 11.0  # the grace window passes with 1 of 4 learners in the round
    agg.tick()
    assert agg.version(0) == 2
    # θ ← θ - lr·mean(Δ): with scaling the missing three count as zero.
    assert torch.equal(agg.params(0)[0], before - expected)


def test_partial_rounds_weigh_learners_by_their_last_push() -> None:
    agg, (a, b), clock = partial_round_setup(2)
    push(agg, a, 0, 1.0, tokens=300, steps=10)  # w = 9000
    push(agg, b, 0, 1.0, tokens=100, steps=10)  # w = 1000: closes with everyone
    before = agg.params(0)[0].clone()
    push(agg, b, 1, 1.0, tokens=100, steps=10)  # alone: 1000 of the usual 10000
    clock.now = 11.0
    agg.tick()
    assert torch.allclose(agg.params(0)[0], before - 0.1)


def test_an_exploding_push_is_refused_and_does_not_stall_the_round() -> None:
    agg, (a, b), _ = make(2, mode="sync", max_norm_ratio=10.0, outer_lr=1.0, outer_momentum=0.0)
    for version in range(4):  # four normal rounds: norms 2, 2, 2, ... (|[1,1,1,1]| = 2)
        push(agg, a, version, 1.0)
        push(agg, b, version, 1.0)
    before = agg.params(0)[0].clone()
    with pytest.raises(FailedPrecondition, match=r"50\.0x the recent median"):
        push(agg, b, 4, 50.0)  # norm 100 = 50x the median
    assert agg.version(0) == 4 and torch.equal(agg.params(0)[0], before)  # untouched
    push(agg, a, 4, 1.0)  # the round closes with a's push alone: b was excused
    assert agg.version(0) == 5 and torch.equal(agg.params(0)[0], before - 1.0)
    push(agg, b, 5, 5.0)  # 5x the median: within the bound, accepted
    push(agg, a, 5, 1.0)
    assert agg.version(0) == 6


def test_norm_guard_off_and_warmup() -> None:
    from server.rounds.admission import NormGuard

    guard = NormGuard(max_ratio=0.0)
    for _ in range(10):
        guard.record(1.0)
    guard.check(1e9)  # off: anything finite passes
    with pytest.raises(ValueError, match="not finite"):
        guard.check(float("inf"))
    warming = NormGuard(max_ratio=2.0, warmup=4)
    warming.record(1.0)
    warming.check(100.0)  # not enough history yet
