"""Shards in process on port 0: discovery from one address, each fragment at its owner only,
heartbeats through a shard outage, mismatched shards refused naming the shard, and
diloco-status over every shard."""

from __future__ import annotations

import socket
import time

import grpc
import pytest
import torch

from common.codec.fragment import encode_fragment
from common.generated.diloco.v1 import aggregator_pb2 as pb
from learner import status
from learner.client import AggregatorClient
from learner.shards import SEP, NotConnected, ShardedClient, ShardMapError
from server.export import merge, read_state_params
from tests.support.processes import learner_process

SHAPES = [(4, 8), (8, 8), (2, 8)]
FINGERPRINT = [
    pb.ParamSpec(name=f"blocks.{i}.w", shape=s, dtype="float32") for i, s in enumerate(SHAPES)
]


def start_shards(start_service, count: int = 2, **config) -> list:
    """`count` shards of a 3-fragment run that advertise each other's addresses."""
    shards = [
        start_service(fragments=3, shard_index=i, shard_count=count, lease_s=30.0, **config)
        for i in range(count)
    ]
    addresses = ",".join(f"127.0.0.1:{s.port}" for s in shards)
    for shard in shards:  # known only once every shard has bound its port
        shard.config.sharding.shard_addresses = addresses
    return shards


def address(service) -> str:
    return f"127.0.0.1:{service.port}"


def initialize_all(client: ShardedClient, session: str) -> None:
    """Offer every fragment's initial parameters, through the client's routing."""
    for fid in range(len(SHAPES)):
        initialize(client, session, fid)


def initialize(client: ShardedClient, session: str, fid: int) -> None:
    """Offer the fragment's initial parameters (ones), through the client's routing."""
    header = pb.PushHeader(session_id=session, fragment_id=fid, kind=pb.PUSH_KIND_INITIAL)
    header.base_version = -1
    client.push(header, encode_fragment([torch.ones(SHAPES[fid])], "fp32"))


def test_one_address_discovers_the_shards_and_routes_each_fragment(start_service) -> None:
    shards = start_shards(start_service)
    client = ShardedClient([address(shards[1])])  # any shard's address will do
    client.wait_ready(10)
    reply = client.join("l0", FINGERPRINT)
    assert client.addresses == [address(s) for s in shards]
    assert (reply.shard_count, len(reply.session_id.split(SEP))) == (2, 2)
    # Sizes 32, 64, 16 values: fragment 1 -> shard 0, fragment 0 -> shard 1, 2 -> shard 1.
    assert list(reply.fragment_owners) == [1, 0, 1]
    initialize_all(client, reply.session_id)
    assert [fid for fid, _, _ in shards[0].aggregator.owned()[1]] == [1]
    assert [fid for fid, _, _ in shards[1].aggregator.owned()[1]] == [0, 2]
    header, _ = client.pull(reply.session_id, 2, -1)
    assert header.version == 0

    # A shard asked for a fragment it does not own refuses, naming the owner.
    direct = AggregatorClient(address(shards[0]))
    own_session = reply.session_id.split(SEP)[0]
    with pytest.raises(grpc.RpcError) as refused:
        direct.pull(own_session, 0, -1)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "fragment 0 is owned by shard 1 of 2" in refused.value.details()
    direct.close()

    # A shard down: the heartbeat still renews the live one and keeps the last versions.
    beat = pb.HeartbeatRequest(session_id=reply.session_id)
    assert list(client.heartbeat(beat).fragment_versions) == [0, 0, 0]
    shards[1].stop(grace_s=0)
    beat = client.heartbeat(beat)
    assert list(beat.fragment_versions) == [0, 0, 0] and beat.live_learners == 1
    assert beat.server_epoch == reply.server_epoch  # no shard came back with a new epoch
    client.close()


