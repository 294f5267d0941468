"""Push memory against a real server process: half-sent pushes hold at most the push memory
budget, whatever their number, what they reserved is returned when they are cancelled, and a
push whose add is deferred holds its buffer until its round adds it."""

from __future__ import annotations

import threading

import grpc
import torch

from common.codec.fragment import CHUNK_BYTES, chunks, encode_fragment
from common.generated.diloco.v1 import aggregator_pb2 as pb
from common.generated.diloco.v1 import aggregator_pb2_grpc as pb_grpc
from common.retry import retry_after_s, wait_until
from common.rpc import LEARNER_ID_HEADER, create_channel
from server.rpc.receive import auto_budget_bytes
from tests.support.processes import metric

VALUES = 2 << 20  # an 8 MiB fp32 fragment
SPECS = [pb.ParamSpec(name="w", shape=[VALUES], dtype="float32")]
METADATA = ((LEARNER_ID_HEADER, "hostile"),)
STREAMS = 30
SENT_CHUNKS = 6  # of the 8 an fp32 push of the fragment takes
BUDGET_MB = 24
RESERVED = "diloco_server_push_memory_reserved_bytes"
REFUSED = "diloco_server_push_memory_refused_calls_total"
BUDGET = "diloco_server_push_memory_budget_bytes"


def half_sent(session: str, payload_bytes: int, hold: threading.Event):
    """A push announcing `payload_bytes` that sends SENT_CHUNKS chunks, then waits."""
    header = pb.PushHeader(
        session_id=session, base_version=0, payload_bytes=payload_bytes, kind=pb.PUSH_KIND_DELTA
    )
    yield pb.PushFragmentRequest(header=header)
    for _ in range(SENT_CHUNKS):
        yield pb.PushFragmentRequest(chunk=bytes(CHUNK_BYTES))
    hold.wait(120)


def push_whole(stub, session: str, payload: bytes, initial: bool = False):
    """One whole push of `payload`: the fragment's initial values, or a delta on version 0."""
    header = pb.PushHeader(
        session_id=session, payload_bytes=len(payload), tokens=1, inner_steps=1,
        kind=pb.PUSH_KIND_INITIAL if initial else pb.PUSH_KIND_DELTA,
        base_version=-1 if initial else 0,
    )  # fmt: skip
    messages = [pb.PushFragmentRequest(header=header)]
    messages += [pb.PushFragmentRequest(chunk=c) for c in chunks(payload)]
    return stub.PushFragment(iter(messages), metadata=METADATA, timeout=60)


def test_initial_values_larger_than_the_budget_are_received_alone(start_server_process) -> None:
    """An 8 MiB fragment under a 2 MiB budget: its initial values (fp32, once) are accepted,
    received alone; an fp32 delta of it is refused, naming the setting, with no retry hint."""
    server = start_server_process("--mode", "quorum", "--push-memory-budget-mb", "2")
    with create_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.AggregatorStub(channel)
        join = stub.Join(pb.JoinRequest(learner_id="big", fingerprint=SPECS), metadata=METADATA)
        initial = encode_fragment([torch.zeros(VALUES)], "fp32")
        assert push_whole(stub, join.session_id, initial, initial=True).accepted
        payload = encode_fragment([torch.full((VALUES,), 1e-3)], "fp32")
        try:
            push_whole(stub, join.session_id, payload)
            raise AssertionError("an fp32 delta larger than the budget was let in")
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
            assert "push_memory_budget_mb" in err.details()
            assert retry_after_s(err) is None  # it would never fit: not worth a retry
        assert metric(server, RESERVED) == 0  # the initial values' buffer was freed
        small = encode_fragment([torch.full((VALUES,), 1e-3)], "fp4_e2m1")
        assert push_whole(stub, join.session_id, small).accepted


def test_the_default_budget_is_sized_to_the_owned_fragments(start_server_process) -> None:
    """Without --push-memory-budget-mb the budget is chosen once the model is known: 0 before,
    the floor of 64 MiB for this 8 MiB fragment after its first push."""
    server = start_server_process("--mode", "quorum")
    assert metric(server, BUDGET) == 0
    with create_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.AggregatorStub(channel)
        join = stub.Join(pb.JoinRequest(learner_id="auto", fingerprint=SPECS), metadata=METADATA)
        initial = encode_fragment([torch.zeros(VALUES)], "fp32")
        assert push_whole(stub, join.session_id, initial, initial=True).accepted
    assert metric(server, BUDGET) == auto_budget_bytes([[(VALUES,)]]) == 64 * 2**20


