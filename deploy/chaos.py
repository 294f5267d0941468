"""Chaos runs: train through injected faults and check that nothing breaks or is lost.

    python -m deploy.chaos --learners 3 --duration-s 600 --fault-every-s 15 --report chaos.json
    python -m deploy.chaos --quick --report chaos.json       # about 2 minutes
    python -m deploy.chaos --soak                            # 1,000 short faults, fault-free beside
    python -m deploy.chaos --shards 2 --quick                # the aggregator as 2 shards

Starts two clusters on loopback at the same time, each a server (quorum mode, with a state
dir) and K learners as real processes, each learner behind its own FaultProxy
(deploy/cluster.py): one gets faults, the other none, so both train under the same machine
load. Every daemon and proxy binds port 0, so the clusters never clash; each has its own
Watch. Each run starts once its learners have joined; the fault-free run lasts as long as
the run with faults did. The learners run at --learner-nice (default 10), below the servers,
which a restart's pace depends on.

The faults (deploy/chaos_faults.py) come one at a time, every kind in turn: learner kill -9
+ restart, learner SIGSTOP/SIGCONT stall, network cut between one learner and the server,
server kill -9 + restart (same port, same state dir; with --shards N > 1 one shard's, while
the others go on). Each lasts a uniform draw from --fault-length-s (a stall's or cut's
length, the wait before a killed process starts again; a server kill lasts until the
restarted server serves). The next fault is due a uniform 0.5-1.5 x --fault-every-s after
the last one ended, and starts only once the cluster has recovered: every shard has closed a
round since; a learner fault hits a learner (seeded draw) whose current process has joined
and seen its versions move on since its own last fault and the last server kill; a server
kill waits until every learner has. No fault starts in the last --quiet-tail-s, and the run
goes on past its end (by 120 s at most) until every shard has closed a round after the last
fault. It checks:

- no learner ever saw a fragment version go backwards (its replica versions, scraped);
- every process that should be alive at the end is;
- training went on after every fault (some shard's versions moved on after it);
- final eval loss next to the fault-free run's; goodput = tokens that reached a closed round
  / tokens the learners had capacity for (the fault-free run's merged tokens).

The verdict (exit status 0, `failures` empty) needs every invariant and a run that was not
ended early by a daemon failing to start again; with --faults N at least N faults, and every
kind of fault (N >= the kinds); and with --max-loss-gap G a final eval loss within G
(relative) of the fault-free run's at its end (the eval loss at equal merged tokens is
reported too). --soak is the long form: --faults 1000, --fault-every-s 0.5, faults of 0.2-1
s, 60 s without faults at the end, G = 0.03, report in bench/results/chaos_soak.json.

Every figure comes from the daemons' Prometheus endpoints, scraped while the run goes on
(deploy/watch.py); the logs in the work directory are for people.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shlex
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from common.retry import wait_until
from deploy.chaos_faults import Event, Faults, kinds_for
from deploy.chaos_report import Run, evaluate, verdict
from deploy.cluster import Cluster
from deploy.watch import Watch

QUIET_TAIL_S = 10.0
JOIN_TIMEOUT_S = 300.0  # bounded, and generous: each learner imports torch first
LOAD_EVERY_S = 10.0
PROGRESS_EVERY = 50  # faults
FOLLOW_S = 120.0  # at most this long past the end, waiting for a round after the last fault
# The learners train flat out; at niceness 10 they leave a restarting server the CPU it needs
# to import torch and restore its state (in a deployment it has a machine of its own). Both
# clusters' learners alike, so the loss comparison stays fair.
LEARNER_NICE = 10
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


def run(
    workdir: Path,
    learners: int,
    schedule: Schedule,
    seed: int,
    faults: bool,
    shards: int = 1,
    length_s: Callable[[], float] | None = None,
    learner_nice: int = LEARNER_NICE,
) -> Run:
    """One cluster's run, with faults (deploy/chaos_faults.py) or without. `length_s`: how
    long to run, asked again and again (inf until known); without it the schedule says."""
    fragments = max(FRAGMENTS, shards)
    cluster = Cluster(workdir, learners, fragments, shards=shards, learner_nice=learner_nice)
    cluster.start()
    watch = Watch(cluster.daemons, cluster.now)
    watch.start()
    rng = random.Random(seed)
    schedule_faults = Faults(kinds_for(shards), rng)
    events: list[Event] = []
    loads: list[float] = []
    every_s, started, aborted = schedule.fault_every_s, 0.0, ""
    try:
        # The run starts once every learner has joined: on a busy machine starting the
        # daemons can take a good part of a short run, with nothing yet to break or measure.
        wait_until(
            lambda: all(any(p.versions for p in points) for points in watch.learners.values()),
            JOIN_TIMEOUT_S,
            "every learner joining",
        )
        started = cluster.now()
        ends_at, next_fault, next_load = started + schedule.duration_s, started + every_s, 0.0
        while True:
            if length_s is not None and cluster.now() >= started + length_s():
                break
            # The run with faults ends once training has followed its last fault too: every
            # shard closed a round after it (within a bound; the check then fails).
            followed = not schedule_faults.injected or schedule_faults.rounds.closed_since(
                watch, schedule_faults.last_end
            )
            if length_s is None and cluster.now() >= ends_at + (0 if followed else FOLLOW_S):
                break
            if cluster.now() >= next_load:
                loads.append(os.getloadavg()[0])
                next_load = cluster.now() + LOAD_EVERY_S
            quiet_tail = cluster.now() > ends_at - schedule.tail_s()
            target = None
            if faults and not quiet_tail and cluster.now() >= next_fault:
                target = schedule_faults.next_target(cluster, watch)  # None: not recovered
            if target is not None:
                try:
                    length = rng.uniform(*schedule.fault_length_s)
                    events += schedule_faults.inject(cluster, target, length)
                except RuntimeError as err:  # a daemon that did not start again
                    aborted = f"{target.kind} {target.index}: {err}"
                    break
                next_fault = cluster.now() + every_s * rng.uniform(0.5, 1.5)
                if schedule_faults.injected % PROGRESS_EVERY == 0:  # for a person watching
                    print(
                        f"{schedule_faults.injected} faults, {cluster.now() - started:.0f} s",
                        flush=True,
                    )
                if schedule_faults.injected == schedule.max_faults:
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
    return Run(events, dead, watch, fragments, duration_s, loads, aborted)


def run_beside(
    root: Path,
    learners: int,
    schedule: Schedule,
    seed: int,
    shards: int = 1,
    learner_nice: int = LEARNER_NICE,
) -> tuple[Run, Run]:
    """The run with faults and a fault-free run at the same time: two clusters of their own
    (every daemon and proxy binds port 0, so none clash), each watched by its own Watch,
    under the same load; the fault-free run lasts as long as the run with faults did, each
    from its learners' joining. Returns (with faults, fault-free)."""
    length = [math.inf]
    runs: list[Run] = []
    errors: list[BaseException] = []

    def with_faults() -> None:
        try:
            faulty = run(
                root / "faults", learners, schedule, seed, True, shards, None, learner_nice
            )
            runs.append(faulty)
            length[0] = runs[0].duration_s
        except BaseException as err:  # re-raised below, once the fault-free run has ended
            errors.append(err)
            length[0] = 0.0

    thread = threading.Thread(target=with_faults, name="chaos-faults")
    thread.start()
    try:
        fault_free = run(
            root / "fault-free", learners, schedule, seed, False, shards, lambda: length[0],
            learner_nice,
        )  # fmt: skip
    finally:
        thread.join()
    if errors:
        raise errors[0]
    return runs[0], fault_free


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
    # Faults of under a second, each once the cluster has recovered from the last, which
    # sets the pace (docs/RESULTS.md, Chaos: Soak). The duration is only a bound.
    "soak": {
        "duration_s": 5400.0,
        "fault_every_s": 0.5,
        "fault_length_s": [0.2, 1.0],
        "faults": 1000,
        "quiet_tail_s": 60.0,
        "max_loss_gap": 0.03,
        "report": SOAK_REPORT,
    },
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m deploy.chaos", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--learners", type=int, default=3)
    default = DEFAULTS
    parser.add_argument("--duration-s", type=float, help=f"default {default['duration_s']:g}")
    parser.add_argument("--fault-every-s", type=float, help=f"default {default['fault_every_s']:g}")
    parser.add_argument(
        "--fault-length-s", type=float, nargs=2, metavar=("MIN", "MAX"),
        help="default {:g} {:g}".format(*default["fault_length_s"]),
    )  # fmt: skip
    parser.add_argument(
        "--faults", type=int, help=f"end after this many faults (default {default['faults']}: off)"
    )
    parser.add_argument(
        "--quiet-tail-s",
        type=float,
        help=f"no fault in the last S s (default {default['quiet_tail_s']:g})",
    )
    parser.add_argument(
        "--max-loss-gap", type=float, help="fail if |final / fault-free loss - 1| exceeds this"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shards", type=int, default=1, help="the aggregator as N shards")
    parser.add_argument(
        "--learner-nice",
        type=int,
        default=LEARNER_NICE,
        help=f"the learners' niceness, 0-19 (default {LEARNER_NICE}: below the servers)",
    )
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
    if not 0 <= args.learner_nice <= 19:
        parser.error(f"--learner-nice must be 0-19, got {args.learner_nice}")
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
    faulty, fault_free = run_beside(
        root, args.learners, schedule, args.seed, args.shards, args.learner_nice
    )
    report = evaluate(faulty, fault_free)
    report.failures = verdict(report, kinds_for(args.shards), args.faults, args.max_loss_gap)
    report.wall_s = time.monotonic() - started
    report.command = shlex.join(
        ["python", "-m", "deploy.chaos", *(sys.argv[1:] if argv is None else argv)]
    )
    print(json.dumps({k: v for k, v in asdict(report).items() if k != "timeline"}, indent=1))
    if args.report:
        args.report.parent.mkdir(parents=True, exist_ok=True)
        args.report.write_text(json.dumps(asdict(report), indent=1))
    return 0 if not report.failures else 1


if __name__ == "__main__":
    sys.exit(main())
