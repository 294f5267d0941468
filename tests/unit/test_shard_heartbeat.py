"""The learner's heartbeat over N shards: sent to every shard at once, each bounded by a
third of the lease, so that a shard that does not answer holds back no other's renewal."""

from __future__ import annotations

import threading

import grpc

from common.generated.diloco.v1 import aggregator_pb2 as pb
from learner.shards import SEP, ShardedClient

LEASE_S = 9.0


class Deadline(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.DEADLINE_EXCEEDED


class BlackHole:
    """A shard whose heartbeat answers nothing until its deadline; notes whether another
    shard was asked meanwhile."""

    def __init__(self, others_asked: threading.Event) -> None:
        self.others_asked, self.timeouts = others_asked, []
        self.overlapped = False

    def heartbeat(self, request: pb.HeartbeatRequest, timeout_s: float) -> pb.HeartbeatResponse:
        self.timeouts.append(timeout_s)
        # Bounded: asked one after the other, the other shard is not asked before this ends.
        self.overlapped = self.others_asked.wait(timeout=5)
        raise Deadline()


class Live:
    def __init__(self, asked: threading.Event, epoch: int) -> None:
        self.asked, self.epoch, self.sessions = asked, epoch, []

    def heartbeat(self, request: pb.HeartbeatRequest, timeout_s: float) -> pb.HeartbeatResponse:
        self.sessions.append(request.session_id)
        self.asked.set()
        return pb.HeartbeatResponse(server_epoch=self.epoch, fragment_versions=[0, 7])


def test_a_shard_that_does_not_answer_holds_back_no_renewal() -> None:
    client = ShardedClient(["127.0.0.1:1", "127.0.0.1:2"])
    try:
        replies = [
            pb.JoinResponse(session_id=f"s{i}", server_epoch=10 + i, lease_s=LEASE_S)
            for i in range(2)
        ]
        client.sessions.joined_all(replies, "l0")
        client.map.owners, client._versions = [0, 1], [0, 0]
        asked = threading.Event()
        hole, live = BlackHole(asked), Live(asked, epoch=11)
        client.map.clients = [hole, live]

        beat = client.heartbeat(pb.HeartbeatRequest(session_id=f"s0{SEP}s1"))

        assert hole.overlapped, "the live shard was asked only after the silent one's deadline"
        assert hole.timeouts == [LEASE_S / 3]
        assert live.sessions == ["s1"]  # each shard gets its own session id
        assert list(beat.fragment_versions) == [0, 7]  # the silent shard's keep their last
        assert client.lost_shards() == set()
    finally:
        client.map.clients = []