def test_half_sent_pushes_hold_at_most_the_budget(start_server_process) -> None:
    server = start_server_process(
        "--mode", "quorum", "--lease-s", "120", "--max-calls-in-flight", "0",
        "--push-memory-budget-mb", str(BUDGET_MB),
    )  # fmt: skip
    hold = threading.Event()
    calls = []
    try:
        with create_channel(f"127.0.0.1:{server.port}") as channel:
            stub = pb_grpc.AggregatorStub(channel)
            join = stub.Join(
                pb.JoinRequest(learner_id="hostile", fingerprint=SPECS), metadata=METADATA
            )
            initial = encode_fragment([torch.zeros(VALUES)], "fp32")
            push_whole(stub, join.session_id, initial, initial=True)

            for _ in range(STREAMS):
                requests = half_sent(join.session_id, len(initial), hold)
                calls.append(stub.PushFragment.future(requests, metadata=METADATA, timeout=120))
            # Without the budget every stream holds a buffer: STREAMS x 8 MiB = 240 MiB.
            held = BUDGET_MB * 2**20 // len(initial)  # pushes the budget has room for

            def settled() -> bool:
                """The pushes beyond the budget's room have been refused; the buffers held
                meanwhile never exceed the budget."""
                reserved = metric(server, RESERVED)
                assert reserved <= BUDGET_MB * 2**20, f"{reserved / 2**20:.0f} MiB reserved"
                return sum(call.done() for call in calls) >= STREAMS - held

            # Bound, not a rate: the refusals come as the server's threads get to the streams.
            wait_until(settled, 120, "pushes beyond the budget refused", interval_s=0.1)
            assert metric(server, RESERVED) == held * len(initial)
            for call in calls:
                if call.done():
                    assert call.exception().code() == grpc.StatusCode.RESOURCE_EXHAUSTED

            for call in calls:
                call.cancel()
            hold.set()
            assert metric(server, REFUSED) == STREAMS - held
            # The reservations are returned (a cancelled push's buffer is freed, not kept) and
            # a whole push fits again. Bound: ending 30 streams took over 30 s at a load
            # average of 25 on 2 cores.
            wait_until(lambda: metric(server, RESERVED) == 0, 120, "reservations returned")
            payload = encode_fragment([torch.full((VALUES,), 1e-3)], "fp32")
            assert push_whole(stub, join.session_id, payload).accepted
    finally:
        hold.set()


def test_a_deferred_add_holds_its_buffer_until_the_round_adds_it(start_server_process) -> None:
    """In a sync round of three learners the second fp4 push is accepted and its add deferred
    (its buffer counted as deferred), the third closes the round, which adds both."""
    server = start_server_process("--mode", "sync")
    deferred = "diloco_server_push_memory_deferred_bytes"
    with create_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.AggregatorStub(channel)
        sessions = [
            stub.Join(
                pb.JoinRequest(learner_id=f"l{i}", fingerprint=SPECS),
                metadata=((LEARNER_ID_HEADER, f"l{i}"),),
            ).session_id
            for i in range(3)
        ]
        initial = encode_fragment([torch.zeros(VALUES)], "fp32")
        assert push_whole(stub, sessions[0], initial, initial=True).accepted
        payloads = [encode_fragment([torch.full((VALUES,), 1e-3 * (i + 1))], "fp4_e2m1")
                    for i in range(3)]  # fmt: skip
        for i in range(2):
            assert push_whole(stub, sessions[i], payloads[i]).round_version == 1
        assert metric(server, deferred) == len(payloads[1])
        assert stub.Heartbeat(pb.HeartbeatRequest(session_id=sessions[2])).fragment_versions == [0]
        assert push_whole(stub, sessions[2], payloads[2]).accepted
        assert metric(server, deferred) == 0
        assert stub.Heartbeat(pb.HeartbeatRequest(session_id=sessions[2])).fragment_versions == [1]
