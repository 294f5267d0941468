"""The chaos harness's faults: their kinds, when the next one may start, and injecting one.

    faults = Faults(KINDS, random.Random(seed))
    target = faults.next_target(cluster, watch)   # None: the cluster has not recovered yet
    if target is not None:
        events = faults.inject(cluster, target, length_s=0.5)

Faults come one at a time, every kind in turn (learner kill -9 + restart, learner
SIGSTOP/SIGCONT stall, network cut, then server kill -9 + restart; with shards, one shard's
kill instead), and each waits until the cluster has recovered from the ones before it, so a
dense schedule stays survivable:

- every shard has closed a round since the previous fault ended;
- a learner fault hits a learner drawn (seeded) among those that are *back*: its current
  process has joined and its replica versions have moved on since that learner's own last
  fault and since the last server (or shard) kill ended; a killed learner is back once its
  new process has joined and seen a newer version than it joined with;
- a server (or shard) kill waits until every learner is back, or still starting after a
  kill of its own (its new process has not joined yet, so the kill cannot catch it
  half-way back; it joins once the server serves again).

Until then the kind waits its turn (deploy/chaos.py's run loop asks again); nothing is
skipped, so the kinds stay in turn. The readiness rules read only what the daemons' metrics
reported (deploy/watch.py).
"""

from __future__ import annotations

import math
import random
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass

from deploy.cluster import Cluster
from deploy.watch import LearnerPoint, ServerPoint, Watch

# The learner kill first and the server kill last: a killed learner has the two faults in
# between to start again before the server kill waits for it.
KINDS = ("learner_kill", "learner_stall", "net_cut", "server_kill")
# With more than one shard a shard is killed instead of the whole server: the others go on.
SHARD_KINDS = ("learner_kill", "learner_stall", "net_cut", "shard_kill")
SERVER_KINDS = ("server_kill", "shard_kill")


def kinds_for(shards: int) -> tuple[str, ...]:
    """The fault kinds of a run with this many aggregator shards."""
    return SHARD_KINDS if shards > 1 else KINDS


@dataclass
class Event:
    t_s: float
    kind: str
    target: str
    phase: str  # "start" or "end"


@dataclass(frozen=True)
class Target:
    """The next fault: its kind and whom it hits (a learner's or a shard's index)."""

    kind: str
    index: int


def is_back(points: Sequence[LearnerPoint], pid: int, since: float) -> bool:
    """Whether learner process `pid` has joined and seen its replica versions move on after
    `since`: past the last versions it had reported by then, or, for a process started
    after `since`, past the versions it joined with."""
    own = [p for p in points if p.pid == pid and p.versions]
    before = [p for p in own if p.t <= since]
    after = [p for p in own if p.t > since]
    if not after:
        return False
    baseline = sum(before[-1].versions) if before else sum(after[0].versions)
    return any(sum(p.versions) > baseline for p in after)


class LastRounds:
    """When each shard last closed a round, as deploy/watch.py's round_times would say, read
    from a Watch incrementally: each call looks only at the points that came since the last
    one (a soak's Watch holds tens of thousands, and a waiting fault asks often)."""

    def __init__(self) -> None:
        self._read: dict[str, tuple[int, int | None, float]] = {}  # seen, best, last round

    def closed_since(self, watch: Watch, t: float) -> bool:
        """Whether every shard has closed a round after `t`."""
        last = [self._update(name, points) for name, points in list(watch.servers.items())]
        return bool(last) and all(at > t for at in last)

    def _update(self, name: str, points: Sequence[ServerPoint]) -> float:
        seen, best, last = self._read.get(name, (0, None, -math.inf))
        count = len(points)  # the scraping thread may append meanwhile
        for p in points[seen:count]:
            if not p.versions:
                continue
            total = sum(max(v, 0) for v in p.versions)  # as round_times counts them
            if best is not None and total > best:
                last = p.t
            best = total if best is None else max(best, total)
        self._read[name] = (count, best, last)
        return last


class Faults:
    """The fault schedule of one run: whose turn it is, who is back, what was injected."""

    def __init__(self, kinds: Sequence[str], rng: random.Random) -> None:
        self.kinds, self.rng = tuple(kinds), rng
        self.injected = 0
        self.last_end = -1.0  # on the cluster's clock; no fault yet
        self.since: dict[str, float] = {}  # learner name -> its last fault's or server kill's end
        self.rounds = LastRounds()

    @property
    def kind(self) -> str:
        """The kind whose turn it is."""
        return self.kinds[self.injected % len(self.kinds)]

    def back(self, cluster: Cluster, watch: Watch) -> list[int]:
        """The learners that are back since their last fault (module docstring)."""
        return [
            i
            for i, daemon in sorted(cluster.learners.items())
            if daemon.running()
            and is_back(
                list(watch.learners.get(f"learner-{i}", [])),
                daemon.pid,
                self.since.get(f"learner-{i}", -1.0),
            )
        ]

    def starting(self, cluster: Cluster, watch: Watch) -> list[int]:
        """The learners whose current process runs but has not joined yet."""
        return [
            i
            for i, daemon in sorted(cluster.learners.items())
            if daemon.running()
            and not any(
                p.pid == daemon.pid and p.versions
                for p in list(watch.learners.get(f"learner-{i}", []))
            )
        ]

    def next_target(self, cluster: Cluster, watch: Watch) -> Target | None:
        """The fault to inject now, or None while the cluster has not recovered."""
        if not self.rounds.closed_since(watch, self.last_end):
            return None
        back = self.back(cluster, watch)
        if self.kind in SERVER_KINDS:
            if len(back) + len(self.starting(cluster, watch)) < cluster.k:
                return None
            return Target(self.kind, self.rng.randrange(cluster.shards))
        return Target(self.kind, self.rng.choice(back)) if back else None

    def inject(self, cluster: Cluster, target: Target, length_s: float) -> list[Event]:
        """One fault, start to end (blocking for its length and any restart); its events."""
        kind, i = target.kind, target.index
        server_kill = kind in SERVER_KINDS
        name = cluster.shard_name(i) if server_kill else f"learner-{i}"
        events = [Event(cluster.now(), kind, name, "start")]
        self.injected += 1
        if kind == "learner_kill":
            cluster.learners[i].kill()
            time.sleep(length_s)
            cluster.start_learner(i)
        elif kind == "learner_stall":
            cluster.learners[i].signal(signal.SIGSTOP)
            time.sleep(length_s)
            cluster.learners[i].signal(signal.SIGCONT)
        elif server_kill:
            cluster.servers[i].kill()
            time.sleep(length_s)
            cluster.start_server(i)  # returns once it serves again
        else:
            for proxy in cluster.proxies[i]:
                proxy.cut()
            time.sleep(length_s)
            for proxy in cluster.proxies[i]:
                proxy.restore()
        self.last_end = cluster.now()
        events.append(Event(self.last_end, kind, name, "end"))
        for learner in [f"learner-{j}" for j in range(cluster.k)] if server_kill else [name]:
            self.since[learner] = self.last_end
        return events
