"""Who takes part in the run: learners' sessions and leases, and where their schedule stands.

A session lives as long as its lease, renewed by every call; the Aggregator drops expired
ones (and then closes the rounds that no longer wait for them). Heartbeats report progress:
inner-step times (the quorum grace window, pacing) and schedule steps (where a learner that
joins mid-run starts). Not thread-safe on its own: the Aggregator calls it with its lock held.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Collection
from dataclasses import dataclass

from common.errors import NotFound
from server.config import MembershipConfig
from server.policy import estimated_schedule_step, median_step_time_s, moved_on

log = logging.getLogger(__name__)


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


class Membership:
    """The live sessions, their leases and progress reports."""

    def __init__(self, config: MembershipConfig, clock: Callable[[], float]) -> None:
        self.lease_s = config.lease_s
        self._clock = clock
        self._sessions: dict[str, Session] = {}

    def open(self, learner_id: str) -> Session:
        """A new session for `learner_id`, its lease starting now."""
        session = Session(secrets.token_hex(16), learner_id, self._clock() + self.lease_s)
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

    def report(
        self,
        session: Session,
        step: int,
        tokens: int,
        loss: float,
        step_time_s: float,
        schedule_step: int,
    ) -> None:
        """Record a heartbeat's progress; unreported (zero) step times and schedule steps
        keep the last ones reported."""
        session.step, session.tokens, session.loss = step, tokens, loss
        if step_time_s > 0:
            session.step_time_s = step_time_s
        if schedule_step > 0:
            session.schedule_step, session.schedule_at = schedule_step, self._clock()

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
        now, step_time_s = self._clock(), self.median_step_time_s()
        return {
            s.learner_id: moved_on(s.schedule_step, s.schedule_at, now, step_time_s)
            for s in self._sessions.values()
            if s.schedule_step > 0
        }
