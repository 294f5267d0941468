"""A sharded island's slices over gRPC (server/rounds/slices.py): held until the set is
complete, then counted once as one learner's push; an incomplete set never counts; a slice
pull is the server's rows, bit for bit, with the slice's checksum."""

from __future__ import annotations

import grpc
import pytest
import torch

from common.codec.fragment import decode_fragment, encode_fragment, params_crc32
from common.codec.slices import SliceCut
from common.generated.diloco.v1 import aggregator_pb2 as pb
from common.retry import wait_until
from learner.client import AggregatorClient

# Rows that split unevenly into 2 and 3 slices, and a tensor with fewer rows than slices.
SHAPES = [(5, 3), (2,), (9, 4)]
FINGERPRINT = [
    pb.ParamSpec(name=f"blocks.{i}.w", shape=s, dtype="float32") for i, s in enumerate(SHAPES)
]


def client_of(service) -> AggregatorClient:
    client = AggregatorClient(f"127.0.0.1:{service.port}")
    client.wait_ready(10)
    return client


def push_slices(
    client, session, delta, count, indices=None, base=0, kind=pb.PUSH_KIND_DELTA, tokens=64, steps=2
):
    """Push slices `indices` (default all) of `delta`; returns the answers."""
    answers = []
    for index in range(count) if indices is None else indices:
        cut = SliceCut(SHAPES, index, count)
        header = pb.PushHeader(
            session_id=session,
            fragment_id=0,
            base_version=base,
            kind=kind,
            tokens=tokens,
            inner_steps=steps,
            slice_index=index,
            slice_count=count,
        )
        payload = encode_fragment([cut.of(d, i) for i, d in enumerate(delta)], "fp32")
        answers.append(client.push(header, payload))
    return answers


def whole_push(client, session, delta, base=0, kind=pb.PUSH_KIND_DELTA):
    header = pb.PushHeader(
        session_id=session, fragment_id=0, base_version=base, kind=kind, tokens=64, inner_steps=2
    )
    return client.push(header, encode_fragment(delta, "fp32"))


def run(start_service, sliced: bool, count: int = 3) -> list[torch.Tensor]:
    """Two learners, one round: the island's delta as `count` slices, or whole."""
    service = start_service(min_contributors=2)
    client = client_of(service)
    island = client.join("island", FINGERPRINT, 32).session_id
    solo = client.join("solo", FINGERPRINT, 32).session_id
    torch.manual_seed(0)
    initial = [torch.randn(s) for s in SHAPES]
    deltas = [[torch.randn(s) * 0.01 for s in SHAPES] for _ in range(2)]
    if sliced:
        answers = push_slices(client, island, initial, count, base=-1, kind=pb.PUSH_KIND_INITIAL)
        assert [a.slices_pending for a in answers] == [True] * (count - 1) + [False]
    else:
        whole_push(client, island, initial, base=-1, kind=pb.PUSH_KIND_INITIAL)
    assert service.aggregator.version(0) == 0
    whole_push(client, solo, deltas[0])
    if sliced:
        answers = push_slices(client, island, deltas[1], count)
        assert [a.round_version for a in answers] == [0] * (count - 1) + [1]
    else:
        whole_push(client, island, deltas[1])
    assert service.aggregator.version(0) == 1  # both learners' pushes: the round closed
    params = [p.clone() for p in service.aggregator.params(0)]
    client.close()
    return params


def test_an_islands_slices_count_as_one_whole_push(start_service) -> None:
    sliced, whole = run(start_service, True), run(start_service, False)
    for got, want in zip(sliced, whole, strict=True):
        assert torch.equal(got, want)


