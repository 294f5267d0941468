"""The learner's session with an aggregator run as N shards: one session id and epoch per
shard, the Membership they make up, and the shards that no longer know theirs.

    sessions = ShardSessions()
    sessions.joined_all(replies)          # a join of the shards, in index order
    sessions.note_lost(shard, session)    # the shard answered NOT_FOUND, or restarted
    sessions.joined(shard, reply)         # that shard alone joined again
    sessions.membership()                 # what heartbeats, pushes and pulls go with

Thread-safe: heartbeats and syncs note losses on their own threads while the training
thread joins. The Membership is replaced whole at each join, so a reader sees one join's
values, never half of two.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Sequence

from common.generated.diloco.v1 import aggregator_pb2 as pb
from learner.heartbeat import Membership

log = logging.getLogger("diloco.learner")

SEP = ","  # between the shards' session ids (server session ids are hex)


class ShardSessions:
    """Each shard's session id and epoch at its last join, and the shards that lost theirs."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sessions: list[str] = []
        self._epochs: list[int] = []
        self._membership = Membership()
        self._lost: set[int] = set()

    def membership(self) -> Membership:
        """The session as joined: every shard's session id joined with SEP, one epoch for
        theirs (combined_epoch), the shortest lease."""
        return self._membership

    def epoch_of(self, shard: int) -> int:
        return self._epochs[shard]

    def lost(self) -> set[int]:
        """The shards that no longer know the current session."""
        with self._lock:
            return set(self._lost)

    def joined_all(self, replies: Sequence[pb.JoinResponse | None]) -> None:
        """A join of the shards (`replies` in index order, None for a shard that was away:
        lost until it is joined alone): a new session."""
        with self._lock:
            self._sessions = [r.session_id if r else "" for r in replies]
            self._epochs = [r.server_epoch if r else 0 for r in replies]
            self._lost = {shard for shard, r in enumerate(replies) if r is None}
            self._membership = self._made(min(r.lease_s for r in replies if r))

    def joined(self, shard: int, reply: pb.JoinResponse) -> None:
        """The shard alone joined again; the other shards' sessions stay."""
        with self._lock:
            self._sessions[shard], self._epochs[shard] = reply.session_id, reply.server_epoch
            self._lost.discard(shard)
            self._membership = self._made(min(self._membership.lease_s, reply.lease_s))

    def mark_lost(self, shard: int) -> None:
        """The shard must be joined again (a rejoin of it that failed half way)."""
        with self._lock:
            self._lost.add(shard)

    def note_lost(self, shard: int, session: str) -> None:
        """The shard no longer knows `session`: lost if that is its current one (with more
        than one shard); an answer about a session it has since joined again is old news."""
        with self._lock:
            current = len(self._sessions) > 1 and self._sessions[shard] == session
            if current and shard not in self._lost:
                log.warning("shard=%d lost the learner's session; joining it again", shard)
                self._lost.add(shard)

    def _made(self, lease_s: float) -> Membership:
        return Membership(SEP.join(self._sessions), combined_epoch(self._epochs), lease_s)


def combined_epoch(epochs: Sequence[int]) -> int:
    """One 63-bit epoch for the shards' epochs: it changes when any shard restarts."""
    if len(epochs) == 1:
        return epochs[0]
    digest = hashlib.sha256(",".join(str(e) for e in epochs).encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def session_of(session_id: str, shard: int, shard_count: int) -> str:
    """The shard's own session id within the learner's (an unknown one passes unchanged:
    the shard answers NOT_FOUND, and the learner joins again)."""
    if shard_count == 1:
        return session_id
    parts = session_id.split(SEP)
    return parts[shard] if len(parts) == shard_count else session_id