def test_diloco_status_prints_every_shard(start_service, capsys) -> None:
    shards = start_shards(start_service)
    client = ShardedClient([address(s) for s in shards])
    reply = client.join("l0", FINGERPRINT)
    initialize_all(client, reply.session_id)
    delta = pb.PushHeader(session_id=reply.session_id, fragment_id=1, kind=pb.PUSH_KIND_DELTA)
    client.push(delta, encode_fragment([torch.full((8, 8), 0.01)], "fp4_e2m1"))
    client.close()

    argv = ["--server", address(shards[0]), "--insecure", "--learner-id", "ops"]
    assert status.main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"shard 0 of 2 at {address(shards[0])}: map ")
    assert out[0].endswith("mode sync rounds closed 1")
    assert out[1].startswith("  fragment 1: version 1 crc 0x")
    assert out[2].startswith("  learner l0: live, last push fragment 1 for version 1, ")
    assert out[3].startswith(f"shard 1 of 2 at {address(shards[1])}: ")
    assert out[3].endswith("rounds closed 0")
    assert out[4].startswith("  fragment 0: version 0") and out[5].startswith("  fragment 2:")
    assert out[6] == "  learner l0: live, no push since the shard started"

    shards[1].stop(grace_s=0)
    assert status.main([*argv, "--json"]) == 1  # a shard it cannot reach
    lines = capsys.readouterr().out.splitlines()
    assert '"shard_count": 2' in lines[0] and '"error": "UNAVAILABLE"' in lines[1]


def test_shards_that_disagree_fail_the_join_naming_the_shard(start_service) -> None:
    shards = start_shards(start_service)
    cases = [
        ([shards[1], shards[0]], "shard 0 at {0} is shard 1: list the shards in index order"),
        ([shards[0]] * 3, "shard 0 at {0} is one of 2 shards, but --server lists 3"),
    ]
    other = start_shards(start_service, layout="balanced")  # another map: another layout
    cases.append(([shards[0], other[1]], "shard 1 at {1} has shard map"))
    for listed, message in cases:
        client = ShardedClient([address(s) for s in listed])
        with pytest.raises(ShardMapError, match=message.format(*map(address, listed))):
            client.join("l0", FINGERPRINT)
        client.close()


def test_a_shard_that_does_not_advertise_addresses_needs_a_list(start_service) -> None:
    shard = start_service(fragments=3, shard_count=2)
    client = ShardedClient([address(shard)])
    with pytest.raises(ShardMapError, match="does not advertise the shards' addresses"):
        client.join("l0", FINGERPRINT)
    client.close()


def test_the_learner_ends_with_one_error_line_naming_the_shard(start_service, tmp_path) -> None:
    shards = start_shards(start_service)
    listed = f"{address(shards[1])},{address(shards[0])}"
    learner = learner_process(tmp_path, shards[0].port, "l0", "--server", listed, "--n-layer", "3")
    assert learner.wait(120) == 1
    lines = learner.log_text().strip().splitlines()
    assert lines[-1] == (
        f"diloco-learner: error: shard 0 at {address(shards[1])} is shard 1: list the shards "
        "in index order"
    )


def test_the_shards_state_dirs_export_as_one_model(start_service, tmp_path) -> None:
    dirs = [tmp_path / f"state-{i}" for i in range(2)]
    shards = [
        start_service(fragments=3, shard_index=i, shard_count=2, state_dir=str(d))
        for i, d in enumerate(dirs)
    ]
    client = ShardedClient([address(s) for s in shards])
    initialize_all(client, client.join("l0", FINGERPRINT).session_id)
    client.close()
    for shard in shards:
        shard.stop(grace_s=0)
    model = merge([read_state_params(str(d)) for d in dirs])
    assert list(model) == [spec.name for spec in FINGERPRINT]
    assert all(torch.equal(t, torch.ones(s)) for t, s in zip(model.values(), SHAPES, strict=True))


