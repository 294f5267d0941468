"""The aggregator: the rules of a run, free of gRPC so that every rule is unit-testable.

`Aggregator` coordinates, under one lock: `Learners` (learners.py: each learner's session,
lease, reports and pushes); `GlobalParams` (state/params.py: the fingerprint the first learner
fixes and one `FragmentState` per fragment); `Admission` (rounds/admission.py: what a push
must pass and weighs); one round policy (rounds/policy.py: when a round closes, and the
close); and `Persistence` (state/store.py: the state dir). A learner whose lease expires or
who leaves stops counting. All methods are thread-safe; `wait_for_version` blocks on progress.
"""

from __future__ import annotations

import functools
import logging
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from common.errors import FailedPrecondition, InvalidArgument
from server.config import AggregatorSections, changed_settings, recorded_settings
from server.learners import Learner, Learners
from server.readings import Readings
from server.rounds.admission import Admission, PushRefused, check_shapes, check_tokens_per_step
from server.rounds.ingest import DenseBody, PushBody
from server.rounds.policy import RoundSummary, round_policy
from server.rounds.slices import SlicedBody
from server.state.formats import Restored
from server.state.fragment import FragmentState, PullResult
from server.state.params import GlobalParams, ParamSpec, ShardMap, check_fingerprint, state_identity
from server.state.store import Persistence, StateDirFailed

__all__ = ["Aggregator", "AggregatorEvents", "JoinResult"]

log = logging.getLogger(__name__)


class AggregatorEvents:
    """What the aggregator reports as it works, for metrics (rpc/metrics.py; this default
    ignores it), under its lock: a listener must be quick and not call back into it."""

    def contribution(self, staleness_versions: int) -> None:
        """A pseudo-gradient was accepted, computed this many versions behind the global."""

    def round_closed(self, fragment_id: int, summary: RoundSummary, round_s: float) -> None:
        """A fragment's round closed (its pushes, tokens, outer step), open for round_s."""

    def influence_bounded(self, action: str) -> None:
        """One push was bounded: weight_capped or claim_refused."""

    def snapshot_written(self, seconds: float) -> None:
        """A durable snapshot of the whole state was written."""

    def leases_expired(self, count: int) -> None:
        """`count` sessions were closed because their lease ran out (0 on most ticks)."""


@dataclass(frozen=True)
class JoinResult:
    session_id: str
    server_epoch: int
    fragments: list[tuple[int, list[int], int]]  # (fragment_id, param_indices, version)
    lease_s: float
    mode: str
    layout: str
    schedule_step: int = 0  # where the other live learners' schedule is now
    shard_map: ShardMap | None = None


