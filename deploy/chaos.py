"""diloco-chaos: train through injected faults and check that nothing breaks or is lost.

    diloco-chaos --learners 3 --duration-s 600 --fault-every-s 15 --report chaos.json
    diloco-chaos --quick --report chaos.json       # about 2 minutes
    diloco-chaos --soak                            # 1,000 short faults, then as long fault-free
    diloco-chaos --shards 2 --quick                # the aggregator as 2 shards

Starts a server (quorum mode, with a state dir) and K learners as real processes on
loopback, and runs for the given duration once every learner has joined; each learner
reaches the server through its own FaultProxy (deploy/cluster.py). On a seeded schedule it
injects: learner kill -9 + restart, learner SIGSTOP/SIGCONT stalls, server kill -9 + restart
(same port, same state dir; with --shards N > 1 one shard's, while the others go on), and
network cuts between one learner and the server. Then it runs the same setup without faults
for the same time, and checks:

- no learner ever saw a fragment version go backwards (its replica versions, scraped);
- every process that should be alive at the end is;
- training went on after every fault (some shard's versions moved on after it);
- final eval loss next to the fault-free run's; goodput = tokens that reached a closed round
  / tokens the learners had capacity for (the fault-free run's merged tokens).

The verdict (exit status 0, `failures` empty) needs every invariant; with --faults N at least
N faults, and every kind of fault (N >= the kinds); and with --max-loss-gap G a final eval
loss within G (relative) of the fault-free run's at its end (the eval loss at equal merged
tokens is reported too). --soak is the long form: --faults 1000, a fault every ~1.5 s lasting
0.2-1 s, 60 s without faults at the end, G = 0.03, report in bench/results/chaos_soak.json.

Every figure comes from the daemons' Prometheus endpoints, scraped while the run goes on
(deploy/watch.py); the logs in the work directory are for people.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shlex
import signal
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from common.retry import wait_until
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
# With more than one shard a shard is killed instead of the whole server: the others go on.
SHARD_KINDS = ("shard_kill", "learner_kill", "learner_stall", "net_cut")
QUIET_TAIL_S = 10.0
JOIN_TIMEOUT_S = 300.0  # bounded, and generous: each learner imports torch first
FRAGMENTS = 2  # or one per shard, if there are more shards
SOAK_REPORT = Path(__file__).resolve().parent.parent / "bench" / "results" / "chaos_soak.json"


@dataclass(frozen=True)
class Schedule:
    """How long a run lasts and how its faults come."""

    duration_s: float
    """The run's length; with max_faults, at most this long."""
    fault_every_s: float
    """Mean gap from one fault's end to the next one's start (drawn from 0.5x to 1.5x)."""
    fault_length_s: tuple[float, float] = (1.0, 4.0)
    """Each fault lasts a uniform draw from this range (a stall's or a cut's length, the wait
    before a killed process is restarted)."""
    max_faults: int = 0
    """Stop injecting after this many faults and end the run after the quiet tail; 0: no
    limit."""
    quiet_tail_s: float = QUIET_TAIL_S
    """No fault starts this close to the end (at least fault_every_s): training follows every
    fault, long enough to re-sync after a server restart (lease, heartbeat, rejoin backoff)."""

    def tail_s(self) -> float:
        return max(self.fault_every_s, self.quiet_tail_s)


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
    fault_free_eval_loss: float = float("nan")  # at the tokens the run with faults merged
    fault_free_final_eval_loss: float = float("nan")  # at the end of the same-length run
    loss_gap: float = float("nan")  # final / fault-free final eval loss - 1 (same length)
    loss_gap_equal_tokens: float = float("nan")  # final / fault-free eval loss - 1
    goodput: float = float("nan")
    useful_tokens: int = 0
    capacity_tokens: int = 0
    duration_s: float = 0.0  # of each run
    faults_per_min: float = 0.0
    failures: list[str] = field(default_factory=list)  # the verdict: empty when it passed
    wall_s: float = 0.0  # both runs, start to end
    command: str = ""
    timeline: list[dict] = field(default_factory=list)


