"""The server's guards against one bad learner, against a server process: a push the norm
guard refuses never stalls a round nor locks its learner out, a heartbeat's report cannot
poison the step time and schedule every learner paces and aligns to, token claims are held to
the learner's declaration, and one learner's inflated weight and 10x push are outvoted."""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator

import grpc
import pytest
import torch
from torch import nn

from common.codec.fragment import decode_fragment, encode_fragment
from common.generated.diloco.v1 import aggregator_pb2 as pb
from common.retry import Stopped
from deploy.launcher import Daemon
from learner.api import DilocoSync
from learner.client import AggregatorClient
from tests.support.processes import metric

SHAPES = [(4, 8), (8,)]
FINGERPRINT = [pb.ParamSpec(name=f"p{i}", shape=s, dtype="float32") for i, s in enumerate(SHAPES)]


def push(client: AggregatorClient, session: str, base: int, value: float) -> int:
    """Push a pseudo-gradient of `value` everywhere against `base`; returns its round version."""
    header = pb.PushHeader(session_id=session, kind=pb.PUSH_KIND_DELTA, base_version=base)
    delta = [torch.full(s, value) for s in SHAPES]
    return client.push(header, encode_fragment(delta, "fp32")).round_version


def version(server: Daemon) -> float:
    """Fragment 0's version as the server process exports it (NaN when it does not answer)."""
    return metric(server, "diloco_server_fragment_version", fragment="0")


@pytest.fixture
def started(start_server_process) -> Iterator:
    """Start server processes by their flags, each with a client; all stopped after the test."""
    clients = []

    def start(*flags: str) -> tuple[Daemon, AggregatorClient]:
        daemon = start_server_process(*flags)
        clients.append(AggregatorClient(f"127.0.0.1:{daemon.port}"))
        clients[-1].wait_ready(20)
        return daemon, clients[-1]

    yield start
    for client in clients:
        client.close()


@pytest.fixture
def guarded(started):
    """A sync server whose norm guard has seen four normal rounds of learners a and b."""
    server, client = started("--lease-s", "30", "--max-norm-ratio", "5")
    a, b = (client.join(name, FINGERPRINT).session_id for name in "ab")
    header = pb.PushHeader(session_id=a, kind=pb.PUSH_KIND_INITIAL, base_version=-1)
    client.push(header, encode_fragment([torch.zeros(s) for s in SHAPES], "fp32"))
    for base in range(4):
        push(client, a, base, 0.01)
        push(client, b, base, 0.01)
    assert version(server) == 4
    yield server, client, a, b


def refused(client: AggregatorClient, session: str, base: int) -> None:
    with pytest.raises(grpc.RpcError) as err:
        push(client, session, base, 100.0)  # 10,000x the recent norms
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "push refused" in err.value.details()


def params(client: AggregatorClient, session: str) -> list[torch.Tensor]:
    header, payload = client.pull(session, 0, -1)
    return decode_fragment(payload, SHAPES)


def test_a_round_of_refused_pushes_ends_without_a_step_and_locks_no_one_out(guarded) -> None:
    server, client, a, b = guarded
    refused(client, b, 4)
    assert push(client, a, 4, 0.01) == 5  # the round closes without waiting for b
    assert version(server) == 5
    client.leave(b)
    before = params(client, a)
    refused(client, a, 5)  # the only live learner: its round ends with no step
    assert version(server) == 5 and all(
        torch.equal(x, y) for x, y in zip(params(client, a), before, strict=True)
    )
    assert push(client, a, 5, 0.01) == 6  # its next push counts
    assert version(server) == 6


def test_a_rejoin_clears_a_refused_learners_marks(guarded) -> None:
    server, client, a, b = guarded
    refused(client, b, 4)
    client.leave(b)
    b = client.join("b", FINGERPRINT).session_id
    assert push(client, b, 4, 0.01) == 5  # taken, not ALREADY_EXISTS
    assert version(server) == 4  # the round still waits for a
    push(client, a, 4, 0.01)
    assert version(server) == 5


H, PERTURB_AT_OUTER_STEP, OUTER_STEPS = 2, 4, 8


