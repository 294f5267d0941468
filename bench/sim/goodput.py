"""Goodput under chip failures: elastic data-parallel against quorum-mode learners.

    scenario = FailureScenario(chips=1_200_000, failures_per_chip_year=1.0)
    elastic_dp_goodput(scenario).goodput
    quorum_goodput(scenario, QuorumSetup(learners=8)).goodput

Failure model (both methods see the same stream of failures, same seed): chip failures
arrive as a Poisson process at `chips · failures_per_chip_year` per year; a failure hits a
uniformly random chip, so in quorum mode a uniformly random learner (they are equal size).
The unit the chip belongs to stops computing for `recovery_s` (detect, swap in a spare,
restart; a second failure while it is down extends it).

- Elastic data-parallel: one synchronous job. Every failure stops all chips for
  `recovery_s`, and the step in progress is lost. Communication is assumed hidden.
- Quorum (Decoupled DiLoCo): `learners` independent learners. The real
  `server.aggregator.Aggregator` in `quorum` mode runs on the virtual clock and decides
  when each fragment round closes (min quorum, grace window from
  `server.rounds.policy.grace_window_s`, leases, token weights, staleness discount and refusal);
  each learner follows `learner.streaming.Schedule` (pushes at offsets p·H/P, skips a
  fragment whose last sync is still out, never waits for a merge) and rejoins at
  `Schedule.resume_step`. Pushes and pulls cross each learner's link (bandwidth, latency);
  a restarted learner first pulls the whole model as an fp32 snapshot.

Goodput = useful chip-seconds / allocated chip-seconds. Useful work is work that reaches the
global model: in quorum mode the steps carried by accepted pushes (each push carries 1/P of
the learner's steps since its last push of that fragment), so work a learner had not pushed
when it failed, and pushes refused as too stale, count as lost. Uptime (chips computing,
useful or not) is reported alongside.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from bench.sim.engine import EventQueue, Link, VirtualClock
from bench.sim.model import FragmentPlan, ModelSpec
from common.errors import AlreadyExists, FailedPrecondition, NotFound
from learner.streaming import Schedule
from server.aggregator import Aggregator
from server.config import aggregator_config
from server.rounds.policy import grace_window_s
from server.state.params import ParamSpec

SECONDS_PER_YEAR = 365.25 * 24 * 3600


@dataclass(frozen=True, kw_only=True)
class FailureScenario:
    chips: int = 1_200_000
    failures_per_chip_year: float = 1.0
    recovery_s: float = 30.0
    """From a chip failure until its unit (the DP job, or one learner) computes again."""
    step_time_s: float = 0.8
    duration_s: float = 4 * 3600.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.chips < 1 or self.failures_per_chip_year < 0 or self.recovery_s < 0:
            raise ValueError("chips must be >= 1, failures_per_chip_year and recovery_s >= 0")
        if not self.step_time_s > 0 or not self.duration_s > 0:
            raise ValueError("step_time_s and duration_s must be > 0")

    def failures(self, units: int) -> list[tuple[float, int]]:
        """(time, unit hit) of every failure in the run; the same stream for any method
        with the same seed, since the unit is drawn after the time."""
        rng = random.Random(self.seed)
        rate_per_s = self.chips * self.failures_per_chip_year / SECONDS_PER_YEAR
        events, t = [], 0.0
        while rate_per_s > 0:
            t += rng.expovariate(rate_per_s)
            if t >= self.duration_s:
                break
            events.append((t, rng.randrange(units)))
        return events


@dataclass(frozen=True)
class GoodputResult:
    goodput: float
    uptime: float
    failures: int
    pushes_accepted: int = 0
    pushes_refused: int = 0
    mean_staleness: float = 0.0


def elastic_dp_goodput(scenario: FailureScenario) -> GoodputResult:
    """One job: compute stops during [failure, failure + recovery_s) windows (merged when
    they overlap) and the step running at each failure is lost."""
    period, duration = scenario.step_time_s, scenario.duration_s
    down_s = lost_s = 0.0
    down_until = 0.0  # the job computes from here on (0: from the start)
    failures = scenario.failures(1)
    for t, _ in failures:
        if t >= down_until:  # it was computing: the step in progress is lost
            lost_s += (t - down_until) % period
            down_s += min(t + scenario.recovery_s, duration) - t
            down_until = t + scenario.recovery_s
        else:  # already down: the recovery now ends later
            until = max(down_until, t + scenario.recovery_s)
            down_s += min(until, duration) - min(down_until, duration)
            down_until = until
    up = duration - down_s
    return GoodputResult((up - lost_s) / duration, up / duration, len(failures))


@dataclass(frozen=True, kw_only=True)
class QuorumSetup:
    learners: int = 8
    min_quorum: int = 0
    """K: pushes a round needs before its grace window starts (0: half the learners)."""
    sync_every_steps: int = 100
    fragments: int = 4
    model_params: float = 10e9
    layers: int = 48
    push_codec: str = "fp4_e2m1"
    pull_codec: str = "fp4_e2m1"
    bandwidth_bps: float = 100e9
    """Each learner's link to the aggregator, each direction."""
    latency_s: float = 0.05
    lease_s: float = 10.0
    grace_steps: float = 5.0
    grace_max_s: float = 10.0
    max_staleness: int = 4


