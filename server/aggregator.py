"""The aggregator: the rules of a run, free of gRPC so that every rule is unit-testable.

`Aggregator` is a thin coordinator, under one lock, of:

- `Membership` (server/membership.py): sessions, leases, and where the learners' schedule
  stands;
- `GlobalParams` (server/global_params.py): the model fingerprint fixed by the first learner
  and one `FragmentState` (server/fragment.py) per fragment: the global parameters, their
  version, the outer optimizer state and the open round;
- one round policy (server/rounds.py), picked once from the mode: which pushes a round takes,
  when it closes, what each push weighs, and which outer optimizer the fragments use;
- `PushIntake` (server/intake.py): the rules a push must pass before it counts;
- `Persistence` (server/persistence.py): the state dir's snapshots and log of outer steps.

A learner whose lease expires or who leaves stops counting, so a dead learner never stalls
the others. All methods are thread-safe; `wait_for_version` lets callers (the PullParams
long-poll, tests) block on progress without sleeping.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from common.errors import FailedPrecondition, InvalidArgument
from server.config import AggregatorSections
from server.events import AggregatorEvents
from server.fragment import FragmentState, PullResult, RoundSummary
from server.global_params import GlobalParams, ParamSpec, check_fingerprint
from server.influence import check_tokens_per_step
from server.ingest import DenseBody, PushBody
from server.intake import PushIntake, PushRefused, check_shapes
from server.membership import Membership, Session
from server.persistence import Persistence, Restored, state_identity
from server.rounds import round_policy
from server.sharding import ShardMap

__all__ = ["Aggregator", "JoinResult"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class JoinResult:
    session_id: str
    server_epoch: int
    fragments: list[tuple[int, list[int], int]]  # (fragment_id, param_indices, version)
    lease_s: float
    mode: str
    layout: str
    schedule_step: int = 0  # policy.estimated_schedule_step of the other live learners
    shard_map: ShardMap | None = None  # which shard owns each fragment (server/sharding.py)


class Aggregator:
    """Coordinates the parts named in the module docstring, under one lock."""

    def __init__(
        self,
        config: AggregatorSections,
        clock: Callable[[], float] = time.monotonic,
        events: AggregatorEvents | None = None,
    ) -> None:
        self.config = config
        self.events = events or AggregatorEvents()
        self.server_epoch = secrets.randbits(63)
        self._clock = clock
        self._cond = threading.Condition()
        self._members = Membership(config.membership, clock)
        self._rounds = round_policy(config.rounds, config.outer, clock)
        self._params = GlobalParams(
            config.streaming, self._rounds.new_outer, config.sharding, config.outer.sparse_mean
        )
        self._intake = PushIntake(self._members, self._params, self._rounds, self.events)
        identity = state_identity(config.streaming, config.rounds.mode, config.sharding)
        self._persistence = Persistence(config.persistence, identity, self.events)
        if (restored := self._persistence.restore()) is not None and self.resume(restored):
            # Said out loud: from float32 the conversion loses precision for good (the next
            # snapshot is in the new dtype), and the default is bfloat16 in sync/quorum.
            log.warning(
                "outer state (momentum, pull residual) of the state dir converted to %s "
                "(outer_state_dtype); give --outer-state-dtype to keep another",
                config.outer.outer_state_dtype,
            )
            # The state dtype changed: a snapshot now, so that the log's next records follow
            # a snapshot in the dtype they are made in (a replay runs in the snapshot's).
            with self._cond:
                self._snapshot()

    def resume(self, restored: Restored) -> bool:
        """Rebuild the fragments from a state dir's snapshot and log (also diloco-export's);
        True if their state is now kept in another dtype than the state dir's."""
        with self._cond:
            return self._params.restore(restored, self._rounds.before_replay)

    def checkpoint(self) -> None:
        """Write a snapshot now (at shutdown, so a restart replays nothing)."""
        with self._cond:
            if self._params.fingerprint is not None:
                self._snapshot()
                self._persistence.close()

    def join(
        self, learner_id: str, fingerprint: Sequence[ParamSpec], tokens_per_step: int = 0
    ) -> JoinResult:
        """Open a session; the first fingerprint fixes the model, tokens_per_step the claims."""
        if not learner_id:
            raise InvalidArgument("learner_id must not be empty")
        specs = check_fingerprint(fingerprint)
        check_tokens_per_step(tokens_per_step)
        with self._cond:
            self._params.adopt(specs)
            for old in self._members.of_learner(learner_id):
                self._drop(old, "rejoined")
            schedule_step = self._members.schedule_estimate()
            session = self._members.open(learner_id, tokens_per_step)
            return JoinResult(
                session_id=session.session_id,
                server_epoch=self.server_epoch,
                fragments=self._params.layout(),
                lease_s=self._members.lease_s,
                mode=self._rounds.mode,
                layout=self.config.streaming.layout,
                schedule_step=schedule_step,
                shard_map=self._params.shard_map,
            )

    def heartbeat(
        self,
        session_id: str,
        step: int = 0,
        tokens: int = 0,
        loss: float = float("nan"),
        step_time_s: float = 0.0,
        schedule_step: int = 0,
    ) -> tuple[list[int], int]:
        """Renew a lease and record progress (a report out of bounds: InvalidArgument, no
        change); returns (fragment versions, live learners)."""
        with self._cond:
            self._members.heartbeat(session_id, step, tokens, loss, step_time_s, schedule_step)
            return [f.version for f in self._params.fragments], len(self._members.live())

    def median_step_time_s(self) -> float:
        """The live learners' median reported inner-step time (0: none reported)."""
        with self._cond:
            return self._members.median_step_time_s()

    def schedule_estimate(self) -> int:
        """Where the live learners' schedule is now (server/policy.py); 0: none reported."""
        with self._cond:
            return self._members.schedule_estimate()

    def schedule_steps(self) -> dict[str, float]:
        """Each reporting learner's schedule step now (differences mod H: phase offsets)."""
        with self._cond:
            return self._members.schedule_steps()

    def tick(self) -> None:
        """Expire leases and close rounds whose grace window has passed (call it often)."""
        self.expire_leases()
        with self._cond:
            for fragment in self._params.fragments:
                self._maybe_close(fragment)

    def leave(self, session_id: str) -> None:
        """End a session; open rounds no longer wait for it."""
        with self._cond:
            session = self._members.get(session_id)
            if session is not None:
                self._drop(session, "left")

    def expire_leases(self) -> list[str]:
        """Drop every session whose lease has run out; returns their learner ids."""
        with self._cond:
            expired = self._members.expired()
            for session in expired:
                self._drop(session, "lease expired")
            return [s.learner_id for s in expired]

    def layout(self) -> list[tuple[int, list[int], int]]:
        """(fragment_id, parameter indices, version) of every fragment."""
        with self._cond:
            return self._params.layout()

    def owned(self, crc: bool = False) -> tuple[ShardMap | None, list[tuple[int, int, int]]]:
        """The shard map (None before a fingerprint) and GlobalParams.owned(crc)."""
        with self._cond:
            return self._params.shard_map, self._params.owned(crc)

    def owned_shapes(self) -> list[list[tuple[int, ...]]]:
        """GlobalParams.owned_shapes."""
        with self._cond:
            return self._params.owned_shapes()

    def live_learners(self) -> list[str]:
        with self._cond:
            return sorted(s.learner_id for s in self._members.live())

    def check_push(
        self, session_id: str, fragment_id: int, base_version: int, initial: bool = False
    ) -> list[tuple[int, ...]]:
        """Validate a push header before its payload is read (a stale or duplicate push is
        refused without receiving megabytes first); returns the expected shapes."""
        with self._cond:
            _, fragment = self._intake.check_header(session_id, fragment_id, base_version, initial)
            return list(fragment.shapes)

    def initialize(self, session_id: str, fragment_id: int, tensors: list[torch.Tensor]) -> int:
        """Adopt a learner's initial parameters as version 0 of a fragment that has none."""
        with self._cond:
            _, fragment = self._intake.check_header(session_id, fragment_id, -1, initial=True)
            check_shapes(fragment, [tuple(t.shape) for t in tensors])
            fragment.initialize(tensors)
            self._snapshot()  # durable before anyone can pull it
            self._cond.notify_all()
            return 0

    def push(
        self,
        session_id: str,
        fragment_id: int,
        base_version: int,
        tensors: Sequence[torch.Tensor] | PushBody | DenseBody,
        tokens: int = 0,
        inner_steps: int = 0,
    ) -> int:
        """Add a pseudo-gradient (decoded, or a PushBody checked in its wire encoding outside
        the lock and decoded straight into the round's sum, server/ingest.py) to the open
        round; returns the version it helps produce (the learner waits for that one)."""
        body = tensors if isinstance(tensors, (PushBody, DenseBody)) else DenseBody(tensors)
        adds, ticket, nothing_queued = None, None, False
        try:
            with self._cond:
                session, fragment = self._intake.check_header(
                    session_id, fragment_id, base_version, initial=False
                )
                adds = fragment.round.adds  # this round's, though the push may close it
                try:
                    ticket = self._intake.add(
                        session, fragment, base_version, body, tokens, inner_steps, add_later=True
                    )
                except PushRefused as err:
                    self._maybe_close(fragment)  # it may have been the round's last learner
                    raise FailedPrecondition(f"push refused: {err}") from err
                nothing_queued = ticket is None
                self.events.contribution(fragment.version - base_version)
                round_version = fragment.version + 1
                self._maybe_close(fragment)
        finally:
            if adds is not None and not nothing_queued:
                # The pushes queued to add together, this one among them (FragmentState.add),
                # added now that other pushes can be counted meanwhile (server/round_adds.py).
                adds.run()
        if ticket is not None:
            ticket.check()
        return round_version

    def settle_deferred(self) -> None:
        """Add every round's deferred pushes now, giving their buffers back (the push budget
        asks when a push finds no room: server/receive.py)."""
        with self._cond:
            for fragment in self._params.fragments:
                fragment.settle()

    def session_learner(self, session_id: str) -> str:
        """The learner id that opened the session; NotFound when there is none."""
        with self._cond:
            return self._members.renew(session_id).learner_id

    def has_fragment(self, fragment_id: int) -> bool:
        with self._cond:
            return self._params.has(fragment_id)

    def version(self, fragment_id: int) -> int:
        with self._cond:
            return self._params.fragment(fragment_id).version

    def wait_for_version(
        self, fragment_id: int, version: int, timeout_s: float, gone: Callable[[], bool] = bool
    ) -> int:
        """Block until the fragment reaches `version` (it may not exist yet: before the first
        Join), `timeout_s` passes or `gone()` is true (the caller left: see wake)."""
        with self._cond:
            version_of = self._params.version_of
            self._cond.wait_for(lambda: gone() or version_of(fragment_id) >= version, timeout_s)
            return version_of(fragment_id)

    def wake(self) -> None:
        """Make every wait_for_version caller check its `gone` now."""
        with self._cond:
            self._cond.notify_all()

    def pull(self, session_id: str, fragment_id: int, have_version: int) -> PullResult:
        """What a learner at `have_version` needs: nothing, the update chain, or a snapshot."""
        with self._cond:
            self._members.renew(session_id)
            fragment = self._params.fragment(fragment_id)
            if fragment.params is None:
                raise FailedPrecondition(f"fragment {fragment_id} has no parameters yet")
            return fragment.pull(have_version)

    def params(self, fragment_id: int) -> list[torch.Tensor]:
        """A copy of a fragment's global parameters (for tests and checkpoints)."""
        with self._cond:
            fragment = self._params.fragment(fragment_id)
            return [p.clone() for p in fragment.params or []]

    # -- internals (call with the lock held) ---------------------------------------------

    def _drop(self, session: Session, why: str) -> None:
        # Its excuses go (a rejoin starts clean); its accepted pushes stay in their rounds.
        self._members.remove(session, why)
        for fragment in self._params.fragments:
            fragment.round.excused.discard(session.learner_id)
            self._maybe_close(fragment)

    def _maybe_close(self, fragment: FragmentState) -> None:
        """Close the round if the mode's policy says so (server/rounds.py)."""
        rnd = fragment.round

        def record(mean: list[torch.Tensor], outer_setting: int) -> None:
            # Durable before the lock is released and the version served.
            self._persistence.record(fragment.fragment_id, fragment.version, mean, outer_setting)

        summary = self._rounds.close_if_ready(fragment, self._members.live(), record)
        if summary is None:
            return
        round_s = self._clock() - rnd.opened_at if rnd.opened_at is not None else 0.0
        self.events.round_closed(summary.contributors, round_s, summary.outer_step_s)
        if self._persistence.round_closed():
            self._snapshot()
        _log_round(fragment.fragment_id, summary)
        self._cond.notify_all()

    def _snapshot(self) -> None:
        self._persistence.snapshot(self._params.fingerprint or [], self._params.fragments)


def _log_round(fragment_id: int, summary: RoundSummary) -> None:
    log.info(
        "fragment=%d version=%d contributors=%d tokens=%d outer_step_s=%.4f",
        fragment_id,
        summary.version,
        summary.contributors,
        summary.tokens,
        summary.outer_step_s,
    )
