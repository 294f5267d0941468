"""Everything the server knows about each learner, in one place: its session and lease, what
its heartbeats report, what it declared at Join, and what its pushes left behind.

    learners = Learners(MembershipConfig(lease_s=10), clock)
    learner = learners.open("a", tokens_per_step=2048)   # a new session, its lease from now
    learners.renew(learner.session_id)                    # every call renews it (NotFound: gone)
    learners.heartbeat(session_id, step, tokens, loss, step_time_s, schedule_step)
    for learner in learners.expired(): learners.close(learner, "lease expired")

A learner holds at most one session: joining again replaces it (the Aggregator closes the old
one first). A session lives as long as its lease, renewed by every call; the Aggregator
closes expired ones, and then the rounds no longer wait for them. The record outlives its
sessions: the weight of its last push (the weight cap, rounds/admission.py), the base
version of its last accepted push per fragment (a retried push counts once,
rounds/policy.py) and its last accepted push (Status) stay when it leaves or rejoins.

Heartbeats report progress: inner-step times (the quorum grace window, pacing) and schedule
steps (where a learner that joins mid-run starts). A report outside the bounds below is
refused whole (InvalidArgument, its lease not renewed): every learner paces and aligns to
what the others report, so in the median each learner's step time counts at most
STEP_TIME_CAP_RATIO times the median of the others'.

Thread safety: sessions and reports have a lock of their own, so that a heartbeat renews its
lease and reports without the Aggregator's lock, whatever holds that (a round's outer step,
a slow fsync of the log): the server's own stall never costs a live learner its lease. The
sessions change (open, close) only under both locks, the Aggregator's first; the records'
push fields only under the Aggregator's.
"""

from __future__ import annotations

import logging
import secrets
import statistics
import threading
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field

from common.errors import InvalidArgument, NotFound

log = logging.getLogger(__name__)

# Bounds of a heartbeat's report. A step time is 0 (none) or finite within
# [MIN_STEP_TIME_S, MAX_STEP_TIME_S]; a schedule step is 0 (none) or positive, at most
# MAX_REPORTED_SCHEDULE_STEP and at most MAX_SCHEDULE_LEAD_STEPS ahead of the furthest
# other live learner's (as moved_on moves it on to now).
MIN_STEP_TIME_S = 1e-6
MAX_STEP_TIME_S = 3600.0
MAX_REPORTED_SCHEDULE_STEP = 2**40
MAX_SCHEDULE_LEAD_STEPS = 2**20
STEP_TIME_CAP_RATIO = 10.0
MAX_SCHEDULE_STEP = 2**53  # exact in float64; no run takes this many steps


@dataclass(kw_only=True)
class MembershipConfig:
    """Learners' sessions and leases (server/learners.py)."""

    lease_s: float = 10.0
    """A learner that neither heartbeats nor calls for this long is dropped from rounds."""

    def __post_init__(self) -> None:
        if not self.lease_s > 0:
            raise ValueError(f"lease_s must be > 0, got {self.lease_s}")


@dataclass
class Learner:
    """One learner id's record. `session_id` is "" while it holds no session."""

    learner_id: str
    session_id: str = ""
    lease_deadline: float = 0.0
    tokens_per_step: int = 0  # declared at Join; 0: none (claims unchecked)
    # The current session's heartbeat reports.
    step: int = 0
    tokens: int = 0
    loss: float = float("nan")
    step_time_s: float = 0.0
    schedule_step: int = 0  # the last one reported, at clock time schedule_at
    schedule_at: float = 0.0
    # What its pushes left behind, kept across sessions.
    last_weight: float | None = None  # the weight its last accepted push counted with
    push_bases: dict[int, int] = field(default_factory=dict)  # fragment -> last base version
    last_push: tuple[int, int, float] | None = None  # (fragment, round version, clock time)
    refused: int = 0  # pushes the token-claim check or the norm guard refused
    # Tokens its accepted pushes claimed, by fragment, since the server started: each
    # fragment's pushes claim the tokens trained since the last, so the largest sum is its
    # tokens trained.
    pushed_tokens: dict[int, int] = field(default_factory=dict)


@dataclass(frozen=True)
class LearnerRow:
    """One learner as the status shows it; a push's fields are -1 before its first."""

    learner_id: str
    live: bool
    last_push_fragment: int
    last_push_version: int  # the version its last push went into
    last_push_s_ago: float
    staleness: int  # versions behind the fragment its last push was computed
    tokens: int  # trained, as its accepted pushes claim them (since the server started)
    weight_share: float  # its last push's weight over the live learners' last weights
    refused: int


