"""What a running cluster did, from its daemons' Prometheus endpoints: versions, eval losses,
rounds and merged tokens over time. The harnesses' only view of a run besides the learners'
summary files; log text is for people.

    watch = Watch(cluster.daemons, cluster.now)
    watch.start()
    ...                                # faults, kills, waiting
    watch.stop()                       # one last scrape, before the cluster stops
    eval_points(watch.learners["learner-0"])     # [(seconds, eval loss), ...]
    merged_tokens(watch.server)[-1]              # (seconds, tokens summed over fragments)
    summed([merged_tokens(p) for p in watch.servers.values()])   # over every shard

One thread per daemon scrapes it every `interval_s` (a stopped or restarting daemon does not
hold up the others) and keeps a point whenever a figure changed, stamped with the first
scrape that saw it. A restarted daemon is a new process: its counters start again from zero,
which the functions below account for by process id.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass

from deploy.launcher import Daemon
from deploy.prometheus_api import Samples, scrape

SCRAPE_INTERVAL_S = 0.1  # well under an outer step, so no evaluation goes unseen


@dataclass(frozen=True)
class LearnerPoint:
    t: float  # seconds on the cluster's clock
    pid: int
    outer_steps: int
    eval_loss: float  # of the global parameters at the last outer step; NaN before the first
    versions: tuple[int, ...]  # of the learner's replica of each fragment; () before it joined


@dataclass(frozen=True)
class ServerPoint:
    t: float
    pid: int
    versions: tuple[int, ...]  # per fragment
    counters: tuple[tuple[str, float], ...]  # SERVER_COUNTERS since this process started


# Counters the harnesses add up over the run (a restarted server starts them from zero).
SERVER_COUNTERS = {
    "merged_tokens": "diloco_server_merged_tokens_total",  # summed over fragments
    "rounds": "diloco_server_round_contributions_count",
    "contributions": "diloco_server_round_contributions_sum",
    "pushes": "diloco_server_contribution_staleness_versions_count",
    "staleness": "diloco_server_contribution_staleness_versions_sum",
    "discount": "diloco_server_contribution_discount_total",
}


class Watch:
    """Scrapes a cluster's daemons while a run goes on; `servers` (by shard name) and
    `learners` hold what they reported (read them after stop())."""

    def __init__(
        self,
        daemons: Callable[[], dict[str, Daemon]],
        clock: Callable[[], float],
        interval_s: float = SCRAPE_INTERVAL_S,
    ) -> None:
        """`daemons`: the processes by name ("server", "server-S", "learner-I") as they are
        now (a restart replaces one); `clock`: the run's clock, which stamps every point."""
        self.daemons, self.clock, self.interval_s = daemons, clock, interval_s
        self.servers: dict[str, list[ServerPoint]] = {}
        self.learners: dict[str, list[LearnerPoint]] = {}
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        """One scraping thread per daemon running now."""
        for name in self.daemons():
            (self.servers if is_server(name) else self.learners)[name] = []
            thread = threading.Thread(target=self._follow, args=(name,), daemon=True)
            thread.start()
            self._threads.append(thread)

    @property
    def server(self) -> list[ServerPoint]:
        """The points of the server (of shard 0, when there are shards)."""
        return self.servers.get("server", [])

    def stop(self) -> None:
        """Stop scraping, after one last scrape of every daemon."""
        self._stop.set()
        for thread in self._threads:
            thread.join()

    def _follow(self, name: str) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample(name)
        self.sample(name)  # the last look, at stop()

    def sample(self, name: str) -> None:
        """Scrape daemon `name` once and keep a point if anything changed (one thread per
        name, so no two threads append to the same list)."""
        daemon = self.daemons().get(name)
        port = daemon.metrics_port() if daemon is not None else None
        samples = scrape(port, timeout_s=1.0) if port else None
        if daemon is None or samples is None:
            return
        t = self.clock()
        point: LearnerPoint | ServerPoint
        # The expected daemon, not another that has since been given its old port.
        if is_server(name) and samples.has("diloco_server_live_learners"):
            point, series = _server_point(t, daemon.pid, samples), self.servers[name]
        elif samples.has("diloco_learner_info", learner_id=name):
            point, series = _learner_point(t, daemon.pid, samples), self.learners[name]
        else:
            return
        if not series or _figures(series[-1]) != _figures(point):
            series.append(point)


