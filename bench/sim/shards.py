"""The shard tier: how many aggregator shards keep learners at a target compute utilisation.

    tier = ShardTier(shards=4, nic_bps=25e9, cpu_s_per_gb=measured_cpu_s_per_gb())
    scenario = Scenario(spec=ModelSpec.of_size(10e9, 48), step_time_s=0.8, replicas=16)
    method = Method(name="streaming", sync_every_steps=100, fragments=16, overlap_steps=5,
                    codec="fp4_e2m1")
    simulate_shards(scenario, method, tier).utilisation
    shards_needed(scenario, method, tier, target=0.95)      # least N, math.inf if none

Each fragment is owned by one shard, by the servers' own rule (`server.state.params`: balanced
by fp32 bytes); every one of the K learners (`scenario.replicas`)
pushes the fragment's outer gradient to that shard and pulls the new value back from it.
Per shard, three FIFO servers in a row (each an `engine.Link`):

- the NIC inbound: the K pushes of a fragment share it (K x the fragment's bytes);
- ingest CPU: `cpu_s_per_gb` CPU seconds per GB of pushed wire bytes over `cores` cores,
  started per stage as its bytes arrive (the server adds a push into the round sum as it
  streams in);
- the NIC outbound: the K pulls of the new value (4-bit updates, the push's size; the
  server builds one pull answer per version and shares it, so pulls cost bytes, not CPU).

A fragment's round closes when all K pushes are ingested; its new value must reach the
learners before the forward pass that merges it (`learner.streaming.Schedule`), else
compute stalls, exactly as in `throughput.simulate`. Learners are in lockstep and
symmetric: one learner's timeline stands for all, and each learner has its own link to the
shards (`learner_bps`, one direction each way). Fragments on different shards proceed in
parallel; fragments on the same shard queue behind each other, which is what more shards
relieve. A single fragment's latency (K x its bytes through one shard) does not shrink with
more shards: when it alone misses the deadline, no N reaches the target (`math.inf`) and
the cure is more fragments (P) or more overlap (τ).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

from bench.sim.engine import Link
from bench.sim.model import ModelSpec
from bench.sim.throughput import Method, Scenario, fragment_plan, gradient_ready_s
from server.state.params import fragment_owners

INGEST_RESULTS = Path(__file__).resolve().parent.parent / "results" / "ingest.json"


def measured_cpu_s_per_gb(path: Path = INGEST_RESULTS) -> float:
    """Server CPU seconds per GB (1e9 bytes) of fp4 push wire bytes, from bench/ingest.py's
    measurement (`ingest_server_cpu_ms_per_push` over the payload of one push)."""
    data = json.loads(path.read_text())
    payload_bytes = data["payload_mb"] * 2**20
    return data["ingest_server_cpu_ms_per_push"] / 1e3 / payload_bytes * 1e9


@dataclass(frozen=True, kw_only=True)
class ShardTier:
    """The aggregator side: N shards, each with a NIC and ingest CPU."""

    shards: int
    nic_bps: float = 25e9
    """Each shard's NIC, bit/s per direction (full duplex)."""
    cpu_s_per_gb: float
    """CPU seconds a shard spends per GB (1e9 bytes) of pushed wire bytes."""
    cores: float = 1.0
    """Cores one shard's ingest keeps busy at once."""
    learner_bps: float = 100e9
    """Each learner's own link to the shards, bit/s per direction."""

    def __post_init__(self) -> None:
        if self.shards < 1:
            raise ValueError(f"shards must be >= 1, got {self.shards}")
        for name in ("nic_bps", "cpu_s_per_gb", "cores", "learner_bps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    @property
    def ingest_bps(self) -> float:
        """A shard's ingest rate in bit/s of wire bytes."""
        return 8 * self.cores * 1e9 / self.cpu_s_per_gb


@dataclass(frozen=True)
class ShardResult:
    utilisation: float
    """Compute seconds / wall seconds over the measured steps."""
    blocked_s_per_step: float
    shard_busy: list[float]
    """Per shard, the busier of NIC-in and CPU, as a share of the measured wall time."""
    fragment_latency_s: float
    """The longest time in the measured steps from a fragment's last gradient being ready on
    the learner to its new value being back there (queueing, transfer, ingest, pull)."""


def simulate_shards(
    scenario: Scenario, method: Method, tier: ShardTier, periods: int = 3
) -> ShardResult:
    """Run `periods` sync periods and measure all but the first (idle links flatter it)."""
    spec, schedule = scenario.spec, method.schedule()
    plan = fragment_plan(spec, method.fragments, method.codec, method.layout)
    if tier.shards > method.fragments:
        raise ValueError(f"{tier.shards} shards for {method.fragments} fragments: some own none")
    owner = fragment_owners([4 * n for n in plan.fragment_values], tier.shards)
    k, layers, step_s = scenario.replicas, spec.layers, scenario.step_time_s
    forward_s = step_s * scenario.forward_fraction / layers
    backward_s = step_s * (1 - scenario.forward_fraction) / layers
    latency_s = scenario.latency_s
    up = Link(bandwidth_bps=tier.learner_bps, window_s=step_s)
    down = Link(bandwidth_bps=tier.learner_bps, window_s=step_s)
    nic_in = [Link(bandwidth_bps=tier.nic_bps, window_s=step_s) for _ in range(tier.shards)]
    cpu = [Link(bandwidth_bps=tier.ingest_bps, window_s=step_s) for _ in range(tier.shards)]
    nic_out = [Link(bandwidth_bps=tier.nic_bps, window_s=step_s) for _ in range(tier.shards)]
    h = method.sync_every_steps
    warmup_steps = max(h, 2)
    total_steps = max(periods * h, warmup_steps + 4)
    pulled: dict[int, tuple[float, float]] = {}  # fragment -> (push complete, value back)
    needed: dict[int, float] = {}
    t = measure_from_s = 0.0
    busy_before = [0.0] * tier.shards
    worst_latency = 0.0
    for step in range(1, total_steps + 1):
        if step == warmup_steps + 1:
            measure_from_s = t
            busy_before = [max(n.busy_s, c.busy_s) for n, c in zip(nic_in, cpu, strict=True)]
        stall = max(
            [needed[stage] - (t + max(stage, 0) * forward_s) for stage in needed], default=0.0
        )
        needed = {}
        backward_start = t + max(stall, 0.0) + layers * forward_s
        for p in schedule.pushes_at(step):
            s, closed, complete = owner[p], 0.0, 0.0
            stages = [
                (gradient_ready_s(stage, backward_start, layers, backward_s), nbytes)
                for stage, nbytes in plan.stage_bytes[p].items()
            ]
            for ready, nbytes in sorted(stages, key=lambda s: s[0]):  # stable: ties keep order
                complete = max(complete, ready)
                _, at_shard = up.send(ready, nbytes)
                _, received = nic_in[s].send(at_shard + latency_s, k * nbytes)
                _, ingested = cpu[s].send(received, k * nbytes)
                closed = max(closed, ingested)
            size = plan.fragment_bytes[p]
            _, sent = nic_out[s].send(closed, k * size)
            _, arrived = down.send(closed, size)
            pulled[p] = (complete, max(sent, arrived) + latency_s)
        for p in schedule.merges_at(step):
            pushed_at, back_at = pulled.pop(p)
            if step > warmup_steps:
                worst_latency = max(worst_latency, back_at - pushed_at)
            for stage in plan.stage_bytes[p]:
                needed[stage] = max(needed.get(stage, 0.0), back_at)
        t = backward_start + layers * backward_s
    measured = total_steps - warmup_steps
    wall_s = t - measure_from_s
    busy = [
        (max(n.busy_s, c.busy_s) - b) / wall_s
        for n, c, b in zip(nic_in, cpu, busy_before, strict=True)
    ]
    return ShardResult(
        utilisation=measured * step_s / wall_s,
        blocked_s_per_step=(wall_s - measured * step_s) / measured,
        shard_busy=busy,
        fragment_latency_s=worst_latency,
    )


def shards_needed(
    scenario: Scenario, method: Method, tier: ShardTier, target: float, max_shards: int = 0
) -> float:
    """The least number of shards (at most one per fragment, or `max_shards`) at which
    utilisation reaches `target`; math.inf if none does (one fragment's round alone is
    too slow: raise P, τ or the cores per shard)."""
    if not 0 < target < 1:
        raise ValueError(f"target utilisation must be in (0, 1), got {target}")
    limit = min(method.fragments, max_shards or method.fragments)
    for n in range(1, limit + 1):
        if simulate_shards(scenario, method, replace(tier, shards=n)).utilisation >= target:
            return n
    return math.inf


@dataclass(frozen=True, kw_only=True)
class PlanModel:
    """One model to plan for: its size, depth and step time (Table 4's 10B and 100B)."""

    label: str
    params: float
    layers: int
    step_time_s: float


PLAN_MODELS = (
    PlanModel(label="10B", params=10e9, layers=48, step_time_s=0.8),
    PlanModel(label="100B", params=100e9, layers=108, step_time_s=4.9),
)


def plan_rows(
    models: tuple[PlanModel, ...],
    learners: list[int],
    cores: list[float],
    tier: ShardTier,
    method: Method,
    target: float = 0.95,
    memory: tuple[float, float] = (4.0, 256e9),
) -> list[dict]:
    """For each model, learner count and cores per shard: the shards `target` needs, the
    utilisation at one shard and at one shard per fragment, the slowest fragment round
    (push to pulled) next to the overlap window it must fit in, and the shards the model's
    memory needs: `memory` is (RSS per owned fp32 model byte, RAM per shard in bytes).
    `method.fragments` 0 means fragments of 3 layers (P = layers / 3)."""
    rss_per_owned, ram_bytes = memory
    rows = []
    for model in models:
        spec = ModelSpec.of_size(model.params, model.layers)
        fragments = method.fragments or max(1, model.layers // 3)
        m = replace(method, fragments=fragments)
        for k in learners:
            scenario = Scenario(spec=spec, step_time_s=model.step_time_s, replicas=k)
            for c in cores:
                t = replace(tier, cores=c)
                widest = simulate_shards(scenario, m, replace(t, shards=fragments))
                for_memory = math.ceil(4 * spec.total_params * rss_per_owned / ram_bytes)
                rows.append(
                    {
                        "model": model.label,
                        "learners": k,
                        "P": fragments,
                        "H": m.sync_every_steps,
                        "tau": m.overlap_steps,
                        "cores_per_shard": c,
                        "shards_for_utilisation": shards_needed(scenario, m, t, target),
                        "shards_for_memory": for_memory,
                        "utilisation_1_shard": simulate_shards(scenario, m, t).utilisation,
                        "utilisation_P_shards": widest.utilisation,
                        "fragment_round_s": widest.fragment_latency_s,
                        "overlap_window_s": m.overlap_steps * model.step_time_s,
                    }
                )
    return rows


def plan_text(rows: list[dict], target: float) -> str:
    """The plan as a fixed-width table, one line per model, learner count and cores."""
    lines = [
        f"model  learners  P  tau  cores/shard  shards for {target:.0%}  for memory  util@1  "
        "util@P  fragment round (s)  overlap window (s)"
    ]
    for r in rows:
        n = r["shards_for_utilisation"]
        lines.append(
            f"{r['model']:<6} {r['learners']:>8} {r['P']:>3} {r['tau']:>4} "
            f"{r['cores_per_shard']:>12g}  {'none' if math.isinf(n) else n:>14}  "
            f"{r['shards_for_memory']:>10}  "
            f"{r['utilisation_1_shard']:>6.1%}  {r['utilisation_P_shards']:>6.1%}  "
            f"{r['fragment_round_s']:>18.1f}  {r['overlap_window_s']:>18.1f}"
        )
    return "\n".join(lines)
