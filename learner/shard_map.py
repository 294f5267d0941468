"""The shards of a run as a learner finds and joins them (docs/architecture.md, Sharding):
their addresses, a channel to each, and the shard map every join must agree on.

    shards = ShardMap(addresses, credentials, metadata, traffic)
    shards.wait_ready(timeout_s)                             # all, or the first and a grace
    replies = shards.join_all(learner_id, fingerprint)       # None for a shard that is away
    reply = shards.join_one(shard, learner_id, fingerprint)  # checked against the map
    shards.owner(fragment_id)

Given one address it asks that server for the shard map (DescribeShards) at the first join
and, when the run has N > 1 shards, uses the addresses the server advertises; a plain server
is shard 0 of 1. Every shard's join reply names its index, the shard count, the map id (a
hash of the fingerprint, P, layout and owners) and the mode; a learner joins a run only
where each shard it reaches agrees with the first one that answered, and says which shard
does not (ShardMapError). A shard that cannot be reached at a join (down, not started yet,
or silent for CONNECT_PROBE_S) is None in the answer; only a join that no shard answers
fails. The sessions the joins open, and where each call goes, are ShardedClient's
(learner/shards.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import grpc

from common.generated.diloco.v1 import aggregator_pb2 as pb
from common.retry import is_retryable, log_retry
from common.traffic import Traffic
from learner.client import AggregatorClient

log = logging.getLogger("diloco.learner")

# Once one shard's channel is up, how long wait_ready waits for the others before the join
# goes on without them (they are joined when they answer: learner/rejoin.py).
ABSENT_GRACE_S = 10.0
_READY_POLL_S = 0.05
# While no shard has connected, wait_ready logs after each of these waits (the last repeats):
# a learner started before its server says at once what it waits for, then less often.
READY_NOTES_S = (1.0, 2.0, 4.0, 8.0)
# How long a join waits for a shard to answer a DescribeShards before it counts the shard
# as away: an address that drops packets would otherwise hold the learner (its training
# thread, at a rejoin) for gRPC's connect timeout (20 s) at every try. Longer than the
# channels' reconnect backoff (at most 2 s, common/rpc.py): a shard that is back answers.
CONNECT_PROBE_S = 2.5


class ShardMapError(ValueError):
    """The shards disagree with each other or with the learner's list of them."""


