"""The learner's client for an aggregator run as N shards (docs/architecture.md, Sharding).

    client = ShardedClient(["a:50051", "b:50051"], credentials, metadata)
    reply = client.join(learner_id, fingerprint)   # joins every shard, checks they agree
    client.push(header, payload)                   # to the fragment's owner only

It offers AggregatorClient's calls, so the session, transport and heartbeat work unchanged
over any N. Given one address it asks that server for the shard map (DescribeShards) at the
first join and, when the run has N > 1 shards, uses the addresses the server advertises. A
join goes to every shard; all must agree on N, their index (the list is in index order), the
map id (fingerprint, P, layout, owners) and the mode, or the join fails with ShardMapError
naming the shard. The learner's session is then one id per shard, joined with SEP, and the
server epoch one hash of the shards' epochs, so a restarted shard reads as a new epoch.

Heartbeats go to every shard; a shard that cannot be reached is skipped (its fragments keep
their last known versions) while the live ones renew the lease. With one shard every call
is passed through as it is.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Sequence

import grpc

from common.generated.diloco.v1 import aggregator_pb2 as pb
from common.retry import is_retryable
from common.traffic import Traffic
from learner.client import AggregatorClient

log = logging.getLogger("diloco.learner")

SEP = ","  # between the shards' session ids (server session ids are hex)


class ShardMapError(ValueError):
    """The shards disagree with each other or with the learner's list of them."""


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
        self._epochs: list[int] = []  # each shard's epoch at the last join
        self._versions: list[int] = []  # last known version of each fragment

    @property
    def target(self) -> str:
        return SEP.join(self.addresses)

    @property
    def shard_count(self) -> int:
        return len(self._clients)

    def shard_of(self, fragment_id: int) -> int:
        """The shard that owns the fragment (0 before the first join)."""
        return self._owners[fragment_id] if fragment_id < len(self._owners) else 0

    def close(self) -> None:
        for client in self._clients:
            client.close()

    def wait_ready(self, timeout_s: float) -> None:
        """Block until every listed shard's channel connects (grpc.FutureTimeoutError)."""
        deadline = time.monotonic() + timeout_s
        for client in self._clients:
            client.wait_ready(max(0.0, deadline - time.monotonic()))

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

    def join(self, learner_id: str, fingerprint: Sequence[pb.ParamSpec]) -> pb.JoinResponse:
        """Join every shard; one reply whose session and epoch stand for all of them."""
        self.discover()
        if len(self._clients) == 1:
            reply = self._clients[0].join(learner_id, fingerprint)
            self._remember(reply, [0] * len(reply.fragments), [reply.server_epoch])
            return reply
        replies = [self._join_shard(i, learner_id, fingerprint) for i in range(self.shard_count)]
        check_agreement(replies, self.addresses)
        owners = list(replies[0].fragment_owners)
        reply = pb.JoinResponse()
        reply.CopyFrom(replies[0])
        reply.session_id = SEP.join(r.session_id for r in replies)
        reply.server_epoch = combined_epoch([r.server_epoch for r in replies])
        reply.lease_s = min(r.lease_s for r in replies)
        reply.schedule_step = max(r.schedule_step for r in replies)
        for fragment in reply.fragments:
            owner = replies[owners[fragment.fragment_id]]
            fragment.version = _version_in(owner.fragments, fragment.fragment_id)
        self._remember(reply, owners, [r.server_epoch for r in replies])
        return reply

    def push(self, header: pb.PushHeader, payload: bytes) -> pb.PushFragmentResponse:
        shard = self.shard_of(header.fragment_id)
        mine = pb.PushHeader()
        mine.CopyFrom(header)
        mine.session_id = _session_of(header.session_id, shard, self.shard_count)
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
        return self._clients[shard].pull(
            _session_of(session_id, shard, self.shard_count),
            fragment_id,
            have_version,
            wait_for_version,
            wait_timeout_s,
        )

    def heartbeat(self, request: pb.HeartbeatRequest) -> pb.HeartbeatResponse:
        """Every shard's heartbeat in one answer. A lost session on any shard (NOT_FOUND) is
        raised once all were tried; an unreachable shard only if none answered."""
        if self.shard_count == 1:
            return self._clients[0].heartbeat(request)
        replies: dict[int, pb.HeartbeatResponse] = {}
        lost = unreachable = None
        for shard, client in enumerate(self._clients):
            mine = pb.HeartbeatRequest()
            mine.CopyFrom(request)
            mine.session_id = _session_of(request.session_id, shard, self.shard_count)
            try:
                replies[shard] = client.heartbeat(mine)
            except grpc.RpcError as err:
                if err.code() == grpc.StatusCode.NOT_FOUND:
                    lost = err
                elif is_retryable(err):
                    unreachable = err
                    log.warning("shard=%d heartbeat failed: %s", shard, err.code().name)
                else:
                    raise
        if lost is not None:
            raise lost
        if not replies:
            raise unreachable
        return self._merged(replies)

    def leave(self, session_id: str) -> None:
        """Leave every shard; the first failure is raised once all were tried."""
        failed = None
        for shard, client in enumerate(self._clients):
            try:
                client.leave(_session_of(session_id, shard, self.shard_count))
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
        self, shard: int, learner_id: str, fingerprint: Sequence[pb.ParamSpec]
    ) -> pb.JoinResponse:
        try:
            return self._clients[shard].join(learner_id, fingerprint)
        except grpc.RpcError as err:
            if is_retryable(err):
                raise  # the session backs off and joins again
            raise ShardMapError(
                f"shard {shard} at {self.addresses[shard]} refused the join: "
                f"{err.code().name}: {err.details()}"
            ) from err

    def _remember(self, reply: pb.JoinResponse, owners: list[int], epochs: list[int]) -> None:
        self._owners, self._epochs = owners, epochs
        self._versions = [f.version for f in sorted(reply.fragments, key=lambda f: f.fragment_id)]

    def _merged(self, replies: dict[int, pb.HeartbeatResponse]) -> pb.HeartbeatResponse:
        for fid, owner in enumerate(self._owners):
            if owner in replies and fid < len(replies[owner].fragment_versions):
                self._versions[fid] = replies[owner].fragment_versions[fid]
        first = replies[min(replies)]
        epochs = [
            replies[s].server_epoch if s in replies else epoch
            for s, epoch in enumerate(self._epochs)
        ]
        return pb.HeartbeatResponse(
            server_epoch=combined_epoch(epochs),
            fragment_versions=self._versions,
            live_learners=max(r.live_learners for r in replies.values()),
            median_step_time_s=first.median_step_time_s,
            schedule_step=first.schedule_step,
        )


