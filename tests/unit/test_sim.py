"""bench/sim: virtual clock, link model, a hand-computed scenario, the reproductions' checks."""

import json
import math
from dataclasses import replace

import pytest

from bench.sim import cli
from bench.sim.engine import EventQueue, Link, VirtualClock
from bench.sim.goodput import FailureScenario, QuorumSetup, elastic_dp_goodput, quorum_goodput
from bench.sim.model import FragmentPlan, ModelSpec, allreduce_factor, bits_per_value
from bench.sim.reproduce import ordering_problems, table4_methods
from bench.sim.shards import ShardTier, measured_cpu_s_per_gb, shards_needed, simulate_shards
from bench.sim.throughput import Method, Scenario, required_bandwidth, simulate
from server.state.params import fragment_owners

# -- virtual clock and event queue -------------------------------------------------------


def test_events_run_in_time_order_ties_in_scheduling_order() -> None:
    clock = VirtualClock()
    queue = EventQueue(clock)
    seen = []
    queue.at(2.0, lambda: seen.append(("b", clock())))
    queue.at(1.0, lambda: seen.append(("a", clock())))
    queue.at(2.0, lambda: seen.append(("c", clock())))
    queue.at(5.0, lambda: seen.append(("late", clock())))
    assert queue.run(until_s=3.0, max_events=10) == 3
    assert seen == [("a", 1.0), ("b", 2.0), ("c", 2.0)]
    assert clock() == 3.0  # the clock reaches `until` even with nothing left to run then
    assert len(queue) == 1


def test_events_scheduled_by_events_run_and_the_clock_never_goes_back() -> None:
    clock = VirtualClock()
    queue = EventQueue(clock)
    seen = []
    queue.at(1.0, lambda: queue.after(0.5, lambda: seen.append(clock())))
    queue.run(until_s=10.0, max_events=10)
    assert seen == [1.5]
    with pytest.raises(ValueError, match="before the clock"):
        queue.at(9.0, lambda: None)
    with pytest.raises(ValueError, match="cannot go back"):
        clock.advance_to(2.0)


def test_a_run_that_never_advances_is_bounded() -> None:
    clock = VirtualClock()
    queue = EventQueue(clock)

    def again() -> None:
        queue.after(0.0, again)

    queue.at(0.0, again)
    with pytest.raises(RuntimeError, match="ran 100 events"):
        queue.run(until_s=1.0, max_events=100)


# -- link model -----------------------------------------------------------------------------


def test_link_serialises_fifo_and_pipelines_latency() -> None:
    link = Link(bandwidth_bps=8e6, latency_s=0.1)  # 1 MB/s
    assert link.send(ready_s=0.0, payload_bytes=1e6) == pytest.approx((0.0, 1.1))
    # Ready at 0.5 but the link is busy until 1.0: it waits, then takes 0.5 s, plus latency.
    assert link.send(ready_s=0.5, payload_bytes=5e5) == pytest.approx((1.0, 1.6))
    # Ready after the link is free: no queueing.
    assert link.send(ready_s=3.0, payload_bytes=0) == pytest.approx((3.0, 3.1))
    assert link.bytes_sent == 1_500_000
    assert link.busy_s == pytest.approx(1.5)


def test_link_peak_rate_per_window() -> None:
    link = Link(bandwidth_bps=100.0, window_s=1.0)
    link.send(ready_s=0.0, payload_bytes=5)  # 40 bits: 0.4 s of window 0
    link.send(ready_s=2.5, payload_bytes=50)  # 400 bits: 2.5 .. 6.5 s, windows 3-5 full
    assert link.peak_bps() == pytest.approx(100.0)
    assert link.peak_bps(from_s=7.0) == 0.0
    short = Link(bandwidth_bps=100.0, window_s=1.0)
    short.send(ready_s=0.0, payload_bytes=5)
    assert short.peak_bps() == pytest.approx(40.0)


def test_link_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="bandwidth_bps"):
        Link(bandwidth_bps=0)
    with pytest.raises(ValueError, match="payload_bytes"):
        Link(bandwidth_bps=1.0).send(0.0, -1)


# -- model and wire sizes -----------------------------------------------------------------


def test_fp4_bits_per_value_come_from_the_codec() -> None:
    assert bits_per_value("fp4_e2m1") == pytest.approx(4.25)
    assert bits_per_value("fp4_e3m0") == pytest.approx(4.25)
    assert bits_per_value("bf16") == 16
    assert allreduce_factor(2) == 1.0
    assert allreduce_factor(4) == 1.5
    assert allreduce_factor(1) == 0.0


def test_model_of_size_and_fragments_of_three_layers() -> None:
    spec = ModelSpec.of_size(1e9, 24, vocab_size=0)
    assert spec.total_params == pytest.approx(1e9, rel=0.01)
    plan = FragmentPlan.build(spec, 8, "bf16")
    assert plan.total_bytes == 2 * spec.total_params
    # Strided: fragment p holds blocks p, p+8, p+16 (ln_f, outside the blocks, joins one).
    assert {s for s in plan.stage_bytes[0] if s < 24} == {0, 8, 16}
    assert {s for s in plan.stage_bytes[7] if s < 24} == {7, 15, 23}