def learner_row(x: Learner, now: float, live_weights: float) -> LearnerRow:
    fid, version, at = x.last_push or (-1, -1, now)
    staleness = version - 1 - x.push_bases[fid] if x.last_push and fid in x.push_bases else -1
    share = (x.last_weight or 0.0) / live_weights if x.session_id and live_weights > 0 else 0.0
    tokens = max(x.pushed_tokens.values(), default=0)
    return LearnerRow(
        x.learner_id, bool(x.session_id), fid, version, now - at, staleness, tokens, share,
        x.refused,
    )  # fmt: skip


class Learners:
    """The learners' records; those holding a session are live."""

    def __init__(self, config: MembershipConfig, clock: Callable[[], float]) -> None:
        self.lease_s = config.lease_s
        self._clock = clock
        self._records: dict[str, Learner] = {}
        self._sessions: dict[str, Learner] = {}  # by session id, in the order they opened
        self._lock = threading.RLock()  # sessions and reports (module docstring)

    def open(self, learner_id: str, tokens_per_step: int = 0) -> Learner:
        """A new session for `learner_id` (which holds none), its lease starting now and
        its progress reports reset."""
        learner = self.record(learner_id)
        if learner.session_id:
            raise RuntimeError(f"learner {learner_id} already holds a session")
        with self._lock:
            learner.session_id = secrets.token_hex(16)
            learner.lease_deadline = self._clock() + self.lease_s
            learner.tokens_per_step = tokens_per_step
            learner.step, learner.tokens, learner.loss = 0, 0, float("nan")
            learner.step_time_s, learner.schedule_step, learner.schedule_at = 0.0, 0, 0.0
            self._sessions[learner.session_id] = learner
        log.info(
            "learner=%s joined session=%s live=%d",
            learner_id,
            learner.session_id[:8],
            len(self._sessions),
        )
        return learner

    def renew(self, session_id: str) -> Learner:
        """The session's learner, its lease renewed; NotFound when it expired or never was."""
        with self._lock:
            learner = self._sessions.get(session_id)
            if learner is None:
                raise NotFound("unknown session (it expired or the server restarted); join again")
            learner.lease_deadline = self._clock() + self.lease_s
            return learner

    def of_session(self, session_id: str) -> Learner | None:
        return self._sessions.get(session_id)

    def record(self, learner_id: str) -> Learner:
        """The learner's record, a new one (holding no session) if it never joined."""
        return self._records.setdefault(learner_id, Learner(learner_id))

    def get(self, learner_id: str) -> Learner | None:
        """The learner's record, live or not (None: never joined)."""
        return self._records.get(learner_id)

    def close(self, learner: Learner, why: str, if_expired: bool = False) -> bool:
        """End the learner's session (its record stays); with `if_expired`, only if its lease
        ran out still (a heartbeat may have renewed it since expired()). True if ended."""
        with self._lock:
            if if_expired and learner.lease_deadline >= self._clock():
                return False
            del self._sessions[learner.session_id]
            learner.session_id = ""
        log.info("learner=%s dropped (%s) live=%d", learner.learner_id, why, len(self._sessions))
        return True

    def expired(self) -> list[Learner]:
        """The live learners whose lease has run out (the caller closes them)."""
        with self._lock:
            now = self._clock()
            return [s for s in self._sessions.values() if s.lease_deadline < now]

    def live(self) -> Collection[Learner]:
        """The learners holding a session, in the order their sessions opened."""
        return self._sessions.values()

    def everyone(self) -> list[Learner]:
        """Every learner that ever joined, by id."""
        return [self._records[lid] for lid in sorted(self._records)]

    def heartbeat(
        self,
        session_id: str,
        step: int,
        tokens: int,
        loss: float,
        step_time_s: float,
        schedule_step: int,
    ) -> Learner:
        """Renew the session's lease and record its progress, once the report passed the
        bounds (InvalidArgument: nothing changes). Unreported (zero) step times and schedule
        steps keep the last ones reported."""
        with self._lock:
            if session_id in self._sessions:  # else renew raises NotFound
                self._check_report(session_id, step_time_s, schedule_step)
            learner = self.renew(session_id)
            learner.step, learner.tokens, learner.loss = step, tokens, loss
            if step_time_s > 0:
                learner.step_time_s = step_time_s
            if schedule_step > 0:
                learner.schedule_step, learner.schedule_at = schedule_step, self._clock()
            return learner

    def _check_report(self, session_id: str, step_time_s: float, schedule_step: int) -> None:
        if step_time_s != 0 and not MIN_STEP_TIME_S <= step_time_s <= MAX_STEP_TIME_S:
            raise InvalidArgument(
                f"step_time_s {step_time_s!r} is out of range: report 0 (none) or a time "
                f"between {MIN_STEP_TIME_S:g} and {MAX_STEP_TIME_S:g} seconds"
            )
        if not 0 <= schedule_step <= MAX_REPORTED_SCHEDULE_STEP:
            raise InvalidArgument(
                f"schedule_step {schedule_step} is out of range: report 0 (none) or a step "
                f"up to 2^40"
            )
        others = [at for sid, at in self._schedule_steps_by_session().items() if sid != session_id]
        if others and schedule_step > max(others) + MAX_SCHEDULE_LEAD_STEPS:
            raise InvalidArgument(
                f"schedule_step {schedule_step} is more than {MAX_SCHEDULE_LEAD_STEPS} steps "
                f"ahead of the other learners' (at most {int(max(others))})"
            )

    def median_step_time_s(self) -> float:
        """The live learners' median reported inner-step time (0: none reported)."""
        with self._lock:
            return median_step_time_s([s.step_time_s for s in self._sessions.values()])

    def schedule_estimate(self) -> int:
        """Where the live learners' schedule is now (estimated_schedule_step); 0: none."""
        with self._lock:
            reports = [(s.schedule_step, s.schedule_at) for s in self._sessions.values()]
            return estimated_schedule_step(reports, self._clock(), self.median_step_time_s())

    def schedule_steps(self) -> dict[str, float]:
        """Each live learner's schedule step now, for those that have reported one."""
        with self._lock:
            steps = self._schedule_steps_by_session()
            return {self._sessions[sid].learner_id: at for sid, at in steps.items()}

    def _schedule_steps_by_session(self) -> dict[str, float]:
        now, step_time_s = self._clock(), self.median_step_time_s()
        return {
            s.session_id: moved_on(s.schedule_step, s.schedule_at, now, step_time_s)
            for s in self._sessions.values()
            if s.schedule_step > 0
        }


