"""Bounded influence: the weight cap, token claims checked against Join, the robust merges."""

import pytest
import torch

from common.config import build_config
from common.errors import AlreadyExists, FailedPrecondition, InvalidArgument
from server.aggregator import Aggregator
from server.config import AggregatorConfig, aggregator_config
from server.rounds.admission import capped_weight, check_claim
from server.rounds.round import share_capped, trim_count, trimmed_mean_into
from server.rpc.metrics import ServerMetrics
from server.state.params import ParamSpec
from tests.support.fakes import FakeClock

SPECS = [ParamSpec("w", (4,), "float32")]
PLAIN_SGD = dict(outer_lr=1.0, outer_momentum=0.0, pull_codec="fp32")


def make(n: int, tokens_per_step: int = 0, **config):
    """An aggregator whose outer step is θ ← θ − mean, its metrics, and n joined learners."""
    metrics = ServerMetrics()
    agg = Aggregator(aggregator_config(**PLAIN_SGD, **config), FakeClock(), events=metrics)
    sessions = [agg.join(f"l{i}", SPECS, tokens_per_step).session_id for i in range(n)]
    agg.initialize(sessions[0], 0, [torch.zeros(4)])
    return agg, sessions, metrics.registry.get_sample_value


def push(agg, session, base, value, tokens=100, steps=10):
    return agg.push(session, 0, base, [torch.full((4,), float(value))], tokens, steps)


def value(agg) -> float:
    (param,) = agg.params(0)
    assert torch.all(param == param[0])
    return float(param[0])


def test_capped_weight_is_c_times_the_median_of_the_others() -> None:
    assert capped_weight(1e9, [10.0, 20.0, 1e6], 4.0) == 80.0  # the median of the others: 20
    assert capped_weight(50.0, [10.0, 20.0, 30.0], 4.0) == 50.0  # within: unchanged
    assert capped_weight(1e9, [], 4.0) == 1e9  # nobody to compare with
    assert capped_weight(1e9, [10.0], 0.0) == 1e9  # off


def test_one_learner_claiming_huge_token_counts_is_capped() -> None:
    agg, (a, b, c), get = make(3, mode="quorum", min_contributors=3)
    push(agg, a, 0, 1.0)  # w = 100·100/10 = 1000
    push(agg, b, 0, 1.0)
    push(agg, c, 0, -10.0, tokens=10**6, steps=10)  # claims w = 1e11: capped at 4 x 1000
    # (1000·1 + 1000·1 + 4000·(−10)) / 6000, subtracted; uncapped it would be ≈ +10.
    assert value(agg) == pytest.approx(38000 / 6000)
    assert get("diloco_server_bounded_contributions_total", {"action": "weight_capped"}) == 1


def test_the_cap_leaves_learners_within_c_of_each_other_alone() -> None:
    agg, (a, b), get = make(2, mode="quorum", min_contributors=2, weighting="tokens")
    push(agg, a, 0, 1.0, tokens=300)
    push(agg, b, 0, 5.0, tokens=100)  # a is 3x b: under 4
    assert value(agg) == -2.0  # (300·1 + 100·5) / 400
    push(agg, b, 1, 0.0, tokens=100)
    push(agg, a, 1, 0.0, tokens=390)  # 3.9x b's last weight: still under
    assert get("diloco_server_bounded_contributions_total", {"action": "weight_capped"}) is None


def test_cap_off_lets_the_claim_decide() -> None:
    agg, (a, b, c), _ = make(3, mode="quorum", min_contributors=3, max_weight_ratio=0.0)
    push(agg, a, 0, 1.0)
    push(agg, b, 0, 1.0)
    push(agg, c, 0, -10.0, tokens=10**6, steps=10)
    assert value(agg) == pytest.approx(10.0, rel=1e-6)  # c alone decided the step


def test_a_learner_counts_once_in_a_round() -> None:
    agg, (a, b, c), _ = make(3, mode="quorum", min_contributors=2, weighting="equal")
    push(agg, a, 0, 1.0)
    push(agg, b, 0, 1.0)  # K = 2, no grace window: version 1
    push(agg, a, 1, 1.0)
    with pytest.raises(AlreadyExists, match="already pushed for version 2"):
        push(agg, a, 0, 1.0)  # another base: it would otherwise add its weight again
    assert agg.version(0) == 1


