"""Bounded influence: the weight cap, token claims checked against Join, the robust merges."""

import pytest
import torch

from common.config import build_config
from common.errors import AlreadyExists, FailedPrecondition, InvalidArgument
from server.aggregator import Aggregator
from server.config import AggregatorConfig, aggregator_config
from server.rounds.admission import capped_weight, check_claim, clip_scale
from server.rounds.round import trim_count, trimmed_mean_into
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


def test_clip_to_median_shrinks_a_large_push_to_the_recent_median_norm() -> None:
    assert clip_scale(10.0, 2.0) == 0.2 and clip_scale(1.0, 2.0) == 1.0
    assert clip_scale(10.0, None) == 1.0
    agg, (a, b), get = make(2, mode="sync", robust_merge="clip-to-median", max_norm_ratio=0.0)
    for version in range(2):  # four pushes of norm 2 (|[1,1,1,1]|): the median is known
        push(agg, a, version, 1.0)
        push(agg, b, version, 1.0)
    push(agg, a, 2, 1.0)
    push(agg, b, 2, -9.0)  # norm 18, clipped to 2: −1 per value, its weight in full
    assert value(agg) == pytest.approx(-2.0 - (1.0 - 1.0) / 2)
    assert get("diloco_server_bounded_contributions_total", {"action": "norm_clipped"}) == 1


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"robust_merge": "median"}, "robust_merge must be one of"),
        ({"robust_merge": "trimmed-mean", "mode": "async"}, "in async mode use clip-to-median"),
        ({"trim_fraction": 0.5}, "trim_fraction must be in"),
        ({"max_weight_ratio": 0.5}, "max_weight_ratio must be 0"),
    ],
)
def test_bad_settings_name_the_field(settings: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_config(AggregatorConfig, settings)