class NotConnected(grpc.RpcError):
    """The shard did not answer within CONNECT_PROBE_S: retried like UNAVAILABLE."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return f"no answer within {CONNECT_PROBE_S:g} s"


class ShardMap:
    """The run's shards in index order (a client each), the owner of each fragment, and
    the join reply the shards must agree with; joins run on the training thread only."""

    def __init__(
        self,
        addresses: Sequence[str],
        credentials: grpc.ChannelCredentials | None,
        metadata: tuple[tuple[str, str], ...],
        traffic: Traffic,
    ) -> None:
        """`addresses`: every shard's, in index order, or one (then the others are found
        with DescribeShards). `traffic`: one count for the learner, whatever the shard."""
        if not addresses:
            raise ValueError("at least one server address is needed")
        self._credentials, self._metadata, self._traffic = credentials, metadata, traffic
        self._discovered = len(addresses) > 1  # a list is taken as given
        self.addresses = list(addresses)
        self.clients = [self._client(a) for a in self.addresses]
        self.owners: list[int] = []  # owner shard of each fragment, from the last join
        # The join reply of the first shard that answered the last join: the map to agree on.
        self._agreed: pb.JoinResponse | None = None

    @property
    def count(self) -> int:
        return len(self.clients)

    @property
    def agreed(self) -> pb.JoinResponse:
        """The join reply of the first shard that answered the last join."""
        if self._agreed is None:
            raise RuntimeError("no join yet: the shard map is not known")
        return self._agreed

    def owner(self, fragment_id: int) -> int:
        """The shard that owns the fragment (0 before the first join)."""
        return self.owners[fragment_id] if fragment_id < len(self.owners) else 0

    def close(self) -> None:
        for client in self.clients:
            client.close()

    def wait_ready(self, timeout_s: float) -> None:
        """Block until every listed shard's channel connects, or until one has and the others
        had ABSENT_GRACE_S more (the join goes on without them); grpc.FutureTimeoutError if
        none connects within `timeout_s`."""
        futures = [client.ready_future() for client in self.clients]
        started = time.monotonic()
        deadline, attempt, note_at = started + timeout_s, 0, started + READY_NOTES_S[0]
        try:
            while not all(f.done() for f in futures):
                now = time.monotonic()
                if any(f.done() for f in futures):
                    deadline = min(deadline, now + ABSENT_GRACE_S)
                elif note_at <= now < deadline:  # none yet: say what it waits for
                    attempt += 1
                    wait_s = READY_NOTES_S[min(attempt, len(READY_NOTES_S) - 1)]
                    note_at = now + wait_s
                    log_retry(
                        f"connect to {', '.join(self.addresses)}",
                        f"no connection after {now - started:.0f} s of {timeout_s:g}",
                        attempt,
                        min(wait_s, deadline - now),
                    )
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
        described = self.clients[0].describe_shards()
        if described.shard_count > 1:
            if len(described.addresses) != described.shard_count:
                raise ShardMapError(
                    f"the server at {self.addresses[0]} is shard {described.shard_index} of "
                    f"{described.shard_count} and does not advertise the shards' addresses "
                    f"(--shard-addresses): list every shard in --server, in index order"
                )
            self.close()
            self.addresses = list(described.addresses)
            self.clients = [self._client(a) for a in self.addresses]
            log.info("discovered %d shards: %s", len(self.addresses), ",".join(self.addresses))
        self._discovered = True

    def join_all(
        self, learner_id: str, fingerprint: Sequence[pb.ParamSpec], tokens_per_step: int
    ) -> list[pb.JoinResponse | None]:
        """Join every shard (AggregatorClient.join's arguments): their replies in index
        order, None for a shard that could not be reached. The first answer becomes the map
        (`agreed`, `owners`) once every answer agrees with it; raises the first shard's error
        if none answered, ShardMapError if one disagrees or refuses."""
        self.discover()
        join = (learner_id, fingerprint, tokens_per_step)
        replies: list[pb.JoinResponse | None] = []
        unreachable: dict[int, grpc.RpcError] = {}
        for shard in range(self.count):
            try:
                replies.append(self._join_shard(shard, *join))
            except grpc.RpcError as err:  # retryable: the shard is away (others raise)
                replies.append(None)
                unreachable[shard] = err
        if len(unreachable) == self.count:
            raise unreachable[0]  # the session backs off and joins again
        self.agree(replies)
        for shard, err in unreachable.items():
            log.warning(
                "shard=%d at %s unreachable at join (%s); joining the others, it is "
                "joined when it answers",
                shard,
                self.addresses[shard],
                err.code().name,
            )
        return replies

    def agree(self, replies: Sequence[pb.JoinResponse | None]) -> None:
        """Take the map of a join's replies (join_all's, or those another rank of an island
        got: learner/sliced.py) once every answer agrees with the first; ShardMapError if
        one does not."""
        answered = [shard for shard, r in enumerate(replies) if r is not None]
        first = replies[answered[0]]
        assert first is not None
        for shard in answered:  # the first against itself first: its index, N
            check_shard(replies[shard], shard, self.addresses[shard], self.count, first)
        self._agreed, self.owners = first, list(first.fragment_owners)

    def join_one(
        self, shard: int, learner_id: str, fingerprint: Sequence[pb.ParamSpec], tokens: int
    ) -> pb.JoinResponse:
        """Join one shard again (join_all's arguments): its reply, or ShardMapError, naming
        the shard, unless it agrees with the map of the last join."""
        agreed = self.agreed
        reply = self._join_shard(shard, learner_id, fingerprint, tokens)
        check_shard(reply, shard, self.addresses[shard], self.count, agreed)
        return reply

    def _client(self, address: str) -> AggregatorClient:
        client = AggregatorClient(address, self._credentials, self._metadata)
        client.traffic = self._traffic
        return client

    def _join_shard(
        self, shard: int, learner_id: str, fingerprint: Sequence[pb.ParamSpec], tokens: int
    ) -> pb.JoinResponse:
        try:
            self._probe(shard)
            return self.clients[shard].join(learner_id, fingerprint, tokens)
        except grpc.RpcError as err:
            # Retryable: the session backs off and joins again. A plain server's refusal
            # needs no shard named: the learner says what the server answered.
            if is_retryable(err) or self.count == 1:
                raise
            raise ShardMapError(
                f"shard {shard} at {self.addresses[shard]} refused the join: "
                f"{err.code().name}: {err.details()}"
            ) from err

    def _probe(self, shard: int) -> None:
        """Return if the shard answers a DescribeShards within CONNECT_PROBE_S (its channel
        may connect meanwhile: a shard that is back does), else NotConnected."""
        try:
            self.clients[shard].describe_shards(CONNECT_PROBE_S, wait_for_ready=True)
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise NotConnected() from None
            raise


def check_shard(
    reply: pb.JoinResponse,
    shard: int,
    address: str,
    shard_count: int,
    first: pb.JoinResponse,
) -> None:
    """ShardMapError, naming the shard, unless its join reply says it is shard `shard` of
    `shard_count` with the map id and mode of `first` (the reply of the first shard that
    answered, already checked: its shard_index is its place in the list)."""
    where = f"shard {shard} at {address}"
    if reply.shard_count != shard_count:
        raise ShardMapError(
            f"{where} is one of {max(1, reply.shard_count)} shards, but --server lists "
            f"{shard_count}: list every shard of the run, in index order"
        )
    if reply.shard_index != shard:
        raise ShardMapError(f"{where} is shard {reply.shard_index}: list the shards in index order")
    if reply.map_id != first.map_id:
        raise ShardMapError(
            f"{where} has shard map {reply.map_id}, shard {first.shard_index} has {first.map_id}: "
            f"the shards disagree on the fingerprint, fragments, layout or shard count"
        )
    if reply.mode != first.mode:
        raise ShardMapError(
            f"{where} runs mode {reply.mode}, shard {first.shard_index} runs {first.mode}"
        )


def version_in(fragments: Sequence[pb.FragmentLayout], fragment_id: int) -> int:
    """The fragment's version in a join reply's layout; ShardMapError if it is missing."""
    for fragment in fragments:
        if fragment.fragment_id == fragment_id:
            return fragment.version
    raise ShardMapError(f"fragment {fragment_id} is missing from its owner's layout")