def test_a_claim_beyond_the_declared_rate_is_refused_and_changes_nothing() -> None:
    agg, (a, b, c), get = make(3, tokens_per_step=10, mode="quorum", min_contributors=3)
    push(agg, a, 0, 1.0, tokens=110, steps=10)  # 1.1 x 10 x 10: within the slack
    with pytest.raises(FailedPrecondition, match="claims 111 tokens for 10 inner steps"):
        push(agg, b, 0, -50.0, tokens=111, steps=10)
    assert agg.version(0) == 0 and value(agg) == 0.0
    assert get("diloco_server_bounded_contributions_total", {"action": "claim_refused"}) == 1
    push(agg, b, 0, 3.0, tokens=100, steps=10)  # not locked out: a true claim counts
    push(agg, c, 0, 2.0, tokens=100, steps=10)
    # Only the accepted pushes: (1210·1 + 1000·3 + 1000·2) / 3210 (a's w = 110²/10).
    assert agg.version(0) == 1 and value(agg) == pytest.approx(-6210 / 3210)


def test_a_refused_claim_excuses_its_learner_from_the_round() -> None:
    agg, (a, b), _ = make(2, tokens_per_step=10, mode="sync")
    push(agg, a, 0, 1.0)
    with pytest.raises(FailedPrecondition, match="declared at Join"):
        push(agg, b, 0, 1.0, tokens=10**6)
    assert agg.version(0) == 1 and value(agg) == -1.0  # closed with a alone: b excused


def test_undeclared_rates_and_bad_declarations() -> None:
    check_claim(10**9, 1, 0)  # nothing declared: unchecked
    with pytest.raises(ValueError, match="declared at Join"):
        check_claim(12, 1, 10)
    agg, (a,), _ = make(1, mode="async")
    for bad in (-1, 2**41):
        with pytest.raises(InvalidArgument, match="tokens_per_step"):
            agg.join("x", SPECS, bad)
    assert agg.live_learners() == ["l0"]  # the bad Joins opened nothing


def test_trimmed_mean_drops_the_extremes_value_by_value() -> None:
    assert [trim_count(k, 0.2) for k in (1, 2, 3, 5, 10, 16)] == [0, 0, 1, 1, 2, 3]
    pushes = [[torch.tensor([float(v), -float(v)])] for v in (1, 2, 3, 4, 100)]
    out = [torch.empty(2)]
    trimmed_mean_into(out, pushes, trim=1, scale=2.0)
    assert out[0].tolist() == [6.0, -6.0]  # 2 x mean(2, 3, 4)


def test_trimmed_mean_ignores_an_outlier_whatever_its_weight() -> None:
    agg, sessions, _ = make(4, mode="quorum", min_contributors=4, robust_merge="trimmed-mean")
    for s, v in zip(sessions, (1.0, 2.0, 3.0), strict=False):
        push(agg, s, 0, v)
    push(agg, sessions[3], 0, -1000.0, tokens=400)  # 16x the weight, capped at 4x
    assert value(agg) == -1.5  # mean(1, 2) with −1000 and 3 dropped


def test_trimmed_mean_keeps_the_partial_round_step() -> None:
    # K = 3 of 4, no step times reported: no grace window, a round closes at its third push.
    values = []
    for merge in ("none", "trimmed-mean"):
        agg, sessions, _ = make(4, mode="quorum", min_contributors=3, robust_merge=merge)
        for s in sessions[:3]:
            push(agg, s, 0, 2.0)  # three of four: 3/4 of the step
        values.append(value(agg))
    # Plain and trimmed mean agree when the pushes agree, the partial step included.
    assert values[0] == values[1] == -0.75 * 2.0


def test_share_capped_holds_every_weight_to_its_share_of_the_capped_total() -> None:
    capped = share_capped([1.0] * 7 + [100.0], 2 / 8)
    assert capped[:7] == [1.0] * 7 and capped[7] == pytest.approx(7 / 3)  # t = (7 + t) / 4
    assert max(capped) / sum(capped) == pytest.approx(2 / 8)
    assert share_capped([3.0, 1.0, 1.0, 1.0], 0.5) == [3.0, 1.0, 1.0, 1.0]  # within: unchanged
    two = share_capped([50.0, 40.0, 1.0, 1.0, 1.0], 0.4)  # the two largest capped alike
    assert two[0] == two[1] and max(two) / sum(two) == pytest.approx(0.4)
    with pytest.raises(ValueError, match="no capped weights fit"):
        share_capped([1.0, 5.0], 0.25)


