"""diloco-chaos: train through injected faults and check that nothing breaks or is lost.

    diloco-chaos --learners 3 --duration-s 600 --fault-every-s 15 --report chaos.json
    diloco-chaos --quick --report chaos.json       # about 2 minutes

Starts a server (quorum mode, with a state dir) and K learners as real processes on
loopback; each learner reaches the server through its own FaultProxy. On a seeded schedule it
injects: learner kill -9 + restart, learner SIGSTOP/SIGCONT stalls, server kill -9 + restart
(same port, same state dir), and network cuts between one learner and the server. Then it
runs the same setup without faults for the same time, and checks:

- no learner ever saw a fragment version go backwards (from the learners' logs);
- every process that should be alive at the end is;
- training went on after every fault (rounds closed after it);
- final eval loss next to the fault-free run's; goodput = tokens that reached a closed round
  / tokens the learners had capacity for (the fault-free run's rate × learners × time).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from deploy.faultproxy import FaultProxy

BIN = Path(sys.executable).parent
KINDS = ("learner_kill", "learner_stall", "server_kill", "net_cut")
QUIET_TAIL_S = 10.0
MODEL_FLAGS = [
    "--n-layer",
    "2",
    "--n-embd",
    "64",
    "--n-head",
    "4",
    "--block-size",
    "64",
    "--batch-size",
    "8",
    "--sync-every-steps",
    "20",
    "--eval-batches",
    "4",
    "--corpus-max-bytes",
    "1000000",
    "--status-every-s",
    "0",  # the checks read every outer step's line
]


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


class Cluster:
    """A server and K learners, each learner behind its own FaultProxy."""

    def __init__(
        self,
        workdir: Path,
        learners: int,
        fragments: int,
        mode: str = "quorum",
        learner_flags: dict[int, list[str]] | None = None,
    ) -> None:
        """`learner_flags`: extra flags for some learners (e.g. a --slowdown)."""
        self.workdir, self.k, self.fragments = workdir, learners, fragments
        self.mode = mode
        self.learner_flags = learner_flags or {}
        workdir.mkdir(parents=True, exist_ok=True)
        self.port = 0
        self.server: subprocess.Popen | None = None
        self.learners: dict[int, subprocess.Popen] = {}
        self.proxies: dict[int, FaultProxy] = {}
        self.started = time.monotonic()

    def start(self) -> None:
        self.start_server()
        for i in range(self.k):
            self.proxies[i] = FaultProxy(("127.0.0.1", self.port))
            self.proxies[i].start()
            self.start_learner(i)

    def start_server(self) -> None:
        port_file = self.workdir / "server.port"
        port_file.unlink(missing_ok=True)
        log = open(self.workdir / "server.log", "a")
        self.server = subprocess.Popen(
            [
                BIN / "diloco-server",
                "--insecure",  # loopback only
                "--listen",
                f"127.0.0.1:{self.port}",
                "--port-file",
                port_file,
                "--state-dir",
                self.workdir / "state",
                "--mode",
                self.mode,
                "--fragments",
                str(self.fragments),
                "--lease-s",
                "3",
                "--grace-max-s",
                "1",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 60
        while not port_file.exists():
            if self.server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"diloco-server did not start; see {log.name}")
            time.sleep(0.05)
        self.port = int(port_file.read_text())

    def start_learner(self, i: int) -> None:
        log = open(self.workdir / f"learner-{i}.log", "a")
        self.learners[i] = subprocess.Popen(
            [
                BIN / "diloco-learner",
                "--insecure",
                "--server",
                f"127.0.0.1:{self.proxies[i].port}",
                "--learner-id",
                f"learner-{i}",
                "--learners-per-host",
                str(self.k),
                "--max-outer-steps",
                "100000000",
                "--summary-file",
                self.workdir / f"learner-{i}.json",
                *MODEL_FLAGS,
                *self.learner_flags.get(i, []),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    def now(self) -> float:
        return time.monotonic() - self.started

    def stop(self) -> None:
        for proc in self.learners.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.terminate()
        for proc in self.learners.values():
            _wait(proc)
        if self.server is not None and self.server.poll() is None:
            self.server.terminate()
            _wait(self.server)
        for proxy in self.proxies.values():
            proxy.close()


def inject(cluster: Cluster, kind: str, rng: random.Random, length_s: float) -> list[Event]:
    """One fault, start to end (blocking for its length); returns its two events."""
    i = rng.randrange(cluster.k)
    target = "server" if kind == "server_kill" else f"learner-{i}"
    events = [Event(cluster.now(), kind, target, "start")]
    if kind == "learner_kill":
        cluster.learners[i].kill()
        cluster.learners[i].wait()
        time.sleep(length_s)
        cluster.start_learner(i)
    elif kind == "learner_stall":
        cluster.learners[i].send_signal(signal.SIGSTOP)
        time.sleep(length_s)
        cluster.learners[i].send_signal(signal.SIGCONT)
    elif kind == "server_kill":
        assert cluster.server is not None
        cluster.server.kill()
        cluster.server.wait()
        time.sleep(length_s)
        cluster.start_server()
    else:
        cluster.proxies[i].cut()
        time.sleep(length_s)
        cluster.proxies[i].restore()
    events.append(Event(cluster.now(), kind, target, "end"))
    return events


def run(
    workdir: Path, learners: int, duration_s: float, fault_every_s: float, seed: int, faults: bool
) -> tuple[list[Event], Cluster]:
    cluster = Cluster(workdir, learners, fragments=2)
    cluster.start()
    rng = random.Random(seed)
    events: list[Event] = []
    try:
        next_fault = fault_every_s
        while cluster.now() < duration_s:
            # No fault starts in the last stretch, so every fault is followed by training.
            # (long enough to re-sync after a server restart: lease, heartbeat, rejoin backoff).
            quiet_tail = cluster.now() > duration_s - max(fault_every_s, QUIET_TAIL_S)
            if faults and not quiet_tail and cluster.now() >= next_fault:
                kind = KINDS[len(events) // 2 % len(KINDS)]  # every kind in turn
                events += inject(cluster, kind, rng, length_s=rng.uniform(1.0, 4.0))
                next_fault = cluster.now() + fault_every_s * rng.uniform(0.5, 1.5)
            time.sleep(0.2)
    finally:
        dead = [f"learner-{i}" for i, p in cluster.learners.items() if p.poll() is not None]
        if cluster.server is None or cluster.server.poll() is not None:
            dead.append("server")
        cluster.dead = dead  # type: ignore[attr-defined]
        cluster.stop()
    return events, cluster


_VERSIONS = re.compile(r"versions=\[([\d, ]*)\] eval_loss=([\d.]+)")
_ROUND = re.compile(r"^(\S+ \S+),(\d+) server\.aggregator fragment=\d+ version=\d+ .*tokens=(\d+)")


def version_regressions(log_text: str) -> int:
    """Lines where some fragment version is lower than this learner saw before."""
    best: list[int] = []
    regressions = 0
    for match in _VERSIONS.finditer(log_text):
        versions = [int(v) for v in match.group(1).split(",") if v.strip()]
        if best and any(v < b for v, b in zip(versions, best, strict=False)):
            regressions += 1
        best = [max(v, b) for v, b in zip(versions, best, strict=False)] or versions
    return regressions


def last_eval_loss(workdir: Path, learners: int, before: float = float("inf")) -> float:
    """Mean over learners of their last three eval losses (of the global model) logged
    before the wall-clock time `before`: one small eval set is noisy, three are steadier."""
    losses = []
    for i in range(learners):
        found = [
            float(match.group(2))
            for line in (workdir / f"learner-{i}.log").read_text().splitlines()
            if (match := _VERSIONS.search(line)) and _stamp(line) <= before
        ]
        if found:
            losses.append(sum(found[-3:]) / len(found[-3:]))
    return sum(losses) / len(losses) if losses else float("nan")


def _stamp(line: str) -> float:
    """Epoch seconds of a log line that starts with logging's asctime, else +inf."""
    try:
        date, clock = line.split(" ")[:2]
        seconds, millis = clock.split(",")
        return (
            time.mktime(time.strptime(f"{date} {seconds}", "%Y-%m-%d %H:%M:%S"))
            + int(millis) / 1000
        )
    except ValueError:
        return float("inf")


