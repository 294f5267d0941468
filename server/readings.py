"""What callers may read of the aggregator's state (the status RPC, the status page, metrics,
tests), each read taken under the aggregator's lock, or under learners.py's own where it says so.

    rows = aggregator.learner_rows()      # one LearnerRow per learner with a session or a push
    _, owned = aggregator.owned(crc=True)  # (fragment, version, CRC) of each owned fragment

`Aggregator` (aggregator.py) inherits these reads; they change nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from server.learners import LearnerRow, Learners, learner_row
from server.rounds.policy import RoundPolicy, RoundState
from server.state.params import GlobalParams, ShardMap
from server.state.store import Persistence


@dataclass(frozen=True)
class FragmentRow:
    fragment_id: int
    version: int
    closed_s_ago: float | None  # None: no round closed since the server started
    round: RoundState


class Readings:
    """What callers may read of the aggregator's state, each read under its lock."""

    _cond: threading.Condition
    _clock: Callable[[], float]
    _learners: Learners
    _params: GlobalParams
    _store: Persistence
    _policy: RoundPolicy

    def median_step_time_s(self) -> float:
        """The live learners' median inner-step time (0: none; learners.py's lock, as below)."""
        return self._learners.median_step_time_s()

    def schedule_estimate(self) -> int:
        """Where the live learners' schedule is now (server/learners.py); 0: none reported."""
        return self._learners.schedule_estimate()

    def schedule_steps(self) -> dict[str, float]:
        """Each reporting learner's schedule step now (differences mod H: phase offsets)."""
        return self._learners.schedule_steps()

    def state_failure(self) -> str | None:
        """Why the state dir cannot be written, once it failed (no new versions since)."""
        with self._cond:
            return self._store.failure

    def learner_rows(self) -> list[LearnerRow]:
        """Each learner holding a session or with an accepted push, as the status shows it."""
        with self._cond:
            now, everyone = self._clock(), self._learners.everyone()
            weights = sum(x.last_weight or 0.0 for x in everyone if x.session_id)
            return [learner_row(x, now, weights) for x in everyone if x.session_id or x.last_push]

    def fragment_rows(self) -> list[FragmentRow]:
        """Each owned fragment's version, last close and open round (rounds/policy.py)."""
        with self._cond:
            now, live, rows = self._clock(), self._learners.live(), []
            for fragment in self._params.owned_fragments():
                closed = None if fragment.closed_at is None else now - fragment.closed_at
                state = self._policy.round_state(fragment.round, live)
                rows.append(FragmentRow(fragment.fragment_id, fragment.version, closed, state))
            return rows

    def layout(self) -> list[tuple[int, list[int], int]]:
        """(fragment_id, parameter indices, version) of every fragment."""
        with self._cond:
            return self._params.layout()

    def owned(self, crc: bool = False) -> tuple[ShardMap | None, list[tuple[int, int, int]]]:
        """The shard map (None before a fingerprint) and GlobalParams.owned(crc)."""
        with self._cond:
            return self._params.shard_map, self._params.owned(crc)

    def owned_shapes(self) -> list[list[tuple[int, ...]]]:
        with self._cond:
            return self._params.owned_shapes()

    def live_learners(self) -> list[str]:
        with self._cond:
            return sorted(learner.learner_id for learner in self._learners.live())

    def has_session(self, session_id: str) -> bool:  # learners.py's lock
        return self._learners.of_session(session_id) is not None

    def learner_of(self, session_id: str) -> str:  # learners.py's lock
        """The learner id that opened the session ("" when none), its lease left as it is."""
        learner = self._learners.of_session(session_id)
        return "" if learner is None else learner.learner_id

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

    def wait_for_snapshot(self, timeout_s: float) -> bool:
        """Block until no snapshot is being written (tests; shutdown waits by itself)."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._store.snapshot_running, timeout_s)

    def params(self, fragment_id: int) -> list[torch.Tensor]:
        """A copy of a fragment's global parameters (for tests and checkpoints)."""
        with self._cond:
            fragment = self._params.fragment(fragment_id)
            return [p.clone() for p in fragment.params or []]
