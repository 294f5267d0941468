"""Compute utilisation of one island under a sync method, and the bandwidth a target needs.

    scenario = Scenario(spec=ModelSpec.of_size(1e9, 24, vocab_size=0), step_time_s=0.1)
    method = Method(name="streaming", sync_every_steps=100, fragments=8, overlap_steps=1)
    result = simulate(scenario, method, bandwidth_bps=10e9)
    result.utilisation                       # compute time / wall time
    required_bandwidth(scenario, method, 0.9)  # bit/s for 90% utilisation (bisection)

The model is the Streaming DiLoCo paper's simulator (a DAG of per-layer nodes): one inner
step is a forward pass through the stages in order, then a backward pass in reverse; the
forward takes `forward_fraction` of the step time, the backward the rest, split evenly over
the transformer blocks (embedding and head take no compute time). Which fragment is sent
after which inner step, and after which step its new value must be back, comes from
`learner.streaming.Schedule` — the learner's own schedule, driven here step by step:

- a fragment scheduled by `pushes_at(step)` sends each of its stages' tensors as soon as that
  stage's backward of `step` is done (reduction overlapped with the backward pass);
- a fragment in `merges_at(step)` must have arrived before the forward of step + 1 reaches
  each of its stages; the island stalls (compute idle) until it does.

Data-parallel is the same machinery with H = 1, one fragment: gradients of every stage are
reduced after every step and needed by the next forward. DiLoCo is H steps, one fragment,
τ = 0; Streaming DiLoCo is P fragments at offsets p·H/P, with τ > 0 for overlap.

The network is one `Link` per island (the replicas are symmetric, so one island stands for
all of them): a ring all-reduce among `replicas` islands puts 2(K−1)/K bytes on each
island's link per byte of payload and crosses 2(K−1) link latencies. All compute happens on
one sequential stream, so the simulation visits events in time order without a heap; the
link serves messages first in, first out in the order they become ready.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from bench.sim.engine import Link
from bench.sim.model import FragmentPlan, ModelSpec, allreduce_factor
from learner.streaming import Schedule


@dataclass(frozen=True, kw_only=True)
class Method:
    """How replicas synchronise: H, P, τ and the codec of what they exchange."""

    name: str
    sync_every_steps: int = 1
    """H: inner steps between two syncs of the same fragment (1: data-parallel)."""
    fragments: int = 1
    """P: fragments, each synced once per H steps at offset p·H/P (Streaming DiLoCo)."""
    overlap_steps: int = 0
    """τ: inner steps the sync may take before its result is needed."""
    codec: str = "bf16"
    """Codec of the gradients or outer gradients on the wire (common/codec/)."""
    layout: str = "strided"

    def schedule(self) -> Schedule:
        return Schedule(self.sync_every_steps, self.fragments, self.overlap_steps)


@dataclass(frozen=True, kw_only=True)
class Scenario:
    """The hardware side: model, step time, islands and the WAN between them."""

    spec: ModelSpec
    step_time_s: float
    """Pure compute time of one inner step (forward and backward) on one island."""
    replicas: int = 2
    """K islands (DiLoCo replicas) taking part in each all-reduce."""
    latency_s: float = 0.0
    """One-way latency of one island's link."""
    forward_fraction: float = 1 / 3
    """Share of the step spent in the forward pass (backward ≈ 2x forward)."""

    def __post_init__(self) -> None:
        if not self.step_time_s > 0:
            raise ValueError(f"step_time_s must be > 0, got {self.step_time_s}")
        if not 0 < self.forward_fraction < 1:
            raise ValueError(f"forward_fraction must be in (0, 1), got {self.forward_fraction}")
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")


@dataclass(frozen=True)
class ThroughputResult:
    utilisation: float
    """Compute seconds / wall seconds over the measured steps."""
    blocked_s_per_step: float
    """Mean seconds per inner step the island waited for the network."""
    bytes_per_link_per_step: float
    """Mean bytes one island's link carried per inner step (one direction)."""
    largest_sync_bytes: int
    """The biggest fragment one sync puts on the link (the burst Streaming DiLoCo shrinks)."""
    peak_bandwidth_bps: float
    """Highest rate the link carried over any one-step window."""
    mean_bandwidth_bps: float
    measured_steps: int


