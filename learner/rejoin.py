"""Joining again, one shard at a time, the shards that lost a learner's session; a plain
server is shard 0 of 1, so this is how every learner rejoins after a server restart.

    rejoins = ShardRejoins(session)
    ...after each inner step...
    changed = rejoins.try_rejoin()   # the lost shards that answer now; the rest later

A shard that restarted (from its state dir, every version it served included) or dropped
the learner's lease no longer knows its session: the client notes it lost where it reads
NOT_FOUND or a new epoch (ShardSessions, learner/shard_sessions.py; `lost_shards()`). The
learner then joins that shard alone again, while it trains on and syncs the other shards'
fragments, whatever their state: one that is down meanwhile holds up nothing but its own
fragments. The rejoined shard's fragments are loaded as at a join (learner/replicas.py): the
updates since the replica's version are pulled, and if the shard has not moved a fragment
since, the learner keeps its local parameters for it (its progress since the last merge);
otherwise they become the global ones, and a shard that lost versions (it is behind the
replica) gives its own state, in one log line per rejoin. A shard still away is tried again
with backoff, each try logged, the other lost ones meanwhile. A shard that did not answer
the learner's first join is lost the same way. While a shard is lost its fragments' pushes
are skipped (StreamingSync `away`), so that nothing, in sync mode too, waits for them.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import grpc

from common.retry import RetryGate, is_retryable
from learner.progress import SavedReplica
from learner.shard_sessions import SessionLost

if TYPE_CHECKING:
    from learner.session import SyncSession

log = logging.getLogger("diloco.learner")


class ShardRejoins:
    """Rejoins the session's lost shards; runs on the training thread, like every join."""

    def __init__(self, session: SyncSession) -> None:
        self.session = session
        self._gate = RetryGate()

    def try_rejoin(self, now: bool = False) -> bool:
        """Join each lost shard again; True if local parameters changed. A shard that cannot
        be reached (or lost the session again) is tried again after a backoff, the others
        meanwhile: one that is away holds up no other's rejoin. `now`: whatever the backoff
        (at the end of a run)."""
        lost = self.session.client.lost_shards()
        if not lost or (not now and not self._gate.due()):
            return False
        changed, failed = False, []
        for shard in sorted(lost):
            try:
                changed |= self._rejoin(shard)
            except grpc.RpcError as err:
                self.session.client.sessions.mark_lost(shard)  # in case it joined half way
                # Away, or already lost again (it restarted once more): another try later.
                if not (isinstance(err, SessionLost) or is_retryable(err)):
                    raise
                failed.append((shard, err))
        if not failed:
            self._gate.succeeded()
            return changed
        delay = self._gate.failed(failed[0][1])
        for shard, err in failed:
            log.warning(
                "learner=%s shard=%d unreachable (%s); training on without its fragments, "
                "next try in %.1f s",
                self.session.learner_id,
                shard,
                err.code().name,
                delay,
            )
        return changed

    def _rejoin(self, shard: int) -> bool:
        """Join the shard and reload its fragments; True if local parameters changed."""
        session, client = self.session, self.session.client
        sync = session.sync
        if sync is None:
            raise RuntimeError("a shard rejoin before the session joined")
        reply = client.join_shard(
            shard, session.learner_id, session.fingerprint, session.tokens_per_step
        )
        session.transport.abandon_in_flight(shard)  # they belong to the shard's old session
        owned = [f for f in reply.fragments if client.shard_of(f.fragment_id) == shard]
        held = [
            SavedReplica(r.fragment_id, list(r.indices), r.version, r.params)
            for r in sync.replicas
            if client.shard_of(r.fragment_id) == shard
        ]
        replicas, kept = session.replicas.load(client.membership().session_id, owned, held)
        for replica in replicas:
            sync.replace(replica, keep_local=replica.fragment_id in kept)
        session.progress.rejoins += 1
        log.info(
            "learner=%s joined shard %d again epoch=%d versions=%s kept_local=%s",
            session.learner_id,
            shard,
            reply.server_epoch,
            {r.fragment_id: r.version for r in replicas},
            sorted(kept),
        )
        return len(kept) < len(replicas)