def test_a_round_waits_for_the_last_slice_and_an_incomplete_set_never_counts(start_service):
    service = start_service(min_contributors=1, lease_s=30.0)
    client = client_of(service)
    island = client.join("island", FINGERPRINT, 32).session_id
    push_slices(
        client, island, [torch.ones(s) for s in SHAPES], 2, base=-1, kind=pb.PUSH_KIND_INITIAL
    )
    solo = client.join("solo", FINGERPRINT, 32).session_id
    before = [p.clone() for p in service.aggregator.params(0)]
    (answer,) = push_slices(client, island, [torch.ones(s) for s in SHAPES], 2, indices=[0])
    assert answer.slices_pending and answer.round_version == 0
    whole_push(client, solo, [torch.zeros(s) for s in SHAPES])
    assert service.aggregator.version(0) == 0  # sync mode: the island's push is still due
    assert service.servicer.held_slices.held_bytes() > 0
    client.leave(island)  # the island dies with one slice of two sent
    wait_until(lambda: service.aggregator.version(0) == 1, 10, "the round closing without it")
    for got, want in zip(service.aggregator.params(0), before, strict=True):
        assert torch.equal(got, want)  # the solo learner's zero delta alone: nothing moved
    island = client.join("island", FINGERPRINT, 32).session_id  # restarted: a new session
    push_slices(client, island, [torch.ones(s) for s in SHAPES], 2, indices=[1], base=1)
    assert service.servicer.held_slices.held_bytes() < 200  # the dead session's set dropped
    client.close()


def test_slices_whose_claims_differ_are_refused(start_service) -> None:
    service = start_service(min_contributors=1)
    client = client_of(service)
    island = client.join("island", FINGERPRINT, 32).session_id
    push_slices(
        client, island, [torch.ones(s) for s in SHAPES], 2, base=-1, kind=pb.PUSH_KIND_INITIAL
    )
    push_slices(client, island, [torch.ones(s) for s in SHAPES], 2, indices=[0], tokens=64)
    with pytest.raises(grpc.RpcError) as refused:
        push_slices(client, island, [torch.ones(s) for s in SHAPES], 2, indices=[1], tokens=60)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "the island's other slices claim 64" in refused.value.details()
    assert service.aggregator.version(0) == 0
    header = pb.PushHeader(session_id=island, fragment_id=0, slice_index=2, slice_count=2)
    header.base_version, header.kind = 0, pb.PUSH_KIND_DELTA
    payload = encode_fragment([torch.ones(s) for s in SliceCut(SHAPES, 1, 2).shapes], "fp32")
    with pytest.raises(grpc.RpcError) as missing:
        client.push(header, payload)
    assert missing.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "slice 2 of 2 does not exist" in missing.value.details()
    client.close()


@pytest.mark.parametrize("pull_codec", ["fp4_e2m1", "fp32"])
def test_a_slice_pull_is_the_servers_rows(start_service, pull_codec: str) -> None:
    service = start_service(min_contributors=1, pull_codec=pull_codec)
    client = client_of(service)
    session = client.join("solo", FINGERPRINT, 32).session_id
    whole_push(
        client, session, [torch.randn(s) for s in SHAPES], base=-1, kind=pb.PUSH_KIND_INITIAL
    )
    replicas = {}
    for index in range(3):
        cut = SliceCut(SHAPES, index, 3)
        header, payload = client.pull(session, 0, -1, 0, 0.0, (index, 3))
        assert header.kind == pb.PULL_KIND_SNAPSHOT
        replicas[index] = decode_fragment(payload, cut.shapes)
    for version in (1, 2):
        whole_push(client, session, [torch.randn(s) * 0.01 for s in SHAPES], base=version - 1)
    server = service.aggregator.params(0)
    for index, replica in replicas.items():
        cut = SliceCut(SHAPES, index, 3)
        header, payload = client.pull(session, 0, 0, 0, 0.0, (index, 3))
        assert header.version == 2
        if header.kind == pb.PULL_KIND_UPDATES:
            assert cut.apply_updates(replica, payload, 0) == 2
        else:
            replica = decode_fragment(payload, cut.shapes)
        rows = [cut.of(p, i) for i, p in enumerate(server)]
        assert all(torch.equal(a, b) for a, b in zip(replica, rows, strict=True))
        assert header.params_crc32 == params_crc32(rows)
    client.close()


def test_a_sparse_pull_codec_refuses_slices_by_name(start_service) -> None:
    service = start_service(min_contributors=1, pull_codec="sparse_2bit")
    client = client_of(service)
    session = client.join("solo", FINGERPRINT, 32).session_id
    whole_push(
        client, session, [torch.randn(s) for s in SHAPES], base=-1, kind=pb.PUSH_KIND_INITIAL
    )
    with pytest.raises(grpc.RpcError) as refused:
        client.pull(session, 0, -1, 0, 0.0, (0, 2))
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "pull_codec is fp32, fp4_e2m1 or fp4_e3m0" in refused.value.details()
    client.close()