def inject(cluster: Cluster, kind: str, rng: random.Random, length_s: float) -> list[Event]:
    """One fault, start to end (blocking for its length); returns its two events."""
    i = rng.randrange(cluster.k)
    shard = rng.randrange(cluster.shards) if cluster.shards > 1 else 0
    killing_a_server = kind in ("server_kill", "shard_kill")
    target = cluster.shard_name(shard) if killing_a_server else f"learner-{i}"
    events = [Event(cluster.now(), kind, target, "start")]
    if kind == "learner_kill":
        cluster.learners[i].kill()
        time.sleep(length_s)
        cluster.start_learner(i)
    elif kind == "learner_stall":
        cluster.learners[i].signal(signal.SIGSTOP)
        time.sleep(length_s)
        cluster.learners[i].signal(signal.SIGCONT)
    elif killing_a_server:
        cluster.servers[shard].kill()  # shard 0, the server, when there is one
        time.sleep(length_s)
        cluster.start_server(shard)
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
    """One run's faults, the processes dead at its end, what its daemons reported, and how
    long it ran."""

    events: list[Event]
    dead: list[str]
    watch: Watch
    fragments: int
    duration_s: float

    def merged_tokens(self) -> list[tuple[float, float]]:
        """(time, tokens in closed rounds so far, summed over fragments and shards)."""
        return summed([merged_tokens(points) for points in self.watch.servers.values()])

    def round_times(self) -> list[float]:
        """When some shard's fragment moved on."""
        return sorted(t for points in self.watch.servers.values() for t in round_times(points))