def train_with_one_exploding_round(port: int, stop: threading.Event, results: dict) -> None:
    """A single learner whose fifth pseudo-gradient is 100 everywhere (the norm guard's
    warm-up is four pushes): that push is refused, and the run must go on."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.Generator().manual_seed(1)
    settings = {"server": f"127.0.0.1:{port}", "learner_id": "solo", "insecure": True}
    settings |= {"sync_every_steps": H, "overlap_steps": 0, "merge_alpha": 0.0}
    try:
        with DilocoSync(model, stop=stop, **settings) as sync:
            while sync.outer_steps < OUTER_STEPS:
                x = torch.randn(16, 4, generator=data)
                loss = nn.functional.mse_loss(model(x).squeeze(1), x.sum(1))
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                if sync.schedule_step == PERTURB_AT_OUTER_STEP * H:
                    with torch.no_grad():
                        for p in model.parameters():
                            p.add_(100.0)
                sync.step(loss=loss.item())
            results["versions"] = sync.versions
        results["progress"] = sync.progress
    except Stopped:
        results["stopped"] = True


def test_a_single_learner_recovers_from_a_refused_push(started) -> None:
    server, _ = started("--lease-s", "10", "--max-norm-ratio", "5")
    stop, results = threading.Event(), {}
    thread = threading.Thread(
        target=train_with_one_exploding_round, args=(server.port, stop, results)
    )
    thread.start()
    thread.join(timeout=60)
    stop.set()  # a learner stuck at a merge gives up, and the test fails below
    thread.join(timeout=30)
    assert "progress" in results, results
    # Eight outer steps, one refused: seven versions, the last ones after the refusal.
    assert version(server) == OUTER_STEPS - 1
    assert results["versions"] == [OUTER_STEPS - 1]
    assert results["progress"].stale_pushes == 1


def heartbeat(client: AggregatorClient, session: str, step_time_s: float, schedule_step: int):
    request = pb.HeartbeatRequest(
        session_id=session, step_time_s=step_time_s, schedule_step=schedule_step
    )
    return client.heartbeat(request)


POISONS = [
    (math.inf, 0, "step_time_s"),
    (math.nan, 0, "step_time_s"),
    (-1.0, 0, "step_time_s"),
    (1e9, 0, "step_time_s"),
    (0.0, 2**62, "schedule_step"),
    (0.0, -5, "schedule_step"),
    (0.0, 110 + 2**21, "schedule_step"),  # far ahead of the others
]


def test_poisoned_heartbeats_are_refused_and_the_median_holds(started) -> None:
    _, client = started("--lease-s", "30", "--mode", "quorum")
    a, b, c = (client.join(name, FINGERPRINT).session_id for name in "abc")
    heartbeat(client, a, 0.1, 100)
    # c's report is in bounds but huge: against a's alone it counts as 10x a's at most.
    heartbeat(client, c, 3000.0, 101)
    assert heartbeat(client, a, 0.0, 0).median_step_time_s <= 1.0
    heartbeat(client, b, 0.12, 102)
    assert heartbeat(client, a, 0.0, 0).median_step_time_s == pytest.approx(0.12)

    for step_time_s, schedule_step, field in POISONS:
        with pytest.raises(grpc.RpcError) as err:
            heartbeat(client, c, step_time_s, schedule_step)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith(f"{field} "), (step_time_s, schedule_step)
        reply = heartbeat(client, a, 0.0, 0)
        assert reply.median_step_time_s == pytest.approx(0.12)
        assert 100 <= reply.schedule_step < 10_000


def test_a_learner_declares_its_tokens_per_step_and_larger_claims_are_refused(started) -> None:
    server, client = started("--lease-s", "30", "--mode", "quorum")
    settings = {"server": f"127.0.0.1:{server.port}", "learner_id": "honest", "insecure": True}
    with DilocoSync(nn.Linear(4, 1), tokens_per_step=32, **settings) as sync:
        session = sync.session.membership.session_id  # the session DilocoSync joined with
        payload = encode_fragment([torch.zeros(1, 4), torch.zeros(1)], "fp32")

        def claim(tokens: int) -> int:
            header = pb.PushHeader(
                session_id=session, kind=pb.PUSH_KIND_DELTA, tokens=tokens, inner_steps=2
            )
            return client.push(header, payload).round_version

        with pytest.raises(grpc.RpcError) as err:
            claim(71)  # 2 steps x 32 tokens x 1.1 = 70.4
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "more than 1.1 x the 32 tokens per step declared at Join" in err.value.details()
        assert version(server) == 0
        assert claim(64) == 1  # the true claim is taken: the learner was not locked out


@pytest.mark.parametrize("defended", [True, False])
def test_an_inflated_claim_and_a_10x_push_are_outvoted(started, defended: bool) -> None:
    """Two honest learners push +0.01 everywhere; the third declares and claims 100 times
    their tokens and pushes -0.1 (10x, inside the norm guard's 20x). With the weight cap and
    the trimmed mean the step goes the honest way; with the plain token-weighted mean the
    third learner alone sets it."""
    defense = ("--max-weight-ratio", "4", "--robust-merge", "trimmed-mean")
    flags = defense if defended else ("--max-weight-ratio", "0", "--robust-merge", "none")
    server, client = started(
        "--mode", "quorum", "--min-contributors", "3", "--max-norm-ratio", "20", *flags
    )
    a, b = (client.join(name, FINGERPRINT, tokens_per_step=32).session_id for name in "ab")
    m = client.join("m", FINGERPRINT, tokens_per_step=3200).session_id
    header = pb.PushHeader(session_id=a, kind=pb.PUSH_KIND_INITIAL, base_version=-1)
    client.push(header, encode_fragment([torch.zeros(s) for s in SHAPES], "fp32"))
    for session, value, tokens in ((a, 0.01, 64), (b, 0.01, 64), (m, -0.1, 6400)):
        header = pb.PushHeader(
            session_id=session, kind=pb.PUSH_KIND_DELTA, base_version=0, tokens=tokens,
            inner_steps=2,
        )  # fmt: skip
        delta = [torch.full(s, value) for s in SHAPES]
        assert client.push(header, encode_fragment(delta, "fp32")).accepted
    assert version(server) == 1
    moved = torch.cat([p.reshape(-1) for p in params(client, a)])
    # The outer step is -lr x the merged pseudo-gradient: the honest way is down.
    assert bool((moved < 0).all()) if defended else bool((moved > 0).all()), moved
