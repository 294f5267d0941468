"""The learner's client for an aggregator run as N shards (docs/architecture.md, Sharding);
a plain server is shard 0 of 1, and goes through the same code.

    client = ShardedClient(["a:50051", "b:50051"], credentials, metadata)
    reply = client.join(learner_id, fingerprint)   # joins every shard, checks they agree
    client.push(header, payload)                   # to the fragment's owner only

It offers AggregatorClient's calls, so the session, transport and heartbeat work unchanged
over any N. Given one address it asks that server for the shard map (DescribeShards) at the
first join and, when the run has N > 1 shards, uses the addresses the server advertises. A
join goes to every shard; all must agree on N, their index (the list is in index order), the
map id (fingerprint, P, layout, owners) and the mode, or the join fails with ShardMapError
naming the shard. The learner's session is then one id per shard, joined with SEP, and the
server epoch one hash of the shards' epochs (`membership()`). A shard that cannot be reached
at the join (down, or not started yet) does not hold the others up: the join takes the map
from the shards that answer, the absent one counts as lost (its fragments are `away()` until
`join_shard` joins it, which checks it against that map), and only a join that no shard
answers fails.

Heartbeats go to every shard at once, each bounded by a third of the lease; a shard that
cannot be reached is skipped (its fragments keep their last known versions) while the live
ones renew the lease. Every call in a session goes through ShardSessions.noting_lost, and
every heartbeat's epoch through ShardSessions.note_epoch (learner/shard_sessions.py, the one
place that reads NOT_FOUND or a new epoch as a lost session): a shard that lost the session
is noted in `lost_shards()`, and `join_shard` joins it alone again (learner/rejoin.py),
whatever the other shards' state: one that is down meanwhile does not hold it up.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import grpc

from common.generated.diloco.v1 import aggregator_pb2 as pb
from common.retry import is_retryable
from common.traffic import Traffic
from learner.client import AggregatorClient
from learner.heartbeat import Membership
from learner.shard_map import ShardMapError, check_shard, version_in
from learner.shard_sessions import SEP, SessionLost, ShardSessions, session_of

__all__ = ["SEP", "NotConnected", "SessionLost", "ShardMapError", "ShardedClient"]

log = logging.getLogger("diloco.learner")

# Once one shard's channel is up, how long wait_ready waits for the others before the join
# goes on without them (they are joined when they answer: learner/rejoin.py).
ABSENT_GRACE_S = 10.0
_READY_POLL_S = 0.05
# How long a join waits for a shard to answer a DescribeShards before it counts the
# shard as away: an address that drops packets would otherwise hold the learner (its
# training thread, at a rejoin) for gRPC's connect timeout (20 s) at every try. Longer than
# the channels' reconnect backoff (at most 2 s, common/rpc.py): a shard that is back answers.
CONNECT_PROBE_S = 2.5


class NotConnected(grpc.RpcError):
    """The shard did not answer within CONNECT_PROBE_S: retried like UNAVAILABLE."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return f"no answer within {CONNECT_PROBE_S:g} s"


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
        if not addresses:
            raise ValueError("at least one server address is needed")
        self._credentials, self._metadata = credentials, metadata
        self.traffic = Traffic()
        self._discovered = len(addresses) > 1  # a list is taken as given
        self.addresses = list(addresses)
        self._clients = [self._client(a) for a in self.addresses]
        self._owners: list[int] = []  # owner shard of each fragment, from the last join
        self._versions: list[int] = []  # last known version of each fragment
        # The join reply of the first shard that answered the last join: the map to agree on.
        self._map: pb.JoinResponse | None = None
        self.sessions = ShardSessions()

    @property
    def target(self) -> str:
        return SEP.join(self.addresses)

    @property
    def shard_count(self) -> int:
        return len(self._clients)

    def membership(self) -> Membership:
        """The session as joined, what every call goes with (ShardSessions.membership)."""
        return self.sessions.membership()

    def lost_shards(self) -> set[int]:
        """The shards that no longer know the current session: join_shard them."""
        return self.sessions.lost()

    def away(self) -> set[int]:
        """The fragments whose owner no longer knows the session (or never answered a join)."""
        lost = self.lost_shards()
        return {fid for fid, owner in enumerate(self._owners) if owner in lost}

    def shard_of(self, fragment_id: int) -> int:
        """The shard that owns the fragment (0 before the first join)."""
        return self._owners[fragment_id] if fragment_id < len(self._owners) else 0

    def close(self) -> None:
        for client in self._clients:
            client.close()

    def wait_ready(self, timeout_s: float) -> None:
        """Block until every listed shard's channel connects, or until one has and the others
        had ABSENT_GRACE_S more (the join goes on without them); grpc.FutureTimeoutError if
        none connects within `timeout_s`."""
        futures = [client.ready_future() for client in self._clients]
        deadline = time.monotonic() + timeout_s
        try:
            while not all(f.done() for f in futures):
                now = time.monotonic()
                if any(f.done() for f in futures):
                    deadline = min(deadline, now + ABSENT_GRACE_S)
                if now >= deadline:
                    if not any(f.done() for f in futures):
                        raise grpc.FutureTimeoutError()
                    log.warning(
                        "shards %s not reachable yet; joining the others",
                        [i for i, f in enumerate(futures) if not f.done()],
                    )
                    return
                time.sleep(min(_READY_POLL_S, max(0.0, deadline - now)))
        finally:
            for future in futures:
                future.cancel()

    def discover(self) -> None:
        """Given one address: take the run's shard addresses from it, once (join does)."""
        if self._discovered:
            return
        described = self._clients[0].describe_shards()
        if described.shard_count > 1:
            if len(described.addresses) != described.shard_count:
                raise ShardMapError(
                    f"the server at {self.addresses[0]} is shard {described.shard_index} of "
                    f"{described.shard_count} and does not advertise the shards' addresses "
                    f"(--shard-addresses): list every shard in --server, in index order"
                )
            self.close()
            self.addresses = list(described.addresses)
            self._clients = [self._client(a) for a in self.addresses]
            log.info("discovered %d shards: %s", len(self.addresses), self.target)
        self._discovered = True

    def shards(self) -> list[AggregatorClient]:
        """One client per shard, in index order (after discover(), every shard's)."""
        return list(self._clients)

    def join(
        self, learner_id: str, fingerprint: Sequence[pb.ParamSpec], tokens_per_step: int = 0
    ) -> pb.JoinResponse:
        """Join every shard (AggregatorClient.join's arguments); one reply whose session and
        epoch stand for all of them."""
        self.discover()
        join = (learner_id, fingerprint, tokens_per_step)
        replies: list[pb.JoinResponse | None] = []
        unreachable: dict[int, grpc.RpcError] = {}
        for shard in range(self.shard_count):
            try:
                replies.append(self._join_shard(shard, *join))
            except grpc.RpcError as err:  # retryable: the shard is away (others raise)
                replies.append(None)
                unreachable[shard] = err
        answered = [shard for shard, r in enumerate(replies) if r is not None]
        if not answered:
            raise unreachable[0]  # the session backs off and joins again
        for shard, err in unreachable.items():
            log.warning(
                "shard=%d at %s unreachable at join (%s); joining the others, it is "
                "joined when it answers",
                shard,
                self.addresses[shard],
                err.code().name,
            )
        self._map = first = replies[answered[0]]
        for shard in answered:  # the first against itself first: its index, N
            check_shard(replies[shard], shard, self.addresses[shard], self.shard_count, first)
        self._owners = list(first.fragment_owners)
        reply = pb.JoinResponse()
        reply.CopyFrom(first)
        reply.schedule_step = max(replies[shard].schedule_step for shard in answered)
        for fragment in reply.fragments:
            owner = replies[self._owners[fragment.fragment_id]]
            # A fragment whose owner is away stays at -1 until that shard is joined.
            fragment.version = (
                -1 if owner is None else version_in(owner.fragments, fragment.fragment_id)
            )
        self._remember(replies, reply.fragments, learner_id)
        joined = self.sessions.membership()
        reply.session_id, reply.server_epoch = joined.session_id, joined.server_epoch
        reply.lease_s = joined.lease_s
        return reply

    def join_shard(
        self, shard: int, learner_id: str, fingerprint: Sequence[pb.ParamSpec], tokens: int = 0
    ) -> pb.JoinResponse:
        """Join one shard again (join's arguments), the others' sessions untouched.
        ShardMapError, naming the shard, unless it agrees with the map of the last join."""
        if self._map is None:
            raise RuntimeError("join_shard() before the first join")
        reply = self._join_shard(shard, learner_id, fingerprint, tokens)
        check_shard(reply, shard, self.addresses[shard], self.shard_count, self._map)
        for fid, owner in enumerate(self._owners):
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
            return self._clients[shard].push(mine, payload)

    def pull(
        self,
        session_id: str,
        fragment_id: int,
        have_version: int,
        wait_for_version: int = 0,
        wait_timeout_s: float = 0.0,
    ) -> tuple[pb.PullHeader, bytes]:
        shard = self.shard_of(fragment_id)
        session = session_of(session_id, shard, self.shard_count)
        with self.sessions.noting_lost(shard, session, "pull"):
            return self._clients[shard].pull(
                session, fragment_id, have_version, wait_for_version, wait_timeout_s
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
            reply = self._clients[shard].heartbeat(mine, timeout_s)
        self.sessions.note_epoch(shard, mine.session_id, reply.server_epoch)
        return reply

    def leave(self, session_id: str) -> None:
        """Leave every shard; the first failure is raised once all were tried."""
        failed = None
        for shard, client in enumerate(self._clients):
            try:
                client.leave(session_of(session_id, shard, self.shard_count))
            except grpc.RpcError as err:
                failed = failed or err
        if failed is not None:
            raise failed

    # -- internals -------------------------------------------------------------------------

    def _client(self, address: str) -> AggregatorClient:
        client = AggregatorClient(address, self._credentials, self._metadata)
        client.traffic = self.traffic  # one count for the learner, whatever the shard
        return client

    def _join_shard(
        self, shard: int, learner_id: str, fingerprint: Sequence[pb.ParamSpec], tokens: int
    ) -> pb.JoinResponse:
        try:
            self._probe(shard)
            return self._clients[shard].join(learner_id, fingerprint, tokens)
        except grpc.RpcError as err:
            # Retryable: the session backs off and joins again. A plain server's refusal
            # needs no shard named: the learner says what the server answered.
            if is_retryable(err) or self.shard_count == 1:
                raise
            raise ShardMapError(
                f"shard {shard} at {self.addresses[shard]} refused the join: "
                f"{err.code().name}: {err.details()}"
            ) from err

    def _probe(self, shard: int) -> None:
        """Return if the shard answers a DescribeShards within CONNECT_PROBE_S (its channel
        may connect meanwhile: a shard that is back does), else NotConnected."""
        try:
            self._clients[shard].describe_shards(CONNECT_PROBE_S, wait_for_ready=True)
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise NotConnected() from None
            raise

    def _remember(
        self,
        replies: Sequence[pb.JoinResponse | None],
        fragments: Sequence[pb.FragmentLayout],
        learner_id: str,
    ) -> None:
        """Take in a join of the shards: `replies` in shard order (None: the shard was
        away), `fragments` each at its owner's version."""
        self._versions = [f.version for f in sorted(fragments, key=lambda f: f.fragment_id)]
        self.sessions.joined_all(replies, learner_id)

    def _merged(self, replies: dict[int, pb.HeartbeatResponse]) -> pb.HeartbeatResponse:
        for fid, owner in enumerate(self._owners):
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