def is_server(name: str) -> bool:
    """A server's (or shard's) name in a cluster (deploy/cluster.py)."""
    return name == "server" or name.startswith("server-")


def _versions(samples: Samples, name: str) -> tuple[int, ...]:
    by_fragment = samples.by_label(name, "fragment")
    return tuple(int(by_fragment[f]) for f in sorted(by_fragment, key=int))


def _server_point(t: float, pid: int, samples: Samples) -> ServerPoint:
    counters = []
    for key, metric in SERVER_COUNTERS.items():
        labelled = samples.by_label(metric, "fragment")
        counters.append((key, sum(labelled.values()) if labelled else samples.value(metric)))
    versions = _versions(samples, "diloco_server_fragment_version")
    counted = tuple((key, 0.0 if math.isnan(value) else value) for key, value in counters)
    return ServerPoint(t, pid, versions, counted)


def _learner_point(t: float, pid: int, samples: Samples) -> LearnerPoint:
    return LearnerPoint(
        t,
        pid,
        int(samples.value("diloco_learner_outer_steps_total")),
        samples.value("diloco_learner_eval_loss"),
        _versions(samples, "diloco_learner_fragment_version"),
    )


def _figures(point: LearnerPoint | ServerPoint) -> tuple:
    """A point without its time; NaN made comparable."""
    values = list(vars(point).values())[1:]
    return tuple("nan" if isinstance(v, float) and math.isnan(v) else v for v in values)


# -- reading a run ---------------------------------------------------------------------------


def eval_points(points: list[LearnerPoint]) -> list[tuple[float, float]]:
    """(time, eval loss) of each evaluation seen: one per outer step of each process, at the
    time its outer step was first seen, with the last loss seen for it (the loss of an outer
    step is recorded a moment after the step is counted)."""
    seen: dict[tuple[int, int], tuple[float, float]] = {}
    for p in points:
        if not math.isnan(p.eval_loss):
            first_t = seen.get((p.pid, p.outer_steps), (p.t, 0.0))[0]
            seen[(p.pid, p.outer_steps)] = (first_t, p.eval_loss)
    return sorted(seen.values())


def recent_eval_loss(points: list[LearnerPoint], before: float = math.inf) -> float:
    """Mean of the last three eval losses seen before `before`: one small eval set is noisy,
    three are steadier. NaN if there were none."""
    losses = [loss for t, loss in eval_points(points) if t <= before][-3:]
    return sum(losses) / len(losses) if losses else math.nan


def counter_over_time(points: list[ServerPoint], key: str) -> list[tuple[float, float]]:
    """(time, total so far) of a SERVER_COUNTERS entry over the whole run, restarts included:
    each process's count adds to what the processes before it had reached."""
    over_time, before, last = [], 0.0, 0.0
    pid = None
    for p in points:
        value = dict(p.counters)[key]
        if p.pid != pid or value < last:  # a new process, whose count starts from zero
            before, pid = before + last, p.pid
        last = value
        over_time.append((p.t, before + value))
    return over_time


def counter_total(points: list[ServerPoint], key: str) -> float:
    over_time = counter_over_time(points, key)
    return over_time[-1][1] if over_time else 0.0


def merged_tokens(points: list[ServerPoint]) -> list[tuple[float, float]]:
    """(time, tokens in closed rounds so far, summed over fragments)."""
    return counter_over_time(points, "merged_tokens")


def summed(series: list[list[tuple[float, float]]]) -> list[tuple[float, float]]:
    """Running totals of several daemons (e.g. each shard's merged tokens) as one: (time,
    the sum of each one's latest value) whenever one of them moved."""
    latest = [0.0] * len(series)
    over_time = []
    for t, k, value in sorted((t, k, v) for k, points in enumerate(series) for t, v in points):
        latest[k] = value
        over_time.append((t, sum(latest)))
    return over_time


def round_times(points: list[ServerPoint]) -> list[float]:
    """Times at which some fragment's version was seen to have moved on (a round closed)."""
    times, best = [], None
    for p in points:
        if not p.versions:
            continue
        total = sum(max(v, 0) for v in p.versions)  # -1 -> 0 is initialisation, not a round
        if best is not None and total > best:
            times.append(p.t)
        best = total if best is None else max(best, total)
    return times


def time_reaching(over_time: list[tuple[float, float]], total: float) -> float:
    """When a running total (counter_over_time) first reached `total`; inf if it never did."""
    return next((t for t, value in over_time if value >= total), math.inf)
