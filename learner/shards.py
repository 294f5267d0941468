"""The learner's client for an aggregator run as N shards (docs/architecture.md, Sharding);
a plain server is shard 0 of 1, and goes through the same code.

    client = ShardedClient(["a:50051", "b:50051"], credentials, metadata)
    reply = client.join(learner_id, fingerprint)   # joins every shard, checks they agree
    client.push(header, payload)                   # to the fragment's owner only

It offers AggregatorClient's calls, so the session, transport and heartbeat work unchanged
over any N, and routes each to the shard it concerns. Finding the shards and agreeing on
their map is ShardMap's (learner/shard_map.py): a join goes to every shard that answers,
and a shard that did not is lost (its fragments are `away()`) until `join_shard` joins it.
The learner's session is one id per shard, joined with SEP, and the server epoch one hash
of the shards' epochs (`membership()`, learner/shard_sessions.py).

Heartbeats go to every shard at once, each bounded by a third of the lease; a shard that
cannot be reached is skipped (its fragments keep their last known versions) while the live
ones renew the lease. Every call made in a session goes through ShardSessions.noting_lost,
and every heartbeat's epoch through ShardSessions.note_epoch (learner/shard_sessions.py, the
one place that reads NOT_FOUND or a new epoch as a lost session): a shard that lost the
session is in `lost_shards()`, and `join_shard` joins it alone again (learner/rejoin.py),
whatever the other shards' state: one that is down meanwhile does not hold it up.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import grpc

from common.generated.diloco.v1 import aggregator_pb2 as pb
from common.retry import is_retryable
from common.traffic import Traffic
from learner.client import AggregatorClient
from learner.heartbeat import Membership
from learner.shard_map import NotConnected, ShardMap, ShardMapError, version_in
from learner.shard_sessions import SEP, SessionLost, ShardSessions, session_of

__all__ = ["SEP", "NotConnected", "SessionLost", "ShardMapError", "ShardedClient"]

log = logging.getLogger("diloco.learner")


class ShardedClient:
    """One AggregatorClient per shard behind AggregatorClient's interface; thread-safe for
    the same calls (join, which replaces the map, runs on the training thread only)."""

    def __init__(
        self,
        addresses: Sequence[str],
        credentials: grpc.ChannelCredentials | None = None,
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> None:
        """`addresses`: every shard's, in index order, or one (then the others are found
        with DescribeShards)."""
        self.traffic = Traffic()
        self.map = ShardMap(addresses, credentials, metadata, self.traffic)
        self.sessions = ShardSessions()
        self._versions: list[int] = []  # last known version of each fragment
        self.last_join: list[pb.JoinResponse | None] = []  # each shard's reply, in order

    @property
    def addresses(self) -> list[str]:
        return self.map.addresses

    @property
    def target(self) -> str:
        return SEP.join(self.addresses)

    @property
    def shard_count(self) -> int:
        return self.map.count

    def membership(self) -> Membership:
        """The session as joined, what every call goes with (ShardSessions.membership)."""
        return self.sessions.membership()

    def lost_shards(self) -> set[int]:
        """The shards that no longer know the current session: join_shard them."""
        return self.sessions.lost()

    def away(self) -> set[int]:
        """The fragments whose owner no longer knows the session (or never answered a join)."""
        lost = self.lost_shards()
        return {fid for fid, owner in enumerate(self.map.owners) if owner in lost}

    def shard_of(self, fragment_id: int) -> int:
        """The shard that owns the fragment (0 before the first join)."""
        return self.map.owner(fragment_id)

    def close(self) -> None:
        self.map.close()

    def wait_ready(self, timeout_s: float) -> None:
        """ShardMap.wait_ready: every shard's channel, or the first and a grace."""
        self.map.wait_ready(timeout_s)

    def discover(self) -> None:
        """Given one address: take the run's shard addresses from it, once (join does)."""
        self.map.discover()

    def shards(self) -> list[AggregatorClient]:
        """One client per shard, in index order (after discover(), every shard's)."""
        return list(self.map.clients)

    def join(
        self, learner_id: str, fingerprint: Sequence[pb.ParamSpec], tokens_per_step: int = 0
    ) -> pb.JoinResponse:
        """Join every shard (AggregatorClient.join's arguments); one reply whose session and
        epoch stand for all of them."""
        self.last_join = self.map.join_all(learner_id, fingerprint, tokens_per_step)
        return self.adopt(self.last_join, learner_id)

    def adopt(self, replies: Sequence[pb.JoinResponse | None], learner_id: str) -> pb.JoinResponse:
        """Take the session of a join's replies (join's own, or those the leader of an
        island got: its ranks share one session, learner/sliced.py) without a call."""
        self.map.discover()
        self.map.agree(replies)
        reply = pb.JoinResponse()
        reply.CopyFrom(self.map.agreed)
        reply.schedule_step = max(r.schedule_step for r in replies if r is not None)
        for fragment in reply.fragments:
            owner = replies[self.map.owner(fragment.fragment_id)]
            # A fragment whose owner is away stays at -1 until that shard is joined.
            fragment.version = (
                -1 if owner is None else version_in(owner.fragments, fragment.fragment_id)
            )
        self._versions = [f.version for f in sorted(reply.fragments, key=lambda f: f.fragment_id)]
        self.sessions.joined_all(replies, learner_id)
        joined = self.sessions.membership()
        reply.session_id, reply.server_epoch = joined.session_id, joined.server_epoch
        reply.lease_s = joined.lease_s
        return reply

    def join_shard(
        self, shard: int, learner_id: str, fingerprint: Sequence[pb.ParamSpec], tokens: int = 0
    ) -> pb.JoinResponse:
        """Join one shard again (join's arguments), the others' sessions untouched.
        ShardMapError, naming the shard, unless it agrees with the map of the last join."""
        reply = self.map.join_one(shard, learner_id, fingerprint, tokens)
        for fid, owner in enumerate(self.map.owners):
            if owner == shard:
                self._versions[fid] = version_in(reply.fragments, fid)
        self.sessions.joined(shard, reply)
        return reply

    def push(self, header: pb.PushHeader, payload: bytes) -> pb.PushFragmentResponse:
        shard = self.shard_of(header.fragment_id)
        mine = pb.PushHeader()
        mine.CopyFrom(header)
        mine.session_id = session_of(header.session_id, shard, self.shard_count)
        with self.sessions.noting_lost(shard, mine.session_id, "push"):
            return self.map.clients[shard].push(mine, payload)

    def pull(
        self,
        session_id: str,
        fragment_id: int,
        have_version: int,
        wait_for_version: int = 0,
        wait_timeout_s: float = 0.0,
        slice_of: tuple[int, int] = (0, 0),
    ) -> tuple[pb.PullHeader, bytes]:
        shard = self.shard_of(fragment_id)
        session = session_of(session_id, shard, self.shard_count)
        with self.sessions.noting_lost(shard, session, "pull"):
            return self.map.clients[shard].pull(
                session, fragment_id, have_version, wait_for_version, wait_timeout_s, slice_of
            )

    def heartbeat(self, request: pb.HeartbeatRequest) -> pb.HeartbeatResponse:
        """Every shard's heartbeat in one answer, whose epoch is the session's as joined. A
        shard that lost the session (NOT_FOUND, or a new epoch) is noted in lost_shards();
        an error is raised only if no shard answered (an unreachable one first)."""
        # Sent at once, each bounded by a third of the lease: a shard that does not answer
        # (down, or its address black-holed) must not hold back the others' renewals.
        timeout_s = max(1.0, self.membership().lease_s / 3)
        with ThreadPoolExecutor(self.shard_count, thread_name_prefix="heartbeat") as pool:
            futures = {
                shard: pool.submit(self._beat, shard, request, timeout_s)
                for shard in range(self.shard_count)
            }
        replies: dict[int, pb.HeartbeatResponse] = {}
        lost: SessionLost | None = None
        unreachable: dict[int, grpc.RpcError] = {}
        for shard, future in futures.items():
            try:
                replies[shard] = future.result()
            except SessionLost as err:  # noted where it is read (ShardSessions)
                lost = err
            except grpc.RpcError as err:
                if not is_retryable(err):
                    raise
                unreachable[shard] = err
        if not replies:  # the caller logs the one failure
            raise next(iter(unreachable.values())) if unreachable else lost
        for shard, err in unreachable.items():
            log.warning("shard=%d heartbeat failed: %s", shard, err.code().name)
        return self._merged(replies)

    def _beat(
        self, shard: int, request: pb.HeartbeatRequest, timeout_s: float
    ) -> pb.HeartbeatResponse:
        mine = pb.HeartbeatRequest()
        mine.CopyFrom(request)
        mine.session_id = session_of(request.session_id, shard, self.shard_count)
        with self.sessions.noting_lost(shard, mine.session_id, "heartbeat"):
            reply = self.map.clients[shard].heartbeat(mine, timeout_s)
        self.sessions.note_epoch(shard, mine.session_id, reply.server_epoch)
        return reply

    def leave(self, session_id: str) -> None:
        """Leave every shard; the first failure is raised once all were tried."""
        failed = None
        for shard, client in enumerate(self.map.clients):
            try:
                client.leave(session_of(session_id, shard, self.shard_count))
            except grpc.RpcError as err:
                failed = failed or err
        if failed is not None:
            raise failed

    def _merged(self, replies: dict[int, pb.HeartbeatResponse]) -> pb.HeartbeatResponse:
        for fid, owner in enumerate(self.map.owners):
            if owner in replies and fid < len(replies[owner].fragment_versions):
                self._versions[fid] = replies[owner].fragment_versions[fid]
        first = replies[min(replies)]
        return pb.HeartbeatResponse(
            server_epoch=self.sessions.membership().server_epoch,
            fragment_versions=self._versions,
            live_learners=max(r.live_learners for r in replies.values()),
            median_step_time_s=first.median_step_time_s,
            schedule_step=first.schedule_step,
        )