def median_step_time_s(step_times_s: Iterable[float]) -> float:
    """The median reported inner-step time, each report first capped at STEP_TIME_CAP_RATIO
    times the median of the others': one learner cannot drag the median that every learner
    paces to (with three or more, it cannot move it past the honest ones). 0 when nobody
    reported one."""
    reported = sorted(t for t in step_times_s if t > 0)
    if len(reported) < 2:
        return reported[0] if reported else 0.0
    capped = [
        min(t, STEP_TIME_CAP_RATIO * _median_without(reported, i)) for i, t in enumerate(reported)
    ]
    return statistics.median(capped)


def _median_without(ordered: list[float], skip: int) -> float:
    """The median of the sorted list `ordered` without its element `skip`, in O(1)."""
    n = len(ordered) - 1

    def at(k: int) -> float:  # the k-th of the others
        return ordered[k if k < skip else k + 1]

    return at(n // 2) if n % 2 else (at(n // 2 - 1) + at(n // 2)) / 2


def estimated_schedule_step(
    reports: Iterable[tuple[int, float]], now: float, step_time_s: float
) -> int:
    """Where the live learners' schedule is now, for a learner that joins mid-run.

    Each report (schedule step, clock time it was reported) is moved on by the time since, at
    one schedule step per median step time (with dynamic local updates a slower learner's
    schedule advances at that rate too); the median of those. 0 without reports. In quorum
    mode rounds can close more than once per H steps, so fragment versions do not tell the
    schedule step (the learner's Schedule.resume_step assumes they do: sync mode only).
    """
    estimates = [moved_on(step, at, now, step_time_s) for step, at in reports if step > 0]
    if not estimates:
        return 0
    # Learners report any int64 and any step time (a subnormal one makes the estimate inf):
    # keep the answer an exact integer that fits the reply's int64 field.
    median = statistics.median(estimates)
    return int(median) if median < MAX_SCHEDULE_STEP else MAX_SCHEDULE_STEP


def moved_on(step: int, at: float, now: float, step_time_s: float) -> float:
    """A schedule step reported at clock time `at`, moved on to `now` at one step per
    `step_time_s` (as reported when that is 0)."""
    return step + (max(0.0, now - at) / step_time_s if step_time_s > 0 else 0.0)
