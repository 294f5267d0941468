"""The two reproductions: Streaming DiLoCo Table 4, and goodput against failure rate.

    rows = table4_rows()                  # one dict per (model, method): paper vs ours
    problems = ordering_problems(rows)    # [] when our ranking of methods matches the paper
    curve = goodput_curve((0.1, 1, 10))   # elastic DP vs quorum with 8 and 16 learners

Table 4 settings (the paper's caption): H = 100, fragments of 3 layers (so P = layers / 3,
strided), τ = 1 inner step for the overlapped variants, FP4 for the last one. Not in the
caption, assumed here: K = 2 replicas (the paper's experiments use 2 DiLoCo replicas, and a
ring all-reduce among 2 moves exactly the payload), zero latency, bf16 on the wire unless
FP4 (the paper's FP4 row needs about 1/4 of the bandwidth of the row above, which fits 16
bits against 4), and a model of transformer layers only (vocab_size = 0), like the
paper's per-layer DAG.
"""

from __future__ import annotations

import math

from bench.sim.goodput import FailureScenario, QuorumSetup, elastic_dp_goodput, quorum_goodput
from bench.sim.model import ModelSpec
from bench.sim.paper import STREAMING_DILOCO_TABLE4, TABLE4_MODELS, TARGETS
from bench.sim.throughput import Method, Scenario, required_bandwidth

MODEL_PARAMS = {"1B": 1e9, "10B": 10e9, "100B": 100e9}


def table4_methods(layers: int, sync_every_steps: int = 100) -> dict[str, Method]:
    """The paper's five rows as our Methods."""
    h, p = sync_every_steps, max(1, layers // 3)
    return {
        "Data-Parallel": Method(name="dp"),
        "Vanilla DiLoCo": Method(name="diloco", sync_every_steps=h),
        "Streaming DiLoCo": Method(name="streaming", sync_every_steps=h, fragments=p),
        "Streaming DiLoCo w/ overlapped com.": Method(
            name="streaming+overlap", sync_every_steps=h, fragments=p, overlap_steps=1
        ),
        "Streaming DiLoCo w/ overlapped FP4 com.": Method(
            name="streaming+overlap+fp4",
            sync_every_steps=h,
            fragments=p,
            overlap_steps=1,
            codec="fp4_e3m0",
        ),
    }


def table4_rows(replicas: int = 2, latency_s: float = 0.0) -> list[dict]:
    """Gbit/s for each target utilisation, ours next to the paper's, per model and method."""
    rows = []
    for label, layers, step_s in TABLE4_MODELS:
        spec = ModelSpec.of_size(MODEL_PARAMS[label], layers, vocab_size=0)
        scenario = Scenario(spec=spec, step_time_s=step_s, replicas=replicas, latency_s=latency_s)
        for name, method in table4_methods(layers).items():
            ours = [required_bandwidth(scenario, method, u) / 1e9 for u in TARGETS]
            paper = STREAMING_DILOCO_TABLE4[label][name]
            rows.append(
                {
                    "model": label,
                    "layers": layers,
                    "step_time_s": step_s,
                    "params": spec.total_params,
                    "method": name,
                    "H": method.sync_every_steps,
                    "P": method.fragments,
                    "tau": method.overlap_steps,
                    "codec": method.codec,
                    "paper_gbps": list(paper),
                    "ours_gbps": ours,
                    "ratio": [o / p for o, p in zip(ours, paper, strict=True)],
                }
            )
    return rows


def ordering_problems(rows: list[dict]) -> list[str]:
    """Pairs of methods the paper ranks strictly (needs more bandwidth) that we rank the
    other way or tie, per model and target. Ties in the paper (grid resolution) allow any
    order."""
    problems = []
    by_model: dict[str, list[dict]] = {}
    for row in rows:
        by_model.setdefault(row["model"], []).append(row)
    for model, group in by_model.items():
        for i, target in enumerate(TARGETS):
            for a in group:
                for b in group:
                    if a["paper_gbps"][i] > b["paper_gbps"][i] and not (
                        a["ours_gbps"][i] > b["ours_gbps"][i]
                    ):
                        problems.append(
                            f"{model} {target:.0%}: paper has {a['method']} above "
                            f"{b['method']}, we do not"
                        )
    return problems


def outside_factor(rows: list[dict], factor: float = 2.0) -> list[str]:
    """Cells where ours and the paper's differ by more than `factor` either way."""
    out = []
    for row in rows:
        for target, ratio in zip(TARGETS, row["ratio"], strict=True):
            if not (1 / factor <= ratio <= factor) or math.isinf(ratio):
                out.append(f"{row['model']} {row['method']} {target:.0%}: ratio {ratio:.2f}")
    return out


def goodput_curve(
    failures_per_chip_year: tuple[float, ...] = (0.1, 0.3, 1.0, 3.0, 10.0),
    learner_counts: tuple[int, ...] = (8, 16),
    base: FailureScenario | None = None,
    setup: QuorumSetup | None = None,
) -> list[dict]:
    """Goodput and uptime of elastic DP and of quorum mode, at each failure rate."""
    base = base or FailureScenario(duration_s=2 * 3600.0)
    setup = setup or QuorumSetup()
    points = []
    for rate in failures_per_chip_year:
        scenario = FailureScenario(
            chips=base.chips,
            failures_per_chip_year=rate,
            recovery_s=base.recovery_s,
            step_time_s=base.step_time_s,
            duration_s=base.duration_s,
            seed=base.seed,
        )
        dp = elastic_dp_goodput(scenario)
        point = {
            "failures_per_chip_year": rate,
            "failures": dp.failures,
            "elastic_dp": {"goodput": dp.goodput, "uptime": dp.uptime},
        }
        for learners in learner_counts:
            q = quorum_goodput(
                scenario,
                QuorumSetup(**{**setup.__dict__, "learners": learners}),
            )
            point[f"quorum_{learners}"] = {
                "goodput": q.goodput,
                "uptime": q.uptime,
                "pushes_accepted": q.pushes_accepted,
                "pushes_refused": q.pushes_refused,
                "mean_staleness": q.mean_staleness,
            }
        points.append(point)
    return points
