"""The learner's session with an aggregator run as N shards (a plain server is shard 0 of 1):
one session id and epoch per shard, the Membership they make up, and the shards that no
longer know theirs.

    sessions = ShardSessions()
    sessions.joined_all(replies, learner_id)             # a join of the shards, in index order
    with sessions.noting_lost(shard, session, "push"):   # NOT_FOUND: lost, raised as SessionLost
        ...the shard's call...
    sessions.note_epoch(shard, session, reply.server_epoch)  # a heartbeat's answer
    sessions.joined(shard, reply)                        # that shard alone joined again
    sessions.membership()                                # what heartbeats, pushes and pulls go with

This is the one place that reads a shard's answer as "the shard lost this learner's session"
(it restarted, or the lease ran out there): NOT_FOUND to a push, pull or heartbeat, or a
heartbeat that reports another epoch than the shard's join did. The shard is then in `lost()`
and the call raises SessionLost, which the rest of the learner takes as that and nothing
else: the shard's fragments are away (their pushes skipped), its syncs end with nothing to
merge (learner/transport.py), and the shard is joined again alone (learner/rejoin.py).

Thread-safe: heartbeats and syncs note losses on their own threads while the training
thread joins. The Membership is replaced whole at each join, so a reader sees one join's
values, never half of two.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import grpc

from common.generated.diloco.v1 import aggregator_pb2 as pb
from learner.heartbeat import Membership

log = logging.getLogger("diloco.learner")

SEP = ","  # between the shards' session ids (server session ids are hex)


class SessionLost(grpc.RpcError):
    """A shard answered NOT_FOUND: it no longer knows the session the call went with, and
    ShardSessions has noted it lost. Code, details and metadata are the shard's answer."""

    def __init__(self, shard: int, answer: grpc.RpcError) -> None:
        super().__init__()
        self.shard, self.answer = shard, answer

    def code(self) -> grpc.StatusCode:
        return self.answer.code()

    def details(self) -> str:
        return self.answer.details()

    def trailing_metadata(self):
        return getattr(self.answer, "trailing_metadata", lambda: None)()


class ShardSessions:
    """Each shard's session id and epoch at its last join, and the shards that lost theirs."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._learner_id = ""
        self._sessions: list[str] = []
        self._epochs: list[int] = []
        self._membership = Membership()
        self._lost: set[int] = set()

    def membership(self) -> Membership:
        """The session as joined: every shard's session id joined with SEP, one epoch for
        theirs (combined_epoch), the shortest lease."""
        return self._membership

    def lost(self) -> set[int]:
        """The shards that no longer know the current session."""
        with self._lock:
            return set(self._lost)

    def joined_all(self, replies: Sequence[pb.JoinResponse | None], learner_id: str) -> None:
        """A join of the shards (`replies` in index order, None for a shard that was away:
        lost until it is joined alone): a new session."""
        with self._lock:
            self._learner_id = learner_id
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

    @contextmanager
    def noting_lost(self, shard: int, session: str, call: str) -> Iterator[None]:
        """Run a call of `shard` made in `session` (the shard's own id); a NOT_FOUND answer
        notes the shard lost and is raised as SessionLost. `call` names it in the log."""
        try:
            yield
        except SessionLost:
            raise
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.NOT_FOUND:
                raise
            self._note_lost(shard, session, f"NOT_FOUND to a {call}")
            raise SessionLost(shard, err) from err

    def note_epoch(self, shard: int, session: str, epoch: int) -> None:
        """A heartbeat made in `session` was answered with `epoch`: another one than the
        shard's join gave means it restarted, and no longer knows the session."""
        with self._lock:
            joined_epoch = self._epochs[shard]
        if epoch != joined_epoch:
            self._note_lost(shard, session, f"new epoch {epoch}")

    def _note_lost(self, shard: int, session: str, why: str) -> None:
        """The shard no longer knows `session`: lost if that is its current one; an answer
        about a session it has since joined again is old news."""
        with self._lock:
            if self._sessions[shard] != session or shard in self._lost:
                return
            self._lost.add(shard)
        log.warning(
            "learner=%s shard=%d lost the learner's session (%s); joining it again",
            self._learner_id,
            shard,
            why,
        )

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
    the shard answers NOT_FOUND, and the learner joins it again)."""
    parts = session_id.split(SEP)
    return parts[shard] if len(parts) == shard_count else session_id