def check_agreement(replies: Sequence[pb.JoinResponse], addresses: Sequence[str]) -> None:
    """ShardMapError, naming the shard, unless every shard's join reply fits the list and
    the first shard's map (N, index, map id, mode)."""
    first = replies[0]
    for shard, (reply, address) in enumerate(zip(replies, addresses, strict=True)):
        where = f"shard {shard} at {address}"
        if reply.shard_count != len(addresses):
            raise ShardMapError(
                f"{where} is one of {max(1, reply.shard_count)} shards, but --server lists "
                f"{len(addresses)}: list every shard of the run, in index order"
            )
        if reply.shard_index != shard:
            raise ShardMapError(
                f"{where} is shard {reply.shard_index}: list the shards in index order"
            )
        if reply.map_id != first.map_id:
            raise ShardMapError(
                f"{where} has shard map {reply.map_id}, shard 0 has {first.map_id}: the "
                f"shards disagree on the fingerprint, fragments, layout or shard count"
            )
        if reply.mode != first.mode:
            raise ShardMapError(f"{where} runs mode {reply.mode}, shard 0 runs {first.mode}")


def combined_epoch(epochs: Sequence[int]) -> int:
    """One 63-bit epoch for the shards' epochs: it changes when any shard restarts."""
    if len(epochs) == 1:
        return epochs[0]
    digest = hashlib.sha256(",".join(str(e) for e in epochs).encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def _session_of(session_id: str, shard: int, shard_count: int) -> str:
    """The shard's own session id within the learner's (an unknown one passes unchanged:
    the shard answers NOT_FOUND, and the learner joins again)."""
    if shard_count == 1:
        return session_id
    parts = session_id.split(SEP)
    return parts[shard] if len(parts) == shard_count else session_id


def _version_in(fragments: Sequence[pb.FragmentLayout], fragment_id: int) -> int:
    for fragment in fragments:
        if fragment.fragment_id == fragment_id:
            return fragment.version
    raise ShardMapError(f"fragment {fragment_id} is missing from its owner's layout")
