"""A learner's rejoin of the shards that lost its session: one shard that is away holds up
no other's rejoin, and its next try waits for the backoff; a shard that came back without
versions it had served gives its own state, said in one log line, and one that lost nothing
leaves the learner its local progress."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import grpc
import torch

from common.codec.fragment import encode_fragment, params_crc32
from common.generated.diloco.v1 import aggregator_pb2 as pb
from learner.progress import Progress
from learner.rejoin import ShardRejoins
from learner.replicas import ReplicaLoader
from learner.streaming import FragmentReplica, PullReply, Schedule, StreamingSync


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


# -- what a rejoined shard's fragments take ------------------------------------------------

SHAPES = [(2, 3), (4,), (5,)]  # one parameter per fragment


class RestartedServer:
    """A plain server (shard 0 of 1) that restarted: each fragment at a version and value,
    answering a pull as the aggregator does (up to date at or past its version, else a
    snapshot), and a rejoin with the versions it restored."""

    def __init__(self, served: dict[int, tuple[int, torch.Tensor]]) -> None:
        self.served = served
        self.lost = {0}  # it no longer knows the learner's session
        self.sessions = Sessions(self.lost)

    # the client's side
    def lost_shards(self) -> set[int]:
        return set(self.lost)

    def shard_of(self, fragment_id: int) -> int:
        return 0

    def membership(self) -> SimpleNamespace:
        return SimpleNamespace(session_id="s2")

    def join_shard(self, shard: int, *args) -> SimpleNamespace:
        self.lost.discard(shard)
        fragments = [
            pb.FragmentLayout(fragment_id=f, param_indices=[f], version=version)
            for f, (version, _) in sorted(self.served.items())
        ]
        return SimpleNamespace(fragments=fragments, server_epoch=2)

    # the transport's side
    def abandon_in_flight(self, shard: int) -> None:
        pass

    def pull(self, fragment_id: int, have_version: int, wait: int, retry: bool) -> PullReply:
        version, value = self.served[fragment_id]
        crc = params_crc32([value])
        if have_version >= version:
            return PullReply(pb.PULL_KIND_UP_TO_DATE, version, b"", crc)
        return PullReply(pb.PULL_KIND_SNAPSHOT, version, encode_fragment([value], "fp32"), crc)


def rejoined(server: RestartedServer, held: dict[int, tuple[int, torch.Tensor]], local):
    """A learner that holds `held` (fragment: version, global value) and trains `local`,
    after it rejoined `server`: (its sync, whether rejoin said the parameters changed)."""
    replicas = []
    for f, (version, value) in sorted(held.items()):
        replica = FragmentReplica(f, [f], [SHAPES[f]])
        replica.params, replica.version = [value.clone()], version
        replicas.append(replica)
    sync = StreamingSync(local, replicas, Schedule(4, len(replicas)), server, "fp32", 0.0)
    session = SimpleNamespace(
        client=server,
        transport=server,
        sync=sync,
        replicas=ReplicaLoader(server, server, local, "a"),
        progress=Progress(learner_id="a"),
        learner_id="a",
        fingerprint=[],
        tokens_per_step=1,
    )
    changed = ShardRejoins(session).try_rejoin()
    assert session.progress.rejoins == 1 and not server.lost
    return sync, changed


def values(seed: float) -> dict[int, torch.Tensor]:
    return {f: torch.full(shape, seed + f) for f, shape in enumerate(SHAPES)}


def test_a_restart_that_lost_versions_resyncs_the_fragments_behind_in_one_log_line(
    caplog,
) -> None:
    ours, theirs, trained = values(10.0), values(20.0), values(30.0)
    # Fragments 0 and 1 came back older than our replicas (versions lost); 2 lost nothing.
    server = RestartedServer({0: (3, theirs[0]), 1: (1, theirs[1]), 2: (4, ours[2])})
    held = {0: (5, ours[0]), 1: (2, ours[1]), 2: (4, ours[2])}
    local = [trained[f].clone() for f in range(3)]  # progress since the last merge
    with caplog.at_level(logging.INFO, logger="diloco.learner"):
        sync, changed = rejoined(server, held, local)
    assert changed is True
    assert [r.version for r in sync.replicas] == [3, 1, 4]
    # Behind: the local progress is dropped for the server's state; the other keeps it.
    assert torch.equal(local[0], theirs[0]) and torch.equal(sync.replicas[0].params[0], theirs[0])
    assert torch.equal(local[1], theirs[1]) and torch.equal(sync.replicas[1].params[0], theirs[1])
    assert torch.equal(local[2], trained[2])
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == [
        "learner=a resyncing to the server's state, local progress dropped: "
        "fragment 0: server at version 3 is behind our 5 (the server lost versions); "
        "fragment 1: server at version 1 is behind our 2 (the server lost versions)"
    ]


def test_a_restart_that_lost_nothing_keeps_the_local_progress_and_warns_of_nothing(
    caplog,
) -> None:
    ours, trained = values(10.0), values(30.0)
    server = RestartedServer({f: (4, ours[f]) for f in range(3)})
    local = [trained[f].clone() for f in range(3)]
    with caplog.at_level(logging.INFO, logger="diloco.learner"):
        sync, changed = rejoined(server, {f: (4, ours[f]) for f in range(3)}, local)
    assert changed is False
    assert all(torch.equal(local[f], trained[f]) for f in range(3))
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
