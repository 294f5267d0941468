"""A learner's rejoin of the shards that lost its session: one shard that is away holds up
no other's rejoin, its next try waits for the backoff, and a shard whose channel does not
connect costs a short probe, not a join's deadline."""

from __future__ import annotations

from types import SimpleNamespace

import grpc
import pytest

from common.retry import is_retryable
from learner.rejoin import NotConnected, ShardRejoins


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


class Probe:
    """A channel-ready future that is done once `connected` is set."""

    def __init__(self, channel: SimpleNamespace) -> None:
        self.channel = channel

    def result(self, timeout: float) -> None:
        if not self.channel.connected:
            raise grpc.FutureTimeoutError()


def test_a_shard_whose_channel_does_not_connect_costs_a_short_probe_not_a_join() -> None:
    channel = SimpleNamespace(connected=False, probes=0)

    def ready_future() -> Probe:
        channel.probes += 1
        return Probe(channel)

    shard = SimpleNamespace(ready_future=ready_future)
    client = SimpleNamespace(shards=lambda: [shard])
    rejoins = ShardRejoins(SimpleNamespace(client=client, learner_id="l0"))
    with pytest.raises(NotConnected) as away:
        rejoins._connected(0)
    assert is_retryable(away.value)  # tried again after the backoff, as a shard that is down
    with pytest.raises(NotConnected):
        rejoins._connected(0)
    assert channel.probes == 1  # one probe, kept: the channel goes on connecting meanwhile
    channel.connected = True
    rejoins._connected(0)  # then the join goes ahead
    rejoins._connected(0)
    assert channel.probes == 2  # a later loss of the shard probes afresh