class _Learner:
    def __init__(self, index: int, fragments: int, link: Link, down: Link) -> None:
        self.name = f"learner-{index}"
        self.incarnation = 0
        self.up = False  # computing
        self.failed = False  # between a failure and its recovery (silent: no heartbeats)
        self.down_until = 0.0
        self.up_since = 0.0
        self.session = ""
        self.step = 0
        self.step_at_s = 0.0  # virtual time at which the learner finished `step`
        self.base = [0] * fragments
        self.last_push_step = [0] * fragments
        self.in_flight: set[int] = set()
        self.uplink, self.downlink = link, down


class QuorumRun:
    """One simulated run of quorum-mode learners against the real Aggregator."""

    def __init__(self, scenario: FailureScenario, setup: QuorumSetup) -> None:
        if setup.learners < 1 or not 0 <= setup.min_quorum <= setup.learners:
            raise ValueError("need learners >= 1 and 0 <= min_quorum <= learners")
        self.s, self.q = scenario, setup
        self.clock = VirtualClock()
        self.events = EventQueue(self.clock)
        self.schedule = Schedule(setup.sync_every_steps, setup.fragments)
        spec = ModelSpec.of_size(setup.model_params, setup.layers)
        self.push_bytes = FragmentPlan.build(spec, setup.fragments, setup.push_codec).fragment_bytes
        self.pull_bytes = FragmentPlan.build(spec, setup.fragments, setup.pull_codec).fragment_bytes
        self.snapshot_bytes = FragmentPlan.build(spec, 1, "fp32").total_bytes
        self.chips_per_learner = scenario.chips / setup.learners
        self.agg = Aggregator(
            aggregator_config(
                mode="quorum",
                fragments=setup.fragments,
                min_contributors=setup.min_quorum or max(1, setup.learners // 2),
                lease_s=setup.lease_s,
                grace_steps=setup.grace_steps,
                grace_max_s=setup.grace_max_s,
                max_staleness=setup.max_staleness,
                pull_codec="fp32",  # the simulated payload is tiny; bytes come from the plan
            ),
            clock=self.clock,
        )
        # One stand-in tensor per fragment: the aggregator's rules, not its arithmetic, are
        # what is simulated, so each fragment carries one value (strided layout: block p).
        self.specs = [ParamSpec(f"blocks.{p}.w", (1,), "float32") for p in range(setup.fragments)]
        self.learners = [
            _Learner(
                i,
                setup.fragments,
                Link(bandwidth_bps=setup.bandwidth_bps, latency_s=setup.latency_s),
                Link(bandwidth_bps=setup.bandwidth_bps, latency_s=setup.latency_s),
            )
            for i in range(setup.learners)
        ]
        self.waiting: list[list[tuple[_Learner, int]]] = [[] for _ in range(setup.fragments)]
        self.seen_version = [0] * setup.fragments
        self.useful_chip_s = self.up_chip_s = 0.0
        self.accepted = self.refused = 0
        self.staleness_sum = 0
        self._push_memo: dict[int, list[int]] = {}

    def run(self) -> GoodputResult:
        first = self.agg.join(self.learners[0].name, self.specs).session_id
        for p in range(self.q.fragments):
            self.agg.initialize(first, p, [torch.zeros(1)])
        for learner in self.learners:
            session = first if learner is self.learners[0] else ""
            self._start(learner, session=session, pull_snapshot=False)
        failures = self.s.failures(self.q.learners)
        for t, unit in failures:
            self.events.at(t, lambda u=unit: self._fail(self.learners[u]))
        self._heartbeat()
        bound = 200 * (len(failures) + 1) + int(self.s.duration_s / self.s.step_time_s) * 8
        self.events.run(self.s.duration_s, max_events=bound)
        end = self.s.duration_s
        for learner in self.learners:
            if learner.up:  # work in progress at the end would be pushed: count it
                self.up_chip_s += (end - learner.up_since) * self.chips_per_learner
                steps_done = learner.step + (end - learner.step_at_s) / self.s.step_time_s
                for p in range(self.q.fragments):
                    self._credit(steps_done - learner.last_push_step[p])
        capacity = self.s.chips * self.s.duration_s
        pushes = max(1, self.accepted)
        return GoodputResult(
            goodput=self.useful_chip_s / capacity,
            uptime=self.up_chip_s / capacity,
            failures=len(failures),
            pushes_accepted=self.accepted,
            pushes_refused=self.refused,
            mean_staleness=self.staleness_sum / pushes,
        )

    # -- learner life cycle ---------------------------------------------------------------

    def _start(self, learner: _Learner, session: str = "", pull_snapshot: bool = True) -> None:
        """Join (or rejoin), pull every fragment, resume at the schedule step (as
        learner/session.py does) and start computing once the snapshot is in."""
        learner.failed = False
        learner.session = session or self.agg.join(learner.name, self.specs).session_id
        versions = [version for _, _, version in self.agg.layout()]
        learner.base = list(versions)
        learner.step = self.schedule.resume_step(versions)
        learner.last_push_step = [learner.step] * self.q.fragments
        learner.in_flight.clear()
        nbytes = self.snapshot_bytes if pull_snapshot else 0
        _, ready = learner.downlink.send(self.clock(), nbytes)
        inc = learner.incarnation
        self.events.at(ready, lambda: self._resume(learner, inc))

    def _resume(self, learner: _Learner, inc: int) -> None:
        if inc != learner.incarnation:
            return
        learner.up, learner.up_since, learner.step_at_s = True, self.clock(), self.clock()
        self._schedule_next_push(learner)

    def _fail(self, learner: _Learner) -> None:
        now = self.clock()
        if learner.up:
            self.up_chip_s += (now - learner.up_since) * self.chips_per_learner
        learner.up, learner.failed = False, True
        learner.incarnation += 1  # events of the old incarnation are ignored from now on
        learner.down_until = max(learner.down_until, now + self.s.recovery_s)
        inc = learner.incarnation
        self.events.at(learner.down_until, lambda: self._recover(learner, inc))

    def _recover(self, learner: _Learner, inc: int) -> None:
        if inc == learner.incarnation:
            self._start(learner)

    # -- pushes and pulls ------------------------------------------------------------------

    def _schedule_next_push(self, learner: _Learner) -> None:
        step = learner.step + 1
        while not self._pushes_at(step):  # at most H/P steps away
            step += 1
        t = learner.step_at_s + (step - learner.step) * self.s.step_time_s
        inc = learner.incarnation
        self.events.at(t, lambda: self._push_step(learner, inc, step))

    def _pushes_at(self, step: int) -> list[int]:
        """Schedule.pushes_at, memoised: it is periodic in H past the first period."""
        h = self.q.sync_every_steps
        key = step if step < h else h + step % h
        if key not in self._push_memo:
            self._push_memo[key] = self.schedule.pushes_at(step)
        return self._push_memo[key]

    def _push_step(self, learner: _Learner, inc: int, step: int) -> None:
        if inc != learner.incarnation:
            return
        learner.step, learner.step_at_s = step, self.clock()
        # learner.streaming.StreamingSync is not driven itself: it needs the full model's
        # tensors, a blocking Transport and wall-clock timing (time.perf_counter). Its
        # non-blocking rule is mirrored here: skip a fragment whose last sync is still out.
        for p in self._pushes_at(step):
            if p in learner.in_flight:
                continue  # the last sync of p is still out: the next push carries both
            steps = step - learner.last_push_step[p]
            learner.last_push_step[p] = step
            learner.in_flight.add(p)
            _, arrival = learner.uplink.send(self.clock(), self.push_bytes[p])
            base = learner.base[p]
            self.events.at(
                arrival, lambda p=p, b=base, n=steps: self._arrive(learner, inc, p, b, n)
            )
        self._schedule_next_push(learner)

    def _arrive(self, learner: _Learner, inc: int, p: int, base: int, steps: int) -> None:
        if inc != learner.incarnation:
            return  # the learner died before its push was through
        staleness = self.agg.version(p) - base
        try:
            self.agg.push(
                learner.session, p, base, [torch.ones(1)], tokens=steps, inner_steps=steps
            )
        except (FailedPrecondition, AlreadyExists, NotFound):
            self.refused += 1
            learner.in_flight.discard(p)
            learner.base[p] = self.agg.version(p)  # it pulls and carries on
            return
        self.accepted += 1
        self.staleness_sum += staleness
        self._credit(steps)
        self.waiting[p].append((learner, inc))
        live = len(self.agg.live_learners())
        grace = grace_window_s(
            [self.s.step_time_s] * live, self.q.grace_steps, 0.0, self.q.grace_max_s
        )
        self.events.after(grace, self._tick)
        self._deliver(p)

    def _credit(self, steps: float) -> None:
        """Useful work of one push: `steps` inner steps of one fragment (1/P of the model)."""
        self.useful_chip_s += steps * self.s.step_time_s * self.chips_per_learner / self.q.fragments

    def _deliver(self, p: int) -> None:
        """When fragment p's round closed, send the new version to everyone in that round."""
        version = self.agg.version(p)
        if version == self.seen_version[p]:
            return
        self.seen_version[p] = version
        for learner, inc in self.waiting[p]:
            if inc != learner.incarnation:
                continue
            _, ready = learner.downlink.send(self.clock(), self.pull_bytes[p])
            self.events.at(ready, lambda lr=learner, i=inc: self._merge(lr, i, p, version))
        self.waiting[p] = []

    def _merge(self, learner: _Learner, inc: int, p: int, version: int) -> None:
        if inc == learner.incarnation:
            learner.base[p] = max(learner.base[p], version)
            learner.in_flight.discard(p)

    def _tick(self) -> None:
        self.agg.tick()
        for p in range(self.q.fragments):
            self._deliver(p)

    def _heartbeat(self) -> None:
        """Live learners renew their leases (a dead one falls silent and expires)."""
        for learner in self.learners:
            if not learner.failed:
                try:
                    self.agg.heartbeat(learner.session, step_time_s=self.s.step_time_s)
                except NotFound:  # expired while alive (a snapshot pull past the lease)
                    learner.incarnation += 1
                    learner.up = False
                    self._start(learner)
        self._tick()
        self.events.after(self.q.lease_s / 4, self._heartbeat)


def quorum_goodput(scenario: FailureScenario, setup: QuorumSetup) -> GoodputResult:
    return QuorumRun(scenario, setup).run()
