"""Who takes part in the run: learners' sessions and leases, and where their schedule stands.

A session lives as long as its lease, renewed by every call; the Aggregator drops expired
ones (and then closes the rounds that no longer wait for them). Heartbeats report progress:
inner-step times (the quorum grace window, pacing) and schedule steps (where a learner that
joins mid-run starts). A report outside the bounds below is refused whole (InvalidArgument,
its lease not renewed): every learner paces and aligns to what the others report. Not
thread-safe on its own: the Aggregator calls it with its lock held.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Collection
from dataclasses import dataclass

from common.errors import InvalidArgument, NotFound
from server.config import MembershipConfig
from server.policy import estimated_schedule_step, median_step_time_s, moved_on

log = logging.getLogger(__name__)

# Bounds of a heartbeat's report. A step time is 0 (none) or finite within
# [MIN_STEP_TIME_S, MAX_STEP_TIME_S]; a schedule step is 0 (none) or positive, at most
# MAX_REPORTED_SCHEDULE_STEP and at most MAX_SCHEDULE_LEAD_STEPS ahead of the furthest
# other live learner's (as schedule_steps moves it on to now).
MIN_STEP_TIME_S = 1e-6
MAX_STEP_TIME_S = 3600.0
MAX_REPORTED_SCHEDULE_STEP = 2**40
MAX_SCHEDULE_LEAD_STEPS = 2**20


@dataclass
class Session:
    session_id: str
    learner_id: str
    lease_deadline: float
    step: int = 0
    tokens: int = 0
    loss: float = float("nan")
    step_time_s: float = 0.0
    schedule_step: int = 0  # the last one the learner reported, at clock time schedule_at
    schedule_at: float = 0.0
    tokens_per_step: int = 0  # declared at Join; 0: none (claims unchecked)


class Membership:
    """The live sessions, their leases and progress reports."""

    def __init__(self, config: MembershipConfig, clock: Callable[[], float]) -> None:
        self.lease_s = config.lease_s
        self._clock = clock
        self._sessions: dict[str, Session] = {}

    def open(self, learner_id: str, tokens_per_step: int = 0) -> Session:
        """A new session for `learner_id`, its lease starting now."""
        deadline = self._clock() + self.lease_s
        session = Session(
            secrets.token_hex(16), learner_id, deadline, tokens_per_step=tokens_per_step
        )
        self._sessions[session.session_id] = session
        log.info(
            "learner=%s joined session=%s live=%d",
            learner_id,
            session.session_id[:8],
            len(self._sessions),
        )
        return session

    def renew(self, session_id: str) -> Session:
        """The session, its lease renewed; NotFound when it expired or never existed."""
        session = self._sessions.get(session_id)
        if session is None:
            raise NotFound("unknown session (it expired or the server restarted); join again")
        session.lease_deadline = self._clock() + self.lease_s
        return session

    def get(self, session_id: str) -> Session | None:
        return self._sessions.get(session_id)

    def of_learner(self, learner_id: str) -> list[Session]:
        return [s for s in self._sessions.values() if s.learner_id == learner_id]

    def remove(self, session: Session, why: str) -> None:
        del self._sessions[session.session_id]
        log.info("learner=%s dropped (%s) live=%d", session.learner_id, why, len(self._sessions))

    def expired(self) -> list[Session]:
        """The sessions whose lease has run out (still registered: the caller drops them)."""
        now = self._clock()
        return [s for s in self._sessions.values() if s.lease_deadline < now]

    def heartbeat(
        self,
        session_id: str,
        step: int,
        tokens: int,
        loss: float,
        step_time_s: float,
        schedule_step: int,
    ) -> Session:
        """Renew the session's lease and record its progress, once the report passed the
        bounds (InvalidArgument: nothing changes). Unreported (zero) step times and schedule
        steps keep the last ones reported."""
        if session_id in self._sessions:  # else renew raises NotFound
            self._check_report(session_id, step_time_s, schedule_step)
        session = self.renew(session_id)
        session.step, session.tokens, session.loss = step, tokens, loss
        if step_time_s > 0:
            session.step_time_s = step_time_s
        if schedule_step > 0:
            session.schedule_step, session.schedule_at = schedule_step, self._clock()
        return session

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

    def live(self) -> Collection[Session]:
        return self._sessions.values()

    def median_step_time_s(self) -> float:
        """The live learners' median reported inner-step time (0: none reported)."""
        return median_step_time_s(s.step_time_s for s in self._sessions.values())

    def schedule_estimate(self) -> int:
        """Where the live learners' schedule is now (server/policy.py); 0: none reported."""
        return estimated_schedule_step(
            ((s.schedule_step, s.schedule_at) for s in self._sessions.values()),
            self._clock(),
            self.median_step_time_s(),
        )

    def schedule_steps(self) -> dict[str, float]:
        """Each live learner's schedule step now, for those that have reported one."""
        steps = self._schedule_steps_by_session()
        return {self._sessions[sid].learner_id: at for sid, at in steps.items()}

    def _schedule_steps_by_session(self) -> dict[str, float]:
        now, step_time_s = self._clock(), self.median_step_time_s()
        return {
            s.session_id: moved_on(s.schedule_step, s.schedule_at, now, step_time_s)
            for s in self._sessions.values()
            if s.schedule_step > 0
        }
