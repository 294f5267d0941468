"""The aggregator's state and rules, free of gRPC so that every rule is unit-testable.

One `Aggregator` owns: the learners' sessions and leases, the parameter fingerprint fixed by the
first learner, and per fragment the global parameters, their version, the outer optimizer
state and the open round. In `sync` mode (DiLoCo) a round closes when every live learner has
pushed for it; a learner whose lease expires or who leaves stops counting, so a dead learner
never stalls the others. All methods are thread-safe; `wait_for_version` lets callers (the
PullParams long-poll, tests) block on progress without sleeping.
"""

from __future__ import annotations

import logging
import math
import secrets
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from common.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from common.fragments import layout_fragments
from server.config import AggregatorConfig
from server.durable import LogRecord, StateStore
from server.events import AggregatorEvents
from server.fragment import FragmentState, PullResult, Round
from server.ingest import DenseBody, PushBody
from server.outer import DelayedNesterov, NesterovOuter
from server.policy import (
    NormGuard,
    contribution_weight,
    estimated_schedule_step,
    grace_window_s,
    median_step_time_s,
    moved_on,
    staleness_discount,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ParamSpec:
    """Name, shape and dtype of one model parameter, as the learner reports it at Join."""

    name: str
    shape: tuple[int, ...]
    dtype: str


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


@dataclass(frozen=True)
class JoinResult:
    session_id: str
    server_epoch: int
    fragments: list[tuple[int, list[int], int]]  # (fragment_id, param_indices, version)
    lease_s: float
    mode: str
    layout: str
    schedule_step: int = 0  # policy.estimated_schedule_step of the other live learners


class Aggregator:
    """Sessions, leases, fragments and rounds; see the module docstring."""

    def __init__(
        self,
        config: AggregatorConfig,
        clock: Callable[[], float] = time.monotonic,
        events: AggregatorEvents | None = None,
    ) -> None:
        self.config = config
        self.events = events or AggregatorEvents()
        self.server_epoch = secrets.randbits(63)
        self._clock = clock
        self._cond = threading.Condition()
        self._sessions: dict[str, Session] = {}
        self._fingerprint: list[ParamSpec] | None = None
        self._fragments: list[FragmentState] = []
        self._store = StateStore(config.state_dir) if config.state_dir else None
        self._rounds_since_snapshot = 0
        self._last_weight: dict[str, float] = {}  # learner -> weight of its last push
        self._norm_guards: defaultdict[int, NormGuard] = defaultdict(
            lambda: NormGuard(config.max_norm_ratio)
        )  # per fragment
        if self._store is not None:
            self._restore(self._store)

    def checkpoint(self) -> None:
        """Write a snapshot now (at shutdown, so a restart replays nothing)."""
        with self._cond:
            if self._store is not None and self._fingerprint is not None:
                self._write_snapshot(self._store)
                self._store.close()

    # -- membership ---------------------------------------------------------------------

    def join(self, learner_id: str, fingerprint: Sequence[ParamSpec]) -> JoinResult:
        """Open a session; the first learner's fingerprint fixes the model for the run."""
        if not learner_id:
            raise InvalidArgument("learner_id must not be empty")
        if not fingerprint:
            raise InvalidArgument("fingerprint must list the model's parameters")
        fingerprint = list(fingerprint)
        _check_fingerprint(fingerprint)
        with self._cond:
            if self._fingerprint is None:
                self._fragments = self._new_fragments(fingerprint)
                self._fingerprint = fingerprint
            elif fingerprint != self._fingerprint:
                raise FailedPrecondition(_fingerprint_mismatch(self._fingerprint, fingerprint))
            for old in [s for s in self._sessions.values() if s.learner_id == learner_id]:
                self._drop(old, "rejoined")
            schedule_step = self._schedule_estimate()
            session = Session(
                secrets.token_hex(16), learner_id, self._clock() + self.config.lease_s
            )
            self._sessions[session.session_id] = session
            log.info(
                "learner=%s joined session=%s live=%d",
                learner_id,
                session.session_id[:8],
                len(self._sessions),
            )
            return JoinResult(
                session_id=session.session_id,
                server_epoch=self.server_epoch,
                fragments=self._layout(),
                lease_s=self.config.lease_s,
                mode=self.config.mode,
                layout=self.config.layout,
                schedule_step=schedule_step,
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
        """Renew a lease and record progress; returns (fragment versions, live learners)."""
        with self._cond:
            session = self._session(session_id)
            session.step, session.tokens, session.loss = step, tokens, loss
            if step_time_s > 0:
                session.step_time_s = step_time_s
            if schedule_step > 0:
                session.schedule_step, session.schedule_at = schedule_step, self._clock()
            return [f.version for f in self._fragments], len(self._sessions)

    def median_step_time_s(self) -> float:
        """The live learners' median reported inner-step time (0: none reported)."""
        with self._cond:
            return median_step_time_s(s.step_time_s for s in self._sessions.values())

    def schedule_estimate(self) -> int:
        """Where the live learners' schedule is now (server/policy.py); 0: none reported."""
        with self._cond:
            return self._schedule_estimate()

    def schedule_steps(self) -> dict[str, float]:
        """Each live learner's schedule step now, estimated as schedule_estimate does (its
        last report moved on at the median step time), for those that have reported one.
        Their differences modulo H are the learners' phase offsets."""
        with self._cond:
            now, step_time_s = self._clock(), self.median_step_time_s()  # the lock is an RLock
            return {
                s.learner_id: moved_on(s.schedule_step, s.schedule_at, now, step_time_s)
                for s in self._sessions.values()
                if s.schedule_step > 0
            }

    def _schedule_estimate(self) -> int:
        sessions = self._sessions.values()
        return estimated_schedule_step(
            ((s.schedule_step, s.schedule_at) for s in sessions),
            self._clock(),
            self.median_step_time_s(),
        )

    def tick(self) -> None:
        """Expire leases and close rounds whose grace window has passed (call it often)."""
        self.expire_leases()
        with self._cond:
            for fragment in self._fragments:
                self._maybe_close(fragment)

    def leave(self, session_id: str) -> None:
        """End a session; open rounds no longer wait for it."""
        with self._cond:
            session = self._sessions.get(session_id)
            if session is not None:
                self._drop(session, "left")

    def expire_leases(self) -> list[str]:
        """Drop every session whose lease has run out; returns their learner ids."""
        with self._cond:
            now = self._clock()
            expired = [s for s in self._sessions.values() if s.lease_deadline < now]
            for session in expired:
                self._drop(session, "lease expired")
            return [s.learner_id for s in expired]

    def layout(self) -> list[tuple[int, list[int], int]]:
        """(fragment_id, parameter indices, version) of every fragment."""
        with self._cond:
            return self._layout()

    def live_learners(self) -> list[str]:
        with self._cond:
            return sorted(s.learner_id for s in self._sessions.values())

    # -- parameters ---------------------------------------------------------------------

    def check_push(
        self, session_id: str, fragment_id: int, base_version: int, initial: bool = False
    ) -> list[tuple[int, ...]]:
        """Validate a push header before its payload is read; returns the expected shapes.

        Lets the servicer refuse a stale or duplicate push without receiving megabytes first.
        """
        with self._cond:
            fragment = self._check_header(session_id, fragment_id, base_version, initial)
            return list(fragment.shapes)

    def initialize(self, session_id: str, fragment_id: int, tensors: list[torch.Tensor]) -> int:
        """Adopt a learner's initial parameters as version 0 of a fragment that has none."""
        with self._cond:
            fragment = self._check_header(session_id, fragment_id, -1, initial=True)
            _check_shapes(fragment, [tuple(t.shape) for t in tensors])
            fragment.initialize(tensors)
            if self._store is not None:
                self._write_snapshot(self._store)  # durable before anyone can pull it
            self._cond.notify_all()
            return 0

    def push(
        self,
        session_id: str,
        fragment_id: int,
        base_version: int,
        tensors: Sequence[torch.Tensor] | PushBody,
        tokens: int = 0,
        inner_steps: int = 0,
    ) -> int:
        """Add a pseudo-gradient to the fragment's open round; returns the version it helps
        produce (the learner waits for that one).

        `tensors` is the decoded pseudo-gradient or a PushBody that the servicer checked in
        its wire encoding (server/ingest.py); a PushBody's norm and magnitude were computed
        outside the lock, and it is decoded straight into the round's sum."""
        body = tensors if isinstance(tensors, PushBody) else DenseBody(tensors)
        with self._cond:
            fragment = self._check_header(session_id, fragment_id, base_version, initial=False)
            session = self._sessions[session_id]
            _check_shapes(fragment, body.shapes)
            if body.max_abs > MAX_DELTA_ABS:
                raise InvalidArgument(
                    f"pseudo-gradient values exceed {MAX_DELTA_ABS:g} in magnitude"
                )
            if tokens < 0 or inner_steps < 0:
                raise InvalidArgument("tokens and inner_steps must be >= 0")
            try:
                weight = contribution_weight(self.config.weighting, tokens, inner_steps)
            except ValueError as err:
                raise InvalidArgument(str(err)) from err
            discount = staleness_discount(fragment.version - base_version)
            _check_round_sum_fits(fragment.round, weight * discount, body.max_abs)
            norm = body.norm
            guard = self._norm_guards[fragment_id]
            try:
                guard.check(norm)
            except ValueError as err:
                # The learner counts as having taken part with nothing, so a sync round does
                # not wait for it forever; the global parameters are untouched.
                fragment.round.contributors.add(session.learner_id)
                fragment.last_push_base[session.learner_id] = base_version
                self._maybe_close(fragment)
                raise FailedPrecondition(f"push refused: {err}") from err
            fragment.add(session.learner_id, body, tokens, weight, discount)
            fragment.last_push_base[session.learner_id] = base_version
            self._last_weight[session.learner_id] = weight
            guard.record(norm)
            self.events.contribution(fragment.version - base_version)
            rnd = fragment.round
            if rnd.opened_at is None:
                rnd.opened_at = self._clock()
            if rnd.quorum_since is None and len(rnd.contributors) >= self.config.min_contributors:
                rnd.quorum_since = self._clock()
            round_version = fragment.version + 1
            log.info(
                "learner=%s pushed fragment=%d base=%d contributors=%d/%d",
                session.learner_id,
                fragment_id,
                base_version,
                len(rnd.contributors),
                len(self._sessions),
            )
            self._maybe_close(fragment)
            return round_version

    def session_learner(self, session_id: str) -> str:
        """The learner id that opened the session; NotFound when there is none."""
        with self._cond:
            return self._session(session_id).learner_id

    def has_fragment(self, fragment_id: int) -> bool:
        with self._cond:
            return 0 <= fragment_id < len(self._fragments)

    def version(self, fragment_id: int) -> int:
        with self._cond:
            return self._fragment(fragment_id).version

    def wait_for_version(self, fragment_id: int, version: int, timeout_s: float) -> int:
        """Block until the fragment reaches `version` or `timeout_s` passes; returns its version."""
        with self._cond:
            # The fragment may not exist yet (before the first Join); wait for that too.
            self._cond.wait_for(lambda: self._version_of(fragment_id) >= version, timeout=timeout_s)
            return self._version_of(fragment_id)

    def pull(self, session_id: str, fragment_id: int, have_version: int) -> PullResult:
        """What a learner at `have_version` needs: nothing, the update chain, or a snapshot."""
        with self._cond:
            self._session(session_id)
            fragment = self._fragment(fragment_id)
            if fragment.params is None:
                raise FailedPrecondition(f"fragment {fragment_id} has no parameters yet")
            return fragment.pull(have_version)

    def params(self, fragment_id: int) -> list[torch.Tensor]:
        """A copy of a fragment's global parameters (for tests and checkpoints)."""
        with self._cond:
            fragment = self._fragment(fragment_id)
            return [p.clone() for p in fragment.params or []]

    # -- internals (call with the lock held) ---------------------------------------------

    def _new_fragments(self, specs: list[ParamSpec]) -> list[FragmentState]:
        cfg = self.config
        numels = [math.prod(spec.shape) for spec in specs]
        try:
            groups = layout_fragments([s.name for s in specs], numels, cfg.fragments, cfg.layout)
        except ValueError as err:  # the model does not fit the server's layout
            raise FailedPrecondition(str(err)) from err
        return [
            FragmentState(
                fragment_id=fid,
                param_indices=indices,
                shapes=[specs[i].shape for i in indices],
                outer=self._new_outer(),
                pull_codec=cfg.pull_codec,
                update_log_versions=cfg.update_log_versions,
            )
            for fid, indices in enumerate(groups)
        ]

    def _new_outer(self) -> NesterovOuter | DelayedNesterov:
        cfg = self.config
        if cfg.mode == "async":
            return DelayedNesterov(cfg.outer_lr, cfg.outer_momentum, cfg.async_momentum_every or 1)
        return NesterovOuter(
            cfg.outer_lr,
            cfg.outer_momentum,
            warmup_rounds=cfg.outer_momentum_warmup_rounds,
            warmup_start=cfg.outer_momentum_warmup_start,
        )

    def _check_header(
        self, session_id: str, fragment_id: int, base_version: int, initial: bool
    ) -> FragmentState:
        session = self._session(session_id)
        fragment = self._fragment(fragment_id)
        if initial:
            if fragment.params is not None:
                raise AlreadyExists(
                    f"fragment {fragment_id} is already initialized at version "
                    f"{fragment.version}; pull it instead"
                )
            return fragment
        if fragment.params is None:
            raise FailedPrecondition(f"fragment {fragment_id} has no parameters yet")
        if base_version > fragment.version:
            raise InvalidArgument(
                f"base_version {base_version} is from the future: fragment {fragment_id} "
                f"is at version {fragment.version}"
            )
        staleness = fragment.version - base_version
        if self.config.mode == "sync" and staleness > 0:
            raise FailedPrecondition(
                f"stale push: base_version {base_version} but fragment {fragment_id} is at "
                f"version {fragment.version}; pull the new version and push again"
            )
        if staleness > self.config.max_staleness:
            raise FailedPrecondition(
                f"push too stale: base_version {base_version} is {staleness} versions behind "
                f"fragment {fragment_id} (max_staleness {self.config.max_staleness}); pull and "
                f"push again"
            )
        if fragment.last_push_base.get(session.learner_id) == base_version:
            raise AlreadyExists(
                f"learner {session.learner_id} already pushed fragment {fragment_id} against "
                f"version {base_version} (a retried push counts once)"
            )
        if self.config.mode == "sync" and session.learner_id in fragment.round.contributors:
            raise AlreadyExists(
                f"learner {session.learner_id} already pushed for version "
                f"{fragment.version + 1} of fragment {fragment_id}"
            )
        return fragment

    def _layout(self) -> list[tuple[int, list[int], int]]:
        return [(f.fragment_id, f.param_indices, f.version) for f in self._fragments]

    def _version_of(self, fragment_id: int) -> int:
        """The fragment's version, or -2 (below any version) while it does not exist."""
        if 0 <= fragment_id < len(self._fragments):
            return self._fragments[fragment_id].version
        return -2

    def _session(self, session_id: str) -> Session:
        session = self._sessions.get(session_id)
        if session is None:
            raise NotFound("unknown session (it expired or the server restarted); join again")
        session.lease_deadline = self._clock() + self.config.lease_s
        return session

    def _fragment(self, fragment_id: int) -> FragmentState:
        if not 0 <= fragment_id < len(self._fragments):
            raise NotFound(f"fragment {fragment_id} does not exist")
        return self._fragments[fragment_id]

    def _drop(self, session: Session, why: str) -> None:
        del self._sessions[session.session_id]
        log.info("learner=%s dropped (%s) live=%d", session.learner_id, why, len(self._sessions))
        for fragment in self._fragments:
            self._maybe_close(fragment)

    def _maybe_close(self, fragment: FragmentState) -> None:
        """Close the round if the mode's rule says so (server/policy.py)."""
        if not self._round_ready(fragment.round):
            return
        if isinstance(fragment.outer, DelayedNesterov) and not self.config.async_momentum_every:
            fragment.outer.every = max(1, len(self._sessions))
        opened_at = fragment.round.opened_at
        store = self._store
        every = fragment.outer.every if isinstance(fragment.outer, DelayedNesterov) else 0

        def record(mean: list[torch.Tensor]) -> None:
            # Durable before the lock is released and the version served.
            assert store is not None
            store.append(LogRecord(fragment.fragment_id, fragment.version, mean, every))

        summary = fragment.close_round(
            self._expected_weight(fragment.round), record if store is not None else None
        )
        round_s = self._clock() - opened_at if opened_at is not None else 0.0
        self.events.round_closed(summary.contributors, round_s, summary.outer_step_s)
        if store is not None:
            self._rounds_since_snapshot += 1
            if self._rounds_since_snapshot >= self.config.snapshot_every_versions:
                self._write_snapshot(store)
        log.info(
            "fragment=%d version=%d contributors=%d tokens=%d outer_step_s=%.4f",
            fragment.fragment_id,
            summary.version,
            summary.contributors,
            summary.tokens,
            summary.outer_step_s,
        )
        self._cond.notify_all()

    def _write_snapshot(self, store: StateStore) -> None:
        cfg, started = self.config, time.perf_counter()
        store.write_snapshot(
            {
                "fingerprint": [(p.name, p.shape, p.dtype) for p in self._fingerprint or []],
                "layout": {
                    "fragments": cfg.fragments,
                    "layout": cfg.layout,
                    "mode": cfg.mode,
                    "pull_codec": cfg.pull_codec,
                },
                "fragments": [f.state_dict() for f in self._fragments],
            }
        )
        self._rounds_since_snapshot = 0
        self.events.snapshot_written(time.perf_counter() - started)

    def _restore(self, store: StateStore) -> None:
        """Load the snapshot and replay the log (see server/durable.py)."""
        snapshot = store.load_snapshot()
        if snapshot is None:
            if next(store.replay(), None) is not None:
                raise RuntimeError(f"{store.log_path} has records but there is no snapshot")
            return
        cfg = self.config
        written = snapshot["layout"]
        ours = {
            "fragments": cfg.fragments,
            "layout": cfg.layout,
            "mode": cfg.mode,
            "pull_codec": cfg.pull_codec,
        }
        if written != ours:
            raise ValueError(
                f"state dir {cfg.state_dir} was written with {written}; "
                f"start the server with the same settings or a new state dir"
            )
        self._fingerprint = [
            ParamSpec(n, tuple(shape), d) for n, shape, d in snapshot["fingerprint"]
        ]
        self._fragments = self._new_fragments(self._fingerprint)
        for fragment, state in zip(self._fragments, snapshot["fragments"], strict=True):
            fragment.load_state_dict(state)
        replayed = 0
        for record in store.replay():  # one record in memory at a time
            replayed += 1
            fragment = self._fragment(record.fragment_id)
            if record.version <= fragment.version:
                continue  # a crash between snapshot and log reset: already in the snapshot
            if record.version != fragment.version + 1:
                raise RuntimeError(
                    f"{store.log_path}: record for fragment {record.fragment_id} version "
                    f"{record.version} does not follow version {fragment.version}"
                )
            if isinstance(fragment.outer, DelayedNesterov) and record.outer_every:
                fragment.outer.every = record.outer_every
            fragment.apply_mean(record.mean)
        log.info(
            "restored from %s: versions %s (replayed %d records)",
            cfg.state_dir,
            [f.version for f in self._fragments],
            replayed,
        )

    def _expected_weight(self, rnd: Round) -> float:
        """quorum: the weight a round would carry with every live learner in it (each at the
        weight of its last push; one never seen counts as this round's average)."""
        if self.config.mode != "quorum" or not self.config.scale_partial_rounds:
            return 0.0
        average = rnd.weight_sum / max(1, rnd.pushes)
        return sum(self._last_weight.get(s.learner_id, average) for s in self._sessions.values())

    def _round_ready(self, rnd: Round) -> bool:
        cfg = self.config
        if rnd.delta_sum is None:
            return False
        if cfg.mode == "async":
            return True
        everyone = {s.learner_id for s in self._sessions.values()} <= rnd.contributors
        if cfg.mode == "sync":
            return everyone and len(rnd.contributors) >= cfg.min_contributors
        if everyone:
            return True
        if rnd.quorum_since is None:
            return False
        step_times = (s.step_time_s for s in self._sessions.values())
        grace = grace_window_s(step_times, cfg.grace_steps, cfg.grace_min_s, cfg.grace_max_s)
        return self._clock() >= rnd.quorum_since + grace


# No real pseudo-gradient comes near this; it keeps sums, momentum and the 4-bit encoding of
# the outer update finite whatever a learner sends.
MAX_DELTA_ABS = 1e12


# The round's float32 sum stays below this (float32 tops out at 3.4e38). A learner's claimed
# tokens and inner steps set its weight, and tokens²/steps reaches 8.5e37: weight times values
# could otherwise overflow to infinity, which the outer step cannot encode, and every later
# round of the fragment would fail with it.
MAX_ROUND_SUM_ABS = 1e37


def _check_round_sum_fits(rnd: Round, scale: float, max_abs: float) -> None:
    if not rnd.abs_bound + scale * max_abs <= MAX_ROUND_SUM_ABS:
        raise InvalidArgument(
            f"contribution weight {scale:.3g} (from tokens and inner_steps) times values up to "
            f"{max_abs:.3g} would overflow the round's sum; send the real tokens and inner_steps"
        )


def _check_shapes(fragment: FragmentState, shapes: Sequence[tuple[int, ...]]) -> None:
    shapes = [tuple(s) for s in shapes]
    if shapes != fragment.shapes:
        raise InvalidArgument(
            f"fragment {fragment.fragment_id} expects {len(fragment.shapes)} tensors with "
            f"shapes {fragment.shapes}, got {shapes}"
        )


MAX_MODEL_VALUES = 1 << 40


def _check_fingerprint(specs: Sequence[ParamSpec]) -> None:
    names = [s.name for s in specs]
    if len(set(names)) != len(names) or not all(names):
        raise InvalidArgument("fingerprint parameter names must be unique and non-empty")
    total = 0
    for spec in specs:
        if any(d < 0 for d in spec.shape):
            raise InvalidArgument(f"parameter {spec.name} has a negative dimension {spec.shape}")
        total += math.prod(spec.shape)
    if total > MAX_MODEL_VALUES:
        raise InvalidArgument(f"fingerprint declares {total} values, more than {MAX_MODEL_VALUES}")


def _fingerprint_mismatch(expected: list[ParamSpec], got: list[ParamSpec]) -> str:
    if len(expected) != len(got):
        return f"model fingerprint has {len(got)} parameters, the run has {len(expected)}"
    for want, have in zip(expected, got, strict=True):
        if want != have:
            return f"model fingerprint differs at parameter {want.name}: run has {want}, got {have}"
    return "model fingerprint differs"