def simulate(
    scenario: Scenario, method: Method, bandwidth_bps: float, periods: int = 3
) -> ThroughputResult:
    """Run `periods` sync periods (H steps each, at least 6 steps) and measure all but the
    first: it starts with an idle link, so it would flatter every method."""
    spec, schedule = scenario.spec, method.schedule()
    plan = fragment_plan(spec, method.fragments, method.codec, method.layout)
    layers, step_s = spec.layers, scenario.step_time_s
    forward_s = step_s * scenario.forward_fraction / layers  # per block
    backward_s = step_s * (1 - scenario.forward_fraction) / layers
    factor = allreduce_factor(scenario.replicas)
    link = Link(
        bandwidth_bps=bandwidth_bps,
        latency_s=2 * (scenario.replicas - 1) * scenario.latency_s,
        window_s=step_s,
    )
    h = method.sync_every_steps
    warmup_steps = max(h, 2)
    total_steps = max(periods * h, warmup_steps + 4)
    in_flight: dict[int, dict[int, float]] = {}  # fragment -> {stage: arrival time}
    needed: dict[int, float] = {}  # stage -> arrival the next forward waits for
    t = 0.0
    measure_from_s = 0.0
    bytes_before = 0
    largest = 0
    for step in range(1, total_steps + 1):
        if step == warmup_steps + 1:
            measure_from_s = t
            bytes_before = link.bytes_sent
        # Forward: each stage starts once the compute reaches it and its value is back.
        stall = 0.0
        for stage in sorted(needed):
            offset = max(stage, 0) * forward_s
            stall = max(stall, needed[stage] - (t + offset))
        needed = {}
        backward_start = t + stall + layers * forward_s
        # Backward: stage j's gradient is complete after the blocks above it.
        messages = []
        for p in schedule.pushes_at(step):
            in_flight[p] = {}
            for stage, nbytes in plan.stage_bytes[p].items():
                done = gradient_ready_s(stage, backward_start, layers, backward_s)
                messages.append((done, p, stage, nbytes))
            largest = max(largest, plan.fragment_bytes[p])
        for done, p, stage, nbytes in sorted(messages):
            _, arrival = link.send(done, nbytes * factor)
            in_flight[p][stage] = arrival
        for p in schedule.merges_at(step):
            for stage, arrival in in_flight.pop(p).items():
                needed[stage] = max(needed.get(stage, 0.0), arrival)
        t = backward_start + layers * backward_s
    measured = total_steps - warmup_steps
    wall_s = t - measure_from_s
    compute_s = measured * step_s
    return ThroughputResult(
        utilisation=compute_s / wall_s,
        blocked_s_per_step=(wall_s - compute_s) / measured,
        bytes_per_link_per_step=(link.bytes_sent - bytes_before) / measured,
        largest_sync_bytes=largest,
        peak_bandwidth_bps=link.peak_bps(from_s=measure_from_s),
        mean_bandwidth_bps=(link.bytes_sent - bytes_before) * 8 / wall_s,
        measured_steps=measured,
    )


def gradient_ready_s(stage: int, backward_start: float, layers: int, backward_s: float) -> float:
    """The head's gradient is ready as the backward starts, block j's after blocks
    L-1 … j, the embedding's at the very end."""
    if stage >= layers:
        return backward_start
    if stage < 0:
        return backward_start + layers * backward_s
    return backward_start + (layers - stage) * backward_s


_PLANS: dict[tuple, FragmentPlan] = {}


def fragment_plan(spec: ModelSpec, fragments: int, codec: str, layout: str) -> FragmentPlan:
    """Layouts are pure functions of their inputs; a bisection reuses one many times."""
    key = (spec, fragments, codec, layout)
    if key not in _PLANS:
        _PLANS[key] = FragmentPlan.build(spec, fragments, codec, layout)
    return _PLANS[key]


def required_bandwidth(
    scenario: Scenario,
    method: Method,
    target_utilisation: float,
    lo_bps: float = 1e6,
    hi_bps: float = 1e14,
    rel_tol: float = 0.005,
    max_iterations: int = 60,
) -> float:
    """The least bandwidth (bit/s) at which utilisation reaches the target, by bisection
    in log space (utilisation never falls as bandwidth grows). math.inf if even `hi_bps`
    falls short (latency or the schedule, not bandwidth, is the limit)."""
    if not 0 < target_utilisation < 1:
        raise ValueError(f"target utilisation must be in (0, 1), got {target_utilisation}")
    if simulate(scenario, method, hi_bps).utilisation < target_utilisation:
        return math.inf
    if simulate(scenario, method, lo_bps).utilisation >= target_utilisation:
        return lo_bps
    for _ in range(max_iterations):
        if hi_bps / lo_bps <= 1 + rel_tol:
            break
        mid = math.sqrt(lo_bps * hi_bps)
        if simulate(scenario, method, mid).utilisation >= target_utilisation:
            hi_bps = mid
        else:
            lo_bps = mid
    return hi_bps