class Aggregator(Readings):
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
        self._cond, self._waker_pending = threading.Condition(), threading.Lock()  # wake()
        self._learners = Learners(config.membership, clock)
        self._policy = round_policy(config.rounds, config.outer, clock)
        self._params = GlobalParams(
            config.streaming, self._policy.new_outer, config.sharding, config.outer.sparse_mean
        )
        self._admission = Admission(config.rounds, self._policy, self.events, clock)
        identity = state_identity(config.streaming, config.rounds.mode, config.sharding)
        durable = functools.partial(self._admission.durable, self._learners)
        args = (identity, self.events, self._cond, recorded_settings(config), durable)
        self._store = Persistence(config.persistence, *args)
        self.setting_changes: list[tuple] = []  # what a restart changed: (setting, was, now)
        if (restored := self._store.restore()) is not None:
            converted = self.resume(restored)
            versions = [f.version for f in self._params.fragments]
            self.setting_changes = changed_settings(restored, config, versions)
            if converted or restored.rewrite or self.setting_changes:
                # Now: the next records follow a snapshot of their settings and dtype.
                with self._cond:
                    self._store.snapshot(self._params)

    def wake(self) -> None:
        """Make every wait_for_version caller check its `gone` now. gRPC calls this on the
        thread all calls' events pass through: it never waits for the lock, one thread does."""
        if self._cond.acquire(blocking=False):
            self._cond.notify_all()
            self._cond.release()
        elif self._waker_pending.acquire(blocking=False):
            threading.Thread(target=self._wake_when_free, name="wake", daemon=True).start()

    def _wake_when_free(self) -> None:
        with self._cond:  # a wake after the release is covered by this notify
            self._waker_pending.release()
            self._cond.notify_all()

    def resume(self, restored: Restored) -> bool:
        """Rebuild the fragments from a state dir (diloco-export's too); True: a dtype changed."""
        with self._cond:
            converted = self._params.restore(restored, self._policy.before_replay)
            self._admission.restore(restored.admission, self._learners)  # once replayed
            return converted

    def checkpoint(self) -> None:
        """A snapshot now (at shutdown: a restart replays nothing), unless the dir failed."""
        with self._cond:
            if self._params.fingerprint is not None and self._store.failure is None:
                self._store.snapshot(self._params)
            self._store.close()

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
            if (known := self._learners.get(learner_id)) is not None and known.session_id:
                self._drop(known, "rejoined")
            schedule_step = self._learners.schedule_estimate()
            learner = self._learners.open(learner_id, tokens_per_step)
            return JoinResult(
                session_id=learner.session_id,
                server_epoch=self.server_epoch,
                fragments=self._params.layout(),
                lease_s=self._learners.lease_s,
                mode=self._policy.mode,
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
        change); returns (fragment versions, live learners). Without the lock: a round's
        close, a log write or a snapshot never holds up a heartbeat (learners.py)."""
        self._learners.heartbeat(session_id, step, tokens, loss, step_time_s, schedule_step)
        return [f.version for f in list(self._params.fragments)], len(self._learners.live())

    def tick(self) -> None:
        """Expire leases and close rounds whose grace window has passed (call it often)."""
        self.expire_leases()
        with self._cond:
            for fragment in self._params.fragments:
                self._maybe_close(fragment)

    def leave(self, session_id: str) -> None:
        """End a session; open rounds no longer wait for it."""
        with self._cond:
            if (learner := self._learners.of_session(session_id)) is not None:
                self._drop(learner, "left")

    def expire_leases(self) -> list[str]:
        """Drop every session whose lease has run out; returns their learner ids."""
        with self._cond:
            expired = [x for x in self._learners.expired() if self._drop(x, "lease expired", True)]
            self.events.leases_expired(len(expired))
            return [learner.learner_id for learner in expired]

    def check_push(
        self, session_id: str, fragment_id: int, base_version: int, initial: bool = False
    ) -> list[tuple[int, ...]]:
        """Validate a push header before its payload is read (a stale or duplicate push is
        refused without receiving megabytes first); returns the expected shapes."""
        with self._cond:
            return list(self._checked(session_id, fragment_id, base_version, initial)[1].shapes)

    def initialize(self, session_id: str, fragment_id: int, tensors: list[torch.Tensor]) -> int:
        """Adopt a learner's initial parameters as version 0 of a fragment that has none."""
        with self._cond:  # a snapshot being written first: the wait gives the lock up
            self._cond.wait_for(lambda: not self._store.snapshot_running)
            _, fragment = self._checked(session_id, fragment_id, -1, initial=True)
            check_shapes(fragment_id, fragment.shapes, [tuple(t.shape) for t in tensors])
            fragment.initialize(tensors)
            try:
                self._store.snapshot(self._params)  # durable before anyone can pull it
            except StateDirFailed:
                fragment.params, fragment.version = None, -1  # not durable: not there
                raise
            self._cond.notify_all()
            return 0

    def push(
        self,
        session_id: str,
        fragment_id: int,
        base_version: int,
        tensors: Sequence[torch.Tensor] | PushBody | DenseBody | SlicedBody,
        tokens: int = 0,
        inner_steps: int = 0,
    ) -> int:
        """Add a pseudo-gradient (decoded, or a body checked outside the lock: rounds/ingest.py,
        rounds/slices.py) to the open round; returns the version it helps produce."""
        body = DenseBody(tensors) if isinstance(tensors, (list, tuple)) else tensors
        adds, ticket, nothing_queued = None, None, False
        try:
            with self._cond:
                learner, fragment = self._checked(session_id, fragment_id, base_version, False)
                adds = fragment.round.adds  # this round's, though the push may close it
                live = self._learners.live()
                try:
                    ticket = self._admission.admit(
                        learner, fragment, base_version, body, tokens, inner_steps, live, True
                    )
                except PushRefused as err:
                    self._maybe_close(fragment)  # it may have been the round's last learner
                    raise FailedPrecondition(f"push refused: {err}") from err
                nothing_queued = ticket is None
                round_version = fragment.version + 1
                self._maybe_close(fragment)
        finally:
            if adds is not None and not nothing_queued:
                adds.run()  # the queued pushes, this one among them, outside the lock (round.py)
        if ticket is not None:
            ticket.check()
        return round_version

    def settle_deferred(self) -> None:
        """Add every round's deferred pushes now, giving their buffers back (rpc/receive.py)."""
        with self._cond:
            for fragment in self._params.fragments:
                fragment.round.settle()

    def session_learner(self, session_id: str) -> str:
        """The learner id that opened the session, its lease renewed; NotFound when none."""
        return self._learners.renew(session_id).learner_id  # learners.py's lock

    def pull(
        self, session_id: str, fragment_id: int, have_version: int, slice_of=(0, 1)
    ) -> PullResult:
        """What a learner at `have_version` needs: nothing, the update chain, or a snapshot
        (of slice_of = (index, count) only, count > 1: common/codec/slices.py)."""
        with self._cond:
            self._learners.renew(session_id)
            if (fragment := self._params.fragment(fragment_id)).params is None:
                raise FailedPrecondition(f"fragment {fragment_id} has no parameters yet")
            return fragment.pull(have_version, slice_of)

    # -- internals (call with the lock held) ---------------------------------------------

    def _checked(
        self, session_id: str, fragment_id: int, base_version: int, initial: bool
    ) -> tuple[Learner, FragmentState]:
        """The push's learner (its lease renewed) and fragment, once its header passed."""
        learner = self._learners.renew(session_id)
        fragment = self._params.fragment(fragment_id)
        self._store.check_writable()  # no new version once the state dir failed
        self._admission.check_header(learner, fragment, base_version, initial)
        return learner, fragment

    def _drop(self, learner: Learner, why: str, if_expired: bool = False) -> bool:
        # Its excuses go (a rejoin starts clean); its accepted pushes stay in their rounds.
        if not self._learners.close(learner, why, if_expired):
            return False  # a heartbeat renewed it meanwhile (heartbeats take no lock of ours)
        for fragment in self._params.fragments:
            fragment.round.forget(learner.learner_id)
            self._maybe_close(fragment)
        return True

    def _maybe_close(self, fragment: FragmentState) -> None:
        """Close the round if the mode's policy says so (rounds/policy.py)."""
        opened_at = fragment.round.opened_at
        record = functools.partial(self._store.record, fragment.fragment_id)  # the write-ahead
        summary = self._policy.close(fragment, self._learners.live(), record)
        if summary is None:
            return
        round_s = self._clock() - opened_at if opened_at is not None else 0.0
        self.events.round_closed(fragment.fragment_id, summary, round_s)
        if self._store.round_closed():  # written off the lock; a failure stops new versions
            self._store.start_snapshot(self._params)
        log.info(
            "fragment=%d version=%d contributors=%d tokens=%d outer_step_s=%.4f",
            fragment.fragment_id,
            summary.version,
            summary.contributors,
            summary.tokens,
            summary.outer_step_s,
        )
        self._cond.notify_all()