def test_untrusted_learners_trims_and_caps_one_liar_in_a_round_of_four() -> None:
    agg, sessions, get = make(4, mode="quorum", min_contributors=4, untrusted_learners=True)
    for i, session in enumerate(sessions[:3]):
        push(agg, session, 0, 1.0 + i, tokens=1000)  # Δ 1, 2, 3 at weight 1e5 each
    push(agg, sessions[3], 0, -50.0, tokens=10**6)  # trimmed away; its weight 1e11 capped
    # The trimmed mean of (1, 2, 3, −50) drops −50 and 3: 1.5, a full round's step.
    assert value(agg) == pytest.approx(-1.5)
    share = get("diloco_server_round_max_weight_share", {"fragment": "0"})
    assert (
        share == pytest.approx(0.5)
        and get("diloco_server_weight_share_bound", {"fragment": "0"}) == 0.5
    )


def test_the_share_gauge_reports_an_uncapped_learner_above_its_bound() -> None:
    settings = dict(mode="quorum", min_contributors=3, weighting="tokens", max_weight_ratio=0.0)
    agg, (a, b, c), get = make(3, **settings)
    push(agg, a, 0, 1.0, tokens=100)
    push(agg, b, 0, 1.0, tokens=100)
    push(agg, c, 0, 1.0, tokens=700)  # 700 / 900 of the weight (the weight cap off)
    assert get("diloco_server_round_max_weight_share", {"fragment": "0"}) == pytest.approx(7 / 9)
    assert get("diloco_server_weight_share_bound", {"fragment": "0"}) == pytest.approx(2 / 3)


def test_a_capped_share_never_rounds_above_its_bound() -> None:
    # Weights whose exact level rounds up by an ulp: the share must still not exceed 2/K.
    weights = [964**2 / 7, 494**2 / 7, 4104**2 / 7]
    capped = share_capped(weights, 2 / 3)
    assert max(capped) / sum(capped) <= 2 / 3
    agg, sessions, get = make(3, mode="quorum", min_contributors=3, untrusted_learners=True)
    for session, tokens in zip(sessions, (964, 494, 4104), strict=True):
        push(agg, session, 0, 1.0, tokens=tokens, steps=7)
    share = get("diloco_server_round_max_weight_share", {"fragment": "0"})
    assert share <= get("diloco_server_weight_share_bound", {"fragment": "0"}) == 2 / 3


def test_untrusted_quorum_rounds_wait_for_min_contributors_even_when_everyone_pushed() -> None:
    agg, (a, b), _ = make(2, mode="quorum", min_contributors=3, untrusted_learners=True)
    push(agg, a, 0, 1.0)
    push(agg, b, 0, -50.0)  # both live learners pushed: not enough to trim a liar away
    assert agg.version(0) == 0
    c = agg.join("l2", SPECS).session_id
    push(agg, c, 0, 2.0)  # the third push: the trimmed mean of (1, −50, 2) is 1
    assert agg.version(0) == 1 and value(agg) == pytest.approx(-1.0)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"robust_merge": "median"}, "robust_merge must be one of"),
        ({"robust_merge": "trimmed-mean", "mode": "async"}, "each push is its own round"),
        ({"robust_merge": "clip-to-median"}, "bounds a push's size but not its direction"),
        ({"untrusted_learners": True, "mode": "async"}, "untrusted_learners needs rounds"),
        ({"untrusted_learners": True, "min_contributors": 2}, "min_contributors >= 3"),
        ({"untrusted_learners": True, "robust_merge": "none"}, "leave robust_merge unset"),
        ({"trim_fraction": 0.5}, "trim_fraction must be in"),
        ({"max_weight_ratio": 0.5}, "max_weight_ratio must be 0"),
    ],
)
def test_bad_settings_name_the_field(settings: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_config(AggregatorConfig, settings)
