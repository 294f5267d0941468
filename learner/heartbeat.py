"""Heartbeats, and the pace they steer: lease renewal and where the other learners are.

    pacer = Pacer(config.sync)
    heartbeat = Heartbeat(client, learner_id, progress, pacer, membership, schedule_step)
    heartbeat.start()
    ... pacer.steps(progress) schedule steps after each inner step ...
    heartbeat.stop()

A heartbeat renews the learner's lease (every lease_s / 3) and brings back what the server
sees: the fragments' versions, the live learners' median step time and their schedule step.
The pacer turns those into how far one inner step moves this learner's schedule: dynamic
local updates (a slower learner syncs after fewer of its own steps) and phase alignment
(steer towards the others' schedule step). Both apply in quorum and async mode only: in sync
mode every learner keeps the same schedule and the rounds wait for everyone anyway. A shard
that no longer knows the session (NOT_FOUND, or a heartbeat with a new epoch) is noted lost
by the client as it answers (learner/shard_sessions.py), not here.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from common.generated.diloco.v1 import aggregator_pb2 as pb
from learner.client import AggregatorClient
from learner.config import SyncConfig
from learner.progress import Progress

log = logging.getLogger("diloco.learner")

# The server moves the others' reports (up to a heartbeat old) on at their compute speed,
# which runs a step or so ahead of their real one: a smaller error is noise, not drift.
PHASE_DEADBAND = 2


@dataclass(frozen=True)
class Membership:
    """One join's answer, replaced whole at a rejoin so a reader never sees half of two."""

    session_id: str = ""
    server_epoch: int = 0
    lease_s: float = 10.0  # until the server's value arrives at Join


class Pacer:
    """Schedule steps per inner step, from the heartbeats' news; thread-safe."""

    def __init__(self, config: SyncConfig) -> None:
        self.config = config
        self.blocking = True  # sync mode: set at each join from the server's mode
        self.median_step_time_s = 0.0  # of the live learners, from the last heartbeat
        self._lock = threading.Lock()
        self._phase_debt = 0  # schedule steps to gain (> 0) or give back (< 0)

    @property
    def phase_debt(self) -> int:
        return self._phase_debt

    def steps(self, progress: Progress) -> int:
        """How many schedule steps this inner step advances (0: an extra inner step before
        the next push, for a learner ahead of the others)."""
        return max(0, self.pace(progress) + self._phase_correction())

    def pace(self, progress: Progress) -> int:
        """Schedule steps per inner step: 1, or with dynamic local updates (quorum, async)
        how many times slower this learner is than the live learners' median, at most H."""
        if not self.config.dynamic_local_updates or self.blocking:
            return 1
        mine = progress.step_time_s()
        if self.median_step_time_s <= 0 or mine <= 0:
            return 1
        return max(1, min(self.config.sync_every_steps, round(mine / self.median_step_time_s)))

    def _phase_correction(self) -> int:
        """+1 (one schedule step more) while this learner's schedule is behind the live
        learners', -1 while ahead, else 0: quorum and async.

        Learners that never wait drift apart in phase (evaluations, restarts, uneven speed).
        Then each push of a fragment lands in a round of its own, and most contributions are
        stale by the time they arrive, which the server discounts. Steering each learner's
        schedule step, one step at a time, towards the median the server reports keeps the
        pushes of a fragment together, so rounds gather everyone who is on time. A learner
        behind pushes a little sooner; one ahead trains a step more first: nobody waits.
        """
        if self.blocking:
            return 0
        with self._lock:
            if self._phase_debt > 0:
                self._phase_debt -= 1
                return 1
            if self._phase_debt < 0:
                self._phase_debt += 1
                return -1
            return 0

    def set_phase_error(self, cluster_step: int, my_step: int) -> None:
        """Record how far the live learners' schedule (from a heartbeat) is from this
        learner's when it asked; within PHASE_DEADBAND steps counts as in phase.

        Only the phase matters (pushes repeat every H steps), so the error is taken modulo
        H, into [-H/2, H/2): a learner whole periods off never pauses its pushes for long."""
        error = cluster_step - my_step if cluster_step > 0 and my_step > 0 else 0
        h = self.config.sync_every_steps
        error = (error + h // 2) % h - h // 2
        with self._lock:
            self._phase_debt = error if abs(error) >= PHASE_DEADBAND else 0


class Heartbeat:
    """Renews the lease on a daemon thread, and keeps what the server reports."""

    def __init__(
        self,
        client: AggregatorClient,
        learner_id: str,
        progress: Progress,
        pacer: Pacer,
        membership: Callable[[], Membership],
        schedule_step: Callable[[], int],
    ) -> None:
        """`membership`, `schedule_step`: the session's current values, read at each beat."""
        self.client, self.learner_id = client, learner_id
        self.progress, self.pacer = progress, pacer
        self.membership, self.schedule_step = membership, schedule_step
        self.server_versions: list[int] = []  # per fragment, from the last heartbeat
        self._stop = threading.Event()

    def start(self) -> None:
        threading.Thread(target=self._run, daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.membership().lease_s / 3):
            self.beat()

    def beat(self) -> None:
        """Send one heartbeat and take in the answer (one about an older session is dropped)."""
        joined, p = self.membership(), self.progress
        request = pb.HeartbeatRequest(
            session_id=joined.session_id,
            step=p.inner_steps,
            tokens=p.tokens,
            loss=p.last_loss,
            step_time_s=p.step_time_s(),
            schedule_step=self.schedule_step(),
        )
        try:
            reply = self.client.heartbeat(request)
        except grpc.RpcError as err:
            log.warning("learner=%s heartbeat failed: %s", self.learner_id, err.code().name)
            return
        if self.membership().session_id != joined.session_id:
            return  # a rejoin happened meanwhile; this answer is about the old one
        self.server_versions = list(reply.fragment_versions)
        self.pacer.median_step_time_s = reply.median_step_time_s
        self.pacer.set_phase_error(reply.schedule_step, request.schedule_step)