# -- a hand-computed scenario ---------------------------------------------------------------


def test_data_parallel_utilisation_computed_by_hand() -> None:
    """2 blocks of d = 8 (784 values each, 1568 bytes in bf16) and a final norm (8 values,
    16 bytes); step 3 s: forward 0.5 s per block, backward 1 s per block. At 12,544 bit/s a
    block's gradient takes exactly 1 s on the link (K = 2: the ring moves the payload once).

    Step n starts at t: backward 1 … 3; block 1's gradient goes at t+2 and is in at t+3;
    block 0's goes at t+3 and is in at t+4. The next forward needs block 0 first, so it
    waits 1 s: every step takes 4 s for 3 s of compute: 75 % utilisation."""
    spec = ModelSpec(layers=2, d_model=8, vocab_size=0)
    scenario = Scenario(spec=spec, step_time_s=3.0, replicas=2)
    result = simulate(scenario, Method(name="dp"), bandwidth_bps=1568 * 8 / 1.0)
    assert result.utilisation == pytest.approx(0.75)
    assert result.blocked_s_per_step == pytest.approx(1.0)
    assert result.bytes_per_link_per_step == 2 * 1568 + 16
    assert result.largest_sync_bytes == 2 * 1568 + 16
    # Bisection finds the same point from the other side.
    needed = required_bandwidth(scenario, Method(name="dp"), 0.75, lo_bps=100.0)
    assert needed == pytest.approx(1568 * 8, rel=0.01)
    # Enough bandwidth hides everything (the tail is block 0's transfer only).
    assert simulate(scenario, Method(name="dp"), 1e12).utilisation == pytest.approx(1.0, abs=1e-6)


def test_more_bandwidth_never_lowers_utilisation() -> None:
    scenario = Scenario(spec=ModelSpec.of_size(1e9, 24, vocab_size=0), step_time_s=0.1)
    method = table4_methods(24)["Streaming DiLoCo w/ overlapped com."]
    values = [simulate(scenario, method, g * 1e9).utilisation for g in (0.5, 1, 2, 4, 8, 16)]
    assert values == sorted(values)
    assert values[0] < 0.6 < values[-1]


def test_methods_rank_as_in_the_paper_for_1b_at_90_percent() -> None:
    scenario = Scenario(spec=ModelSpec.of_size(1e9, 24, vocab_size=0), step_time_s=0.1)
    needed = [required_bandwidth(scenario, m, 0.9) for m in table4_methods(24).values()]
    assert needed == sorted(needed, reverse=True)
    assert needed[0] / needed[-1] > 50  # DP against overlapped FP4 Streaming DiLoCo


def test_ordering_check_flags_a_swap_and_accepts_paper_ties() -> None:
    rows = [
        {"model": "1B", "method": "a", "paper_gbps": [2.0] * 5, "ours_gbps": [1.0] * 5},
        {"model": "1B", "method": "b", "paper_gbps": [1.0] * 5, "ours_gbps": [3.0] * 5},
        {"model": "1B", "method": "c", "paper_gbps": [1.0] * 5, "ours_gbps": [0.5] * 5},
    ]
    problems = ordering_problems(rows)
    assert len(problems) == 5  # a over b swapped at each target; a over c holds; b = c tie
    assert all("a above b" in p for p in problems)


# -- goodput -----------------------------------------------------------------------------


class _Scripted(FailureScenario):
    def failures(self, units: int) -> list[tuple[float, int]]:
        return [(10.0, 0), (15.0, 0)]


def test_elastic_dp_goodput_computed_by_hand() -> None:
    """Failure at 10 s loses 10 mod 3 = 1 s of step and stops the job until 20 s; the one at
    15 s pushes that to 25 s. Down 15 s of 100: uptime 85 %, goodput 84 %."""
    result = elastic_dp_goodput(_Scripted(recovery_s=10.0, step_time_s=3.0, duration_s=100.0))
    assert result.uptime == pytest.approx(0.85)
    assert result.goodput == pytest.approx(0.84)


SMALL = QuorumSetup(learners=4, model_params=1e6, layers=4, bandwidth_bps=1e9)


def test_quorum_without_failures_uses_every_step() -> None:
    scenario = FailureScenario(chips=64, failures_per_chip_year=0.0, duration_s=600.0)
    result = quorum_goodput(scenario, SMALL)
    assert result.failures == 0 and result.pushes_refused == 0
    assert result.goodput == pytest.approx(1.0, abs=1e-3)