def time_of_tokens(workdir: Path, tokens: int, fragments: int) -> float:
    """When the run's closed rounds first carried `tokens` tokens (each counted once)."""
    total = 0
    for line in (workdir / "server.log").read_text().splitlines():
        match = _ROUND.match(line)
        if match:
            total += int(match.group(3))
            if total // fragments >= tokens:
                return _stamp(line)
    return float("inf")


def round_times_and_tokens(workdir: Path) -> tuple[list[float], int]:
    """Wall-clock times (epoch seconds) of closed rounds, and the tokens they carried."""
    times, tokens = [], 0
    for line in (workdir / "server.log").read_text().splitlines():
        match = _ROUND.match(line)
        if match:
            stamp = time.mktime(time.strptime(match.group(1), "%Y-%m-%d %H:%M:%S"))
            times.append(stamp + int(match.group(2)) / 1000)
            tokens += int(match.group(3))
    return times, tokens


def main() -> int:
    parser = argparse.ArgumentParser(prog="diloco-chaos", description=__doc__.splitlines()[0])
    parser.add_argument("--learners", type=int, default=3)
    parser.add_argument("--duration-s", type=float, default=600.0)
    parser.add_argument("--fault-every-s", type=float, default=15.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="60 s with a fault every 6 s")
    parser.add_argument("--report", type=Path, default=None, help="write the report as JSON")
    args = parser.parse_args()
    if args.quick:
        args.duration_s, args.fault_every_s = 60.0, 6.0
    if args.learners < 1 or args.duration_s <= 0 or args.fault_every_s <= 0:
        parser.error("--learners, --duration-s and --fault-every-s must be positive")
    root = Path(tempfile.mkdtemp(prefix="diloco-chaos-"))
    print(f"workdir {root}", flush=True)
    wall_started = time.time()
    events, cluster = run(
        root / "faults", args.learners, args.duration_s, args.fault_every_s, args.seed, faults=True
    )
    _, baseline = run(
        root / "fault-free",
        args.learners,
        args.duration_s,
        args.fault_every_s,
        args.seed,
        faults=False,
    )
    report = evaluate(root, args, events, cluster, wall_started)
    print(json.dumps({k: v for k, v in asdict(report).items() if k != "timeline"}, indent=1))
    if args.report:
        args.report.write_text(json.dumps(asdict(report), indent=1))
    return 0 if report.invariants_ok else 1


