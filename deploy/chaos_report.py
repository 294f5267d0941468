"""The chaos harness's judgement of a run: its invariants, losses, goodput and verdict.

    report = evaluate(faulty, fault_free)     # two Runs (deploy/chaos.py's run_beside)
    report.failures = verdict(report, KINDS, min_faults=1000, max_loss_gap=0.03)

Every figure comes from what the daemons reported to their Watch (deploy/watch.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

from deploy.chaos_faults import KINDS, Event
from deploy.watch import (
    Watch,
    merged_tokens,
    recent_eval_loss,
    round_times,
    summed,
    time_reaching,
)


@dataclass
class Report:
    faults_by_kind: dict[str, int] = field(default_factory=dict)
    invariants_ok: bool = False
    version_regressions: int = 0
    dead_processes: list[str] = field(default_factory=list)
    faults_without_progress: int = 0
    final_eval_loss: float = float("nan")
    fault_free_eval_loss: float = float("nan")  # at the tokens the run with faults merged
    fault_free_final_eval_loss: float = float("nan")  # at the end of the same-length run
    loss_gap: float = float("nan")  # final / fault-free final eval loss - 1 (same length)
    loss_gap_equal_tokens: float = float("nan")  # final / fault-free eval loss - 1
    goodput: float = float("nan")
    useful_tokens: int = 0
    capacity_tokens: int = 0
    duration_s: float = 0.0  # of each run
    faults_per_min: float = 0.0
    fault_s_by_kind: dict[str, float] = field(default_factory=dict)  # mean, start to end
    load_average: dict[str, float] = field(default_factory=dict)  # 1-minute: min, mean, max
    aborted: str = ""  # why the run with faults ended early; empty if it did not
    failures: list[str] = field(default_factory=list)  # the verdict: empty when it passed
    wall_s: float = 0.0  # both runs, start to end
    command: str = ""
    timeline: list[dict] = field(default_factory=list)


@dataclass
class Run:
    """One run's faults, the processes dead at its end, what its daemons reported, how long
    it ran, and the machine's load average while it ran."""

    events: list[Event]
    dead: list[str]
    watch: Watch
    fragments: int
    duration_s: float
    loads: list[float] = field(default_factory=list)  # 1-minute load average, sampled
    aborted: str = ""  # why it ended early (a restart that failed); empty if it did not

    def merged_tokens(self) -> list[tuple[float, float]]:
        """(time, tokens in closed rounds so far, summed over fragments and shards)."""
        return summed([merged_tokens(points) for points in self.watch.servers.values()])

    def round_times(self) -> list[float]:
        """When some shard's fragment moved on."""
        return sorted(t for points in self.watch.servers.values() for t in round_times(points))


def version_regressions(versions: Iterable[Sequence[int]]) -> int:
    """How often a learner's fragment versions (one list per observation, in order) show
    some fragment lower than this learner had seen before."""
    best: list[int] = []
    regressions = 0
    for seen in versions:
        if best and any(v < b for v, b in zip(seen, best, strict=False)):
            regressions += 1
        best = [max(v, b) for v, b in zip(seen, best, strict=False)] or list(seen)
    return regressions


def mean_recent_eval_loss(watch: Watch, before: float = math.inf) -> float:
    """Mean over learners of their last three eval losses before `before` (deploy/watch.py)."""
    losses = [recent_eval_loss(points, before) for points in watch.learners.values()]
    losses = [loss for loss in losses if not math.isnan(loss)]
    return sum(losses) / len(losses) if losses else math.nan


def evaluate(faulty: Run, fault_free: Run) -> Report:
    events = faulty.events
    report = Report(duration_s=faulty.duration_s, timeline=[asdict(e) for e in events])
    for e in events:
        if e.phase == "start":
            report.faults_by_kind[e.kind] = report.faults_by_kind.get(e.kind, 0) + 1
    report.version_regressions = sum(
        version_regressions(p.versions for p in points if p.versions)
        for points in faulty.watch.learners.values()
    )
    report.dead_processes = faulty.dead
    rounds = faulty.round_times()
    report.faults_without_progress = sum(
        1 for e in events if e.phase == "end" and not any(t > e.t_s for t in rounds)
    )
    # Each token is counted once per fragment it reached.
    tokens, free_tokens = faulty.merged_tokens(), fault_free.merged_tokens()
    report.useful_tokens = int(tokens[-1][1]) // faulty.fragments if tokens else 0
    # What the same learners do without faults.
    report.capacity_tokens = int(free_tokens[-1][1]) // faulty.fragments if free_tokens else 0
    report.goodput = report.useful_tokens / max(1, report.capacity_tokens)
    report.final_eval_loss = mean_recent_eval_loss(faulty.watch)
    # The fault-free run at the point where it had trained the same (useful) tokens.
    same_tokens_at = time_reaching(free_tokens, report.useful_tokens * faulty.fragments)
    report.fault_free_eval_loss = mean_recent_eval_loss(fault_free.watch, before=same_tokens_at)
    report.fault_free_final_eval_loss = mean_recent_eval_loss(fault_free.watch)
    report.loss_gap = report.final_eval_loss / report.fault_free_final_eval_loss - 1
    report.loss_gap_equal_tokens = report.final_eval_loss / report.fault_free_eval_loss - 1
    report.faults_per_min = sum(report.faults_by_kind.values()) / (faulty.duration_s / 60)
    lengths: dict[str, list[float]] = {}
    for start, end in zip(events[0::2], events[1::2], strict=True):  # one fault at a time
        lengths.setdefault(start.kind, []).append(end.t_s - start.t_s)
    report.fault_s_by_kind = {kind: sum(v) / len(v) for kind, v in lengths.items()}
    if faulty.loads:
        loads = faulty.loads
        report.load_average = {"min": min(loads), "mean": sum(loads) / len(loads)}
        report.load_average["max"] = max(loads)
    report.aborted = faulty.aborted
    report.invariants_ok = (
        report.version_regressions == 0
        and not report.dead_processes
        and report.faults_without_progress == 0
    )
    return report


def verdict(
    report: Report,
    kinds: Sequence[str] = KINDS,
    min_faults: int = 0,
    max_loss_gap: float | None = None,
) -> list[str]:
    """What failed, one line each; empty when the run passed. The loss check is two-sided
    (a run with faults far better than without is as suspect); NaN losses fail it."""
    failures = [f"ended early: {report.aborted}"] if report.aborted else []
    if report.version_regressions:
        failures.append(f"{report.version_regressions} fragment versions went backwards")
    if report.dead_processes:
        failures.append(f"dead at the end: {', '.join(report.dead_processes)}")
    if report.faults_without_progress:
        failures.append(f"{report.faults_without_progress} faults not followed by a round")
    # A run asked for enough faults must have had every kind (they come in turn); a timed
    # run on a busy machine may fit fewer, which breaks nothing.
    missing = [kind for kind in kinds if not report.faults_by_kind.get(kind)]
    if missing and min_faults >= len(kinds):
        failures.append(f"faults never injected: {', '.join(missing)}")
    injected = sum(report.faults_by_kind.values())
    if injected < min_faults:
        failures.append(f"{injected} faults injected, fewer than {min_faults}")
    if max_loss_gap is not None and not abs(report.loss_gap) <= max_loss_gap:
        failures.append(
            f"final eval loss {report.final_eval_loss:.4f} vs fault-free "
            f"{report.fault_free_final_eval_loss:.4f} ({report.loss_gap:+.2%}): "
            f"not within {max_loss_gap:.0%}"
        )
    return failures