def test_quorum_loses_only_the_failed_learners_work() -> None:
    """One learner out of 4 down for 60 s of 600: about 1/4 · 60/600 of the capacity, plus
    its unpushed steps; the other learners keep going."""
    scenario = _Scripted(chips=64, recovery_s=60.0, step_time_s=0.8, duration_s=600.0)
    result = quorum_goodput(scenario, SMALL)
    assert result.uptime == pytest.approx(1 - 0.25 * 60 / 600, abs=0.005)
    assert 0.85 < result.goodput < result.uptime
    dp = elastic_dp_goodput(scenario)
    assert dp.goodput < result.goodput  # the same failure stops every DP chip


def test_required_bandwidth_is_infinite_when_latency_is_the_limit() -> None:
    scenario = Scenario(
        spec=ModelSpec(layers=2, d_model=8, vocab_size=0), step_time_s=0.1, latency_s=1.0
    )
    assert math.isinf(required_bandwidth(scenario, Method(name="dp"), 0.5))


# -- the shard tier ------------------------------------------------------------------------


def small_shard_case(cpu_fragment_s: float, learners: int = 2):
    """Six one-layer fragments, one pushed per 1 s step, τ = 5 steps; each fragment's round
    costs a shard `cpu_fragment_s` of ingest CPU (NIC and learner links far faster)."""
    spec = ModelSpec(layers=6, d_model=64, vocab_size=0)
    scenario = Scenario(spec=spec, step_time_s=1.0, replicas=learners)
    method = Method(name="streaming", sync_every_steps=6, fragments=6, overlap_steps=5)
    fragment_gb = learners * FragmentPlan.build(spec, 6, "bf16").fragment_bytes[0] / 1e9
    tier = ShardTier(shards=1, nic_bps=1e15, learner_bps=1e15, cpu_s_per_gb=1.0)
    return scenario, method, replace(tier, cpu_s_per_gb=cpu_fragment_s / fragment_gb)


def test_shards_own_fragments_by_the_servers_rule() -> None:
    scenario, method, tier = small_shard_case(cpu_fragment_s=0.001)
    plan = FragmentPlan.build(scenario.spec, 6, "bf16")
    assert plan.fragment_values == tuple(b // 2 for b in plan.fragment_bytes)  # bf16: 2 B/value
    busy = simulate_shards(scenario, method, replace(tier, shards=2)).shard_busy
    owners = fragment_owners([4 * n for n in plan.fragment_values], 2)
    assert sorted(owners) == [0, 0, 0, 1, 1, 1] and len(busy) == 2
    with pytest.raises(ValueError, match="own none"):
        simulate_shards(scenario, method, replace(tier, shards=7))


def test_a_shard_that_queues_fragments_stalls_and_more_shards_relieve_it() -> None:
    # 2 s of CPU per fragment, a fragment every 1 s: one shard falls behind and the
    # learners wait; with three shards each takes two fragments per 6 s and keeps up.
    scenario, method, tier = small_shard_case(cpu_fragment_s=2.0)
    one = simulate_shards(scenario, method, tier)
    three = simulate_shards(scenario, method, replace(tier, shards=3))
    assert one.utilisation < 0.7 and max(one.shard_busy) > 0.95
    assert three.utilisation == pytest.approx(1.0)
    alone = simulate_shards(scenario, method, replace(tier, shards=6))
    assert alone.fragment_latency_s == pytest.approx(2.0, rel=0.1)  # no queue: the CPU time
    assert shards_needed(scenario, method, tier, 0.95) in (2, 3)


def test_no_shard_count_helps_when_one_fragment_misses_its_window() -> None:
    # 8 s of CPU for one fragment's round, which must be back within about 5 steps.
    scenario, method, tier = small_shard_case(cpu_fragment_s=8.0)
    assert math.isinf(shards_needed(scenario, method, tier, 0.95))
    widest = simulate_shards(scenario, method, replace(tier, shards=6))
    assert widest.fragment_latency_s == pytest.approx(8.0, rel=0.05)
    with pytest.raises(ValueError, match="shards must be >= 1"):
        replace(tier, shards=0)


def test_ingest_cost_is_read_from_the_measurement(tmp_path) -> None:
    path = tmp_path / "ingest.json"
    path.write_text(json.dumps({"payload_mb": 1.0, "ingest_server_cpu_ms_per_push": 2.097152}))
    assert measured_cpu_s_per_gb(path) == pytest.approx(2.0)


def test_shard_plan_command_writes_rows_for_each_model(tmp_path, capsys) -> None:
    out = tmp_path / "plan.json"
    argv = ["shards", "--learners", "8", "--cores", "8", "--cpu-s-per-gb", "2"]
    cli.main([*argv, "--shard-ram-gb", "100", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["model"] for r in rows] == ["10B", "100B"]
    for row in rows:
        params = ModelSpec.of_size(float(row["model"][:-1]) * 1e9, row["P"] * 3).total_params
        assert row["shards_for_memory"] == math.ceil(4 * params * 4.0 / 100e9)
        assert row["utilisation_P_shards"] >= row["utilisation_1_shard"]
    assert "shards for 95%" in capsys.readouterr().out