def run(
    workdir: Path, learners: int, schedule: Schedule, seed: int, faults: bool, shards: int = 1
) -> Run:
    fragments = max(FRAGMENTS, shards)
    kinds = SHARD_KINDS if shards > 1 else KINDS
    cluster = Cluster(workdir, learners, fragments=fragments, shards=shards)
    cluster.start()
    watch = Watch(cluster.daemons, cluster.now)
    watch.start()
    rng = random.Random(seed)
    events: list[Event] = []
    ends_at, every_s, started = schedule.duration_s, schedule.fault_every_s, 0.0
    try:
        # The run starts once every learner has joined: on a busy machine starting the
        # daemons can take a good part of a short run, with nothing yet to break or measure.
        wait_until(
            lambda: all(any(p.versions for p in points) for points in watch.learners.values()),
            JOIN_TIMEOUT_S,
            "every learner joining",
        )
        started = cluster.now()
        ends_at, next_fault = started + ends_at, started + every_s
        while cluster.now() < ends_at:
            quiet_tail = cluster.now() > ends_at - schedule.tail_s()
            if faults and not quiet_tail and cluster.now() >= next_fault:
                kind = kinds[len(events) // 2 % len(kinds)]  # every kind in turn
                events += inject(cluster, kind, rng, rng.uniform(*schedule.fault_length_s))
                next_fault = cluster.now() + every_s * rng.uniform(0.5, 1.5)
                if len(events) // 2 == schedule.max_faults:
                    ends_at = min(ends_at, cluster.now() + schedule.tail_s())
                # A restart slowed by a busy machine may end late: training follows it anyway.
                ends_at = max(ends_at, cluster.now() + schedule.quiet_tail_s)
            time.sleep(min(0.2, every_s / 10))
    finally:
        duration_s = cluster.now() - started
        dead = cluster.dead()
        cluster.stop_learners()
        watch.stop()  # after the learners' last merges, before the server goes
        cluster.stop()
    return Run(events, dead, watch, fragments, duration_s)


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
    failures = []
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


# Each preset fills the settings not given on the command line; DEFAULTS fill the rest.
DEFAULTS = {
    "duration_s": 600.0,
    "fault_every_s": 15.0,
    "fault_length_s": [1.0, 4.0],
    "faults": 0,
    "quiet_tail_s": QUIET_TAIL_S,
}
PRESETS = {
    "quick": {"duration_s": 60.0, "fault_every_s": 6.0},
    # Faults of under a second; a server kill lasts as long as the server takes to start
    # again, which sets the pace (docs/RESULTS.md, Chaos). The duration is only a bound.
    "soak": {
        "duration_s": 5400.0,
        "fault_every_s": 1.5,
        "fault_length_s": [0.2, 1.0],
        "faults": 1000,
        "quiet_tail_s": 60.0,
        "max_loss_gap": 0.03,
        "report": SOAK_REPORT,
    },
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="diloco-chaos", description=__doc__.splitlines()[0])
    parser.add_argument("--learners", type=int, default=3)
    parser.add_argument("--duration-s", type=float, help="default 600")
    parser.add_argument("--fault-every-s", type=float, help="default 15")
    parser.add_argument(
        "--fault-length-s", type=float, nargs=2, metavar=("MIN", "MAX"), help="default 1 4"
    )
    parser.add_argument("--faults", type=int, help="end after this many faults (default 0: off)")
    parser.add_argument("--quiet-tail-s", type=float, help="no fault in the last S s (default 10)")
    parser.add_argument(
        "--max-loss-gap", type=float, help="fail if |final / fault-free loss - 1| exceeds this"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shards", type=int, default=1, help="the aggregator as N shards")
    preset = parser.add_mutually_exclusive_group()
    preset.add_argument("--quick", action="store_true", help="60 s with a fault every 6 s")
    preset.add_argument("--soak", action="store_true", help="1,000 faults (module docstring)")
    parser.add_argument("--report", type=Path, default=None, help="write the report as JSON")
    args = parser.parse_args(argv)
    chosen = PRESETS["quick"] if args.quick else PRESETS["soak"] if args.soak else {}
    for key, value in {**DEFAULTS, **chosen}.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    low, high = args.fault_length_s
    if min(args.learners, args.shards) < 1 or args.duration_s <= 0 or args.fault_every_s <= 0:
        parser.error("--learners, --shards, --duration-s and --fault-every-s must be positive")
    if not 0 < low <= high or args.faults < 0 or not args.quiet_tail_s >= 0:
        parser.error("--fault-length-s needs 0 < MIN <= MAX; --faults, --quiet-tail-s >= 0")
    if args.max_loss_gap is not None and not args.max_loss_gap > 0:
        parser.error(f"--max-loss-gap must be positive, got {args.max_loss_gap}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    root = Path(tempfile.mkdtemp(prefix="diloco-chaos-"))
    print(f"workdir {root}", flush=True)
    lengths = (args.fault_length_s[0], args.fault_length_s[1])
    schedule = Schedule(
        args.duration_s, args.fault_every_s, lengths, args.faults, args.quiet_tail_s
    )
    faulty = run(root / "faults", args.learners, schedule, args.seed, True, args.shards)
    # Fault-free for as long as the run with faults lasted.
    same_length = Schedule(faulty.duration_s, args.fault_every_s)
    fault_free = run(root / "fault-free", args.learners, same_length, args.seed, False, args.shards)
    report = evaluate(faulty, fault_free)
    kinds = SHARD_KINDS if args.shards > 1 else KINDS
    report.failures = verdict(report, kinds, args.faults, args.max_loss_gap)
    report.wall_s = time.monotonic() - started
    report.command = shlex.join(["diloco-chaos", *(sys.argv[1:] if argv is None else argv)])
    print(json.dumps({k: v for k, v in asdict(report).items() if k != "timeline"}, indent=1))
    if args.report:
        args.report.parent.mkdir(parents=True, exist_ok=True)
        args.report.write_text(json.dumps(asdict(report), indent=1))
    return 0 if not report.failures else 1


if __name__ == "__main__":
    sys.exit(main())