def evaluate(
    root: Path, args, events: list[Event], cluster: Cluster, wall_started: float
) -> Report:
    faults, free = root / "faults", root / "fault-free"
    report = Report(duration_s=args.duration_s, timeline=[asdict(e) for e in events])
    for e in events:
        if e.phase == "start":
            report.faults_by_kind[e.kind] = report.faults_by_kind.get(e.kind, 0) + 1
    report.version_regressions = sum(
        version_regressions((faults / f"learner-{i}.log").read_text()) for i in range(args.learners)
    )
    report.dead_processes = cluster.dead  # type: ignore[attr-defined]
    round_times, report.useful_tokens = round_times_and_tokens(faults)
    free_times, free_tokens = round_times_and_tokens(free)
    fault_ends = [wall_started + e.t_s for e in events if e.phase == "end"]
    report.faults_without_progress = sum(
        1 for end in fault_ends if not any(t > end for t in round_times)
    )
    report.useful_tokens //= 2  # each token is counted once per fragment (P = 2)
    report.capacity_tokens = free_tokens // 2  # what the same learners do without faults
    report.goodput = report.useful_tokens / max(1, report.capacity_tokens)
    report.final_eval_loss = last_eval_loss(faults, args.learners)
    # The fault-free run at the point where it had trained the same (useful) tokens.
    same_tokens_at = time_of_tokens(free, report.useful_tokens, fragments=2)
    report.fault_free_eval_loss = last_eval_loss(free, args.learners, before=same_tokens_at)
    report.invariants_ok = (
        report.version_regressions == 0
        and not report.dead_processes
        and report.faults_without_progress == 0
    )
    return report


def _wait(proc: subprocess.Popen) -> None:
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


if __name__ == "__main__":
    sys.exit(main())