def test_a_restarted_shard_is_joined_again_alone_while_another_is_down(start_service) -> None:
    shards = start_shards(start_service, count=3)
    client = ShardedClient([address(s) for s in shards])
    reply = client.join("l0", FINGERPRINT)
    initialize_all(client, reply.session_id)
    assert list(reply.fragment_owners) == [1, 0, 2]
    old = reply.session_id.split(SEP)

    shards[1].stop(grace_s=0)  # down, and stays down
    port = shards[2].port
    shards[2].stop(grace_s=0)  # restarted: it knows no session any more
    start_service(listen=f"127.0.0.1:{port}", fragments=3, shard_index=2, shard_count=3)
    beat = client.heartbeat(pb.HeartbeatRequest(session_id=reply.session_id))
    assert beat.server_epoch == reply.server_epoch and client.lost_shards() == {2}

    again = client.join_shard(2, "l0", FINGERPRINT)  # shard 1 being down does not matter
    session = client.membership().session_id
    assert session.split(SEP) == [old[0], old[1], again.session_id] != old
    assert client.membership().server_epoch != reply.server_epoch and not client.lost_shards()
    # An answer about the old session is old news: the shard stays joined.
    client.heartbeat(pb.HeartbeatRequest(session_id=reply.session_id))
    assert not client.lost_shards()
    initialize(client, session, 2)
    assert client.pull(session, 2, -1)[0].version == 0
    client.close()


@pytest.mark.slow
def test_a_shard_away_at_the_first_join_is_joined_when_it_answers(start_service) -> None:
    shards = start_shards(start_service, count=3)
    addresses = [address(s) for s in shards]
    port = shards[0].port
    shards[0].stop(grace_s=0)  # away before the learner's first join
    client = ShardedClient(addresses)
    client.wait_ready(2)  # shards 1 and 2 are up: shard 0 gets what is left, then the join goes on
    reply = client.join("l0", FINGERPRINT)
    # Owners [1, 0, 2]: fragment 1 waits for shard 0; the map came from shard 1.
    assert list(reply.fragment_owners) == [1, 0, 2]
    assert client.lost_shards() == {0} and client.away() == {1}
    assert [f.version for f in reply.fragments] == [-1, -1, -1]
    session = reply.session_id
    assert session.split(SEP)[0] == "" and all(session.split(SEP)[1:])
    for fid in (0, 2):  # the live shards' fragments sync as usual
        initialize(client, session, fid)
        assert client.pull(session, fid, -1)[0].version == 0
    with pytest.raises(grpc.RpcError) as away:
        client.join_shard(0, "l0", FINGERPRINT)
    assert away.value.code() == grpc.StatusCode.UNAVAILABLE and client.away() == {1}

    start_service(listen=f"127.0.0.1:{port}", fragments=3, shard_index=0, shard_count=3)
    again = client.join_shard(0, "l0", FINGERPRINT)  # checked against shard 1's map
    assert again.map_id == reply.map_id and not client.lost_shards() and not client.away()
    session = client.membership().session_id
    assert session.split(SEP)[0] == again.session_id
    initialize(client, session, 1)
    assert client.pull(session, 1, -1)[0].version == 0
    client.close()


def test_a_shard_that_never_answers_the_handshake_costs_a_short_probe(start_service) -> None:
    shards = start_shards(start_service, count=2)
    port = shards[1].port
    shards[1].stop(grace_s=0)
    # Its port taken by a listener that never accepts: TCP connects, gRPC's handshake never
    # ends, as behind a firewall that drops packets. A join's RPC waited 20 s for it here.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", port))
        silent.listen(8)
        client = ShardedClient([address(shards[0]), f"127.0.0.1:{port}"])
        started = time.monotonic()
        client.join("l0", FINGERPRINT)
        assert client.lost_shards() == {1} and time.monotonic() - started < 10
        with pytest.raises(NotConnected):
            client.join_shard(1, "l0", FINGERPRINT)
        client.close()


def test_a_join_no_shard_answers_fails_with_the_shards_error(start_service) -> None:
    shards = start_shards(start_service, count=2)
    addresses = [address(s) for s in shards]
    for shard in shards:
        shard.stop(grace_s=0)
    client = ShardedClient(addresses)
    with pytest.raises(grpc.FutureTimeoutError):
        client.wait_ready(0.5)
    with pytest.raises(grpc.RpcError) as failed:
        client.join("l0", FINGERPRINT)
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE  # the session backs off
    client.close()
