"""A learner's rejoin of the shards that lost its session: one shard that is away holds up
no other's rejoin, and its next try waits for the backoff."""

from __future__ import annotations

from types import SimpleNamespace

import grpc

from learner.rejoin import ShardRejoins


class Unavailable(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE


class Sessions:
    def __init__(self, lost: set[int]) -> None:
        self.lost = lost

    def mark_lost(self, shard: int) -> None:
        self.lost.add(shard)


def test_a_shard_that_is_away_holds_up_no_other_shards_rejoin() -> None:
    sessions = Sessions({0, 2})
    client = SimpleNamespace(lost_shards=lambda: set(sessions.lost), sessions=sessions)
    rejoins = ShardRejoins(SimpleNamespace(client=client, learner_id="l0"))
    tried = []

    def rejoin(shard: int) -> bool:
        tried.append(shard)
        if shard == 0:  # down: never answers
            raise Unavailable()
        sessions.lost.discard(shard)
        return True

    rejoins._rejoin = rejoin  # the joins themselves are tests/integration/test_shard*.py's
    assert rejoins.try_rejoin() is True  # shard 2 joined, its fragments' values changed
    assert tried == [0, 2] and sessions.lost == {0}
    assert rejoins.try_rejoin() is False and tried == [0, 2]  # shard 0 waits for the backoff
    assert rejoins.try_rejoin(now=True) is False and tried == [0, 2, 0]  # unless asked now
