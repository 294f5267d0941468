"""diloco-chaos: train through injected faults and check that nothing breaks or is lost.

    diloco-chaos --learners 3 --duration-s 600 --fault-every-s 15 --report chaos.json
    diloco-chaos --quick --report chaos.json       # about 2 minutes
    diloco-chaos --shards 2 --quick                # the aggregator as 2 shards

Starts a server (quorum mode, with a state dir) and K learners as real processes on
loopback; each learner reaches the server through its own FaultProxy (deploy/cluster.py). On
a seeded schedule it injects: learner kill -9 + restart, learner SIGSTOP/SIGCONT stalls,
server kill -9 + restart (same port, same state dir; with --shards N every shard at once), and
network cuts between one learner and the server; with N > 1 shards also shard kill -9 +
restart (one shard, while the others go on). Then it runs the same setup without faults for
the same time, and checks:

- no learner ever saw a fragment version go backwards (its replica versions, scraped);
- every process that should be alive at the end is;
- training went on after every fault (some shard's versions moved on after it);
- final eval loss next to the fault-free run's; goodput = tokens that reached a closed round
  / tokens the learners had capacity for (the fault-free run's merged tokens).

Every figure comes from the daemons' Prometheus endpoints, scraped while the run goes on
(deploy/watch.py); the logs in the work directory are for people.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import signal
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from deploy.cluster import Cluster
from deploy.watch import (
    Watch,
    merged_tokens,
    recent_eval_loss,
    round_times,
    summed,
    time_reaching,
)

KINDS = ("learner_kill", "learner_stall", "server_kill", "net_cut")
SHARD_KINDS = ("shard_kill", *KINDS)  # with more than one shard
QUIET_TAIL_S = 10.0
FRAGMENTS = 2  # or one per shard, if there are more shards


@dataclass
class Event:
    t_s: float
    kind: str
    target: str
    phase: str  # "start" or "end"


@dataclass
class Report:
    faults_by_kind: dict[str, int] = field(default_factory=dict)
    invariants_ok: bool = False
    version_regressions: int = 0
    dead_processes: list[str] = field(default_factory=list)
    faults_without_progress: int = 0
    final_eval_loss: float = float("nan")
    fault_free_eval_loss: float = float("nan")
    goodput: float = float("nan")
    useful_tokens: int = 0
    capacity_tokens: int = 0
    duration_s: float = 0.0
    timeline: list[dict] = field(default_factory=list)


def inject(cluster: Cluster, kind: str, rng: random.Random, length_s: float) -> list[Event]:
    """One fault, start to end (blocking for its length); returns its two events."""
    i = rng.randrange(cluster.k)
    shard = rng.randrange(cluster.shards)
    target = {"server_kill": "server", "shard_kill": cluster.shard_name(shard)}.get(
        kind, f"learner-{i}"
    )
    events = [Event(cluster.now(), kind, target, "start")]
    if kind == "learner_kill":
        cluster.learners[i].kill()
        time.sleep(length_s)
        cluster.start_learner(i)
    elif kind == "learner_stall":
        cluster.learners[i].signal(signal.SIGSTOP)
        time.sleep(length_s)
        cluster.learners[i].signal(signal.SIGCONT)
    elif kind in ("server_kill", "shard_kill"):
        killed = range(cluster.shards) if kind == "server_kill" else [shard]
        for s in killed:
            cluster.servers[s].kill()
        time.sleep(length_s)
        for s in killed:
            cluster.start_server(s)
    else:
        for proxy in cluster.proxies[i]:
            proxy.cut()
        time.sleep(length_s)
        for proxy in cluster.proxies[i]:
            proxy.restore()
    events.append(Event(cluster.now(), kind, target, "end"))
    return events


@dataclass
class Run:
    """One run's faults, the processes dead at its end, and what its daemons reported."""

    events: list[Event]
    dead: list[str]
    watch: Watch
    fragments: int

    def merged_tokens(self) -> list[tuple[float, float]]:
        """(time, tokens in closed rounds so far, summed over fragments and shards)."""
        return summed([merged_tokens(points) for points in self.watch.servers.values()])

    def round_times(self) -> list[float]:
        """When some shard's fragment moved on."""
        return sorted(t for points in self.watch.servers.values() for t in round_times(points))


def run(
    workdir: Path,
    learners: int,
    duration_s: float,
    fault_every_s: float,
    seed: int,
    faults: bool,
    shards: int = 1,
) -> Run:
    fragments = max(FRAGMENTS, shards)
    kinds = SHARD_KINDS if shards > 1 else KINDS
    cluster = Cluster(workdir, learners, fragments=fragments, shards=shards)
    cluster.start()
    watch = Watch(cluster.daemons, cluster.now)
    watch.start()
    rng = random.Random(seed)
    events: list[Event] = []
    try:
        next_fault = fault_every_s
        while cluster.now() < duration_s:
            # No fault starts in the last stretch, so every fault is followed by training
            # (long enough to re-sync after a server restart: lease, heartbeat, rejoin backoff).
            quiet_tail = cluster.now() > duration_s - max(fault_every_s, QUIET_TAIL_S)
            if faults and not quiet_tail and cluster.now() >= next_fault:
                kind = kinds[len(events) // 2 % len(kinds)]  # every kind in turn
                events += inject(cluster, kind, rng, length_s=rng.uniform(1.0, 4.0))
                next_fault = cluster.now() + fault_every_s * rng.uniform(0.5, 1.5)
            time.sleep(0.2)
    finally:
        dead = cluster.dead()
        cluster.stop_learners()
        watch.stop()  # after the learners' last merges, before the server goes
        cluster.stop()
    return Run(events, dead, watch, fragments)


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


def evaluate(duration_s: float, faulty: Run, fault_free: Run) -> Report:
    events = faulty.events
    report = Report(duration_s=duration_s, timeline=[asdict(e) for e in events])
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
    report.invariants_ok = (
        report.version_regressions == 0
        and not report.dead_processes
        and report.faults_without_progress == 0
    )
    return report


def main() -> int:
    parser = argparse.ArgumentParser(prog="diloco-chaos", description=__doc__.splitlines()[0])
    parser.add_argument("--learners", type=int, default=3)
    parser.add_argument("--duration-s", type=float, default=600.0)
    parser.add_argument("--fault-every-s", type=float, default=15.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shards", type=int, default=1, help="the aggregator as N shards")
    parser.add_argument("--quick", action="store_true", help="60 s with a fault every 6 s")
    parser.add_argument("--report", type=Path, default=None, help="write the report as JSON")
    args = parser.parse_args()
    if args.quick:
        args.duration_s, args.fault_every_s = 60.0, 6.0
    if min(args.learners, args.shards) < 1 or args.duration_s <= 0 or args.fault_every_s <= 0:
        parser.error("--learners, --shards, --duration-s and --fault-every-s must be positive")
    root = Path(tempfile.mkdtemp(prefix="diloco-chaos-"))
    print(f"workdir {root}", flush=True)
    setup = (args.learners, args.duration_s, args.fault_every_s, args.seed)
    faulty = run(root / "faults", *setup, faults=True, shards=args.shards)
    fault_free = run(root / "fault-free", *setup, faults=False, shards=args.shards)
    report = evaluate(args.duration_s, faulty, fault_free)
    print(json.dumps({k: v for k, v in asdict(report).items() if k != "timeline"}, indent=1))
    if args.report:
        args.report.write_text(json.dumps(asdict(report), indent=1))
    return 0 if report.invariants_ok else 1


if __name__ == "__main__":
    sys.exit(main())
