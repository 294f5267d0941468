"""Bounds on what hostile or careless callers can hold, against a server process: reflection
off by default and behind tokens, abandoned long-polls free their worker, calls open per
learner, silent streams cut, streams per connection, calls of a revoked token ended."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from common.codec.fragment import chunks, encode_fragment
from common.generated.diloco.v1 import aggregator_pb2 as pb
from common.generated.diloco.v1 import aggregator_pb2_grpc as pb_grpc
from common.retry import wait_until
from common.rpc import LEARNER_ID_HEADER, SERVICE_NAME, create_channel
from server.rpc.auth import add_token
from tests.support.processes import metric


def list_services(channel: grpc.Channel, metadata=()) -> list[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    reply = next(stub.ServerReflectionInfo(iter([request]), metadata=metadata, timeout=10))
    return [s.name for s in reply.list_services_response.service]


def code_of(call) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


def test_reflection_is_off_by_default(start_server_process) -> None:
    server = start_server_process()
    with create_channel(f"127.0.0.1:{server.port}") as channel:
        assert code_of(lambda: list_services(channel)) == grpc.StatusCode.UNIMPLEMENTED


def test_reflection_needs_a_token_when_auth_is_on(tmp_path: Path, start_server_process) -> None:
    path = tmp_path / "tokens.txt"
    token = add_token(str(path), "a")
    server = start_server_process("--auth-token-file", str(path), "--reflection")
    with create_channel(f"127.0.0.1:{server.port}") as channel:
        assert code_of(lambda: list_services(channel)) == grpc.StatusCode.UNAUTHENTICATED
        metadata = ((LEARNER_ID_HEADER, "a"), ("authorization", f"Bearer {token}"))
        assert SERVICE_NAME in list_services(channel, metadata)


def joined_session(
    stub, learner_id: str, initialize: bool = False, metadata=None, size: int = 4
) -> str:
    """A session of `learner_id`, whose model is one tensor of `size` floats; with
    `initialize`, it also sets the global parameters (version 0)."""
    metadata = metadata or ((LEARNER_ID_HEADER, learner_id),)
    specs = [pb.ParamSpec(name="w", shape=[size], dtype="float32")]
    join = stub.Join(pb.JoinRequest(learner_id=learner_id, fingerprint=specs), metadata=metadata)
    if initialize:
        header = pb.PushHeader(
            session_id=join.session_id, kind=pb.PUSH_KIND_INITIAL, base_version=-1
        )
        payload = encode_fragment([torch.ones(size)], "fp32")
        header.payload_bytes = len(payload)
        messages = [pb.PushFragmentRequest(header=header)]
        messages += [pb.PushFragmentRequest(chunk=piece) for piece in chunks(payload)]
        stub.PushFragment(iter(messages), metadata=metadata, timeout=60)
    return join.session_id


def long_poll(stub, session: str, learner_id: str, metadata=None, timeout_s: float = 120):
    """A PullParams waiting (60 s) for a version that does not come; the call starts at once."""
    request = pb.PullParamsRequest(
        session_id=session, have_version=0, wait_for_version=1, wait_timeout_s=60
    )
    metadata = metadata or ((LEARNER_ID_HEADER, learner_id),)
    return stub.PullParams(request, metadata=metadata, timeout=timeout_s)


WAITING = "diloco_server_waiting_pulls"


@pytest.fixture
def server(start_server_process):
    """A server process that lets a learner hold 4 calls, with a worker thread to spare;
    learner a's session, which has set the parameters (version 0)."""
    flags = ("--lease-s", "60", "--max-calls-in-flight", "4", "--worker-threads", "5")
    daemon = start_server_process(*flags)
    with create_channel(f"127.0.0.1:{daemon.port}") as channel:
        stub = pb_grpc.AggregatorStub(channel)
        yield daemon, stub, joined_session(stub, "a", initialize=True)


def test_abandoned_long_polls_free_their_workers(server) -> None:
    server, stub, session = server
    polls = [long_poll(stub, session, "a") for _ in range(4)]
    wait_until(lambda: metric(server, WAITING) == 4, 20, "4 long-polls waiting")
    for poll in polls:
        poll.cancel()
    # Each poll would otherwise hold its worker thread for its whole 60 s wait.
    wait_until(lambda: metric(server, WAITING) == 0, 10, "polls ended")


def test_calls_open_per_learner_are_bounded(server) -> None:
    server, stub, session = server
    other = joined_session(stub, "b")
    polls = [long_poll(stub, session, "a") for _ in range(4)]
    wait_until(lambda: metric(server, WAITING) == 4, 20, "4 waiting")
    with pytest.raises(grpc.RpcError) as err:
        list(long_poll(stub, session, "a"))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_calls_in_flight" in err.value.details()
    # Another learner, on the same connection, is not affected.
    metadata = ((LEARNER_ID_HEADER, "b"),)
    assert stub.Heartbeat(pb.HeartbeatRequest(session_id=other), metadata=metadata, timeout=10)
    refused = "diloco_server_in_flight_limited_calls_total"
    assert metric(server, refused, method="PullParams") == 1
    for poll in polls:
        poll.cancel()


def test_health_checks_answer_while_every_worker_is_held(start_server_process) -> None:
    flags = ("--worker-threads", "2", "--lease-s", "60")
    server = start_server_process(*flags)
    with create_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.AggregatorStub(channel)
        session = joined_session(stub, "a", initialize=True)
        polls = [long_poll(stub, session, "a") for _ in range(2)]
        wait_until(lambda: metric(server, WAITING) == 2, 20, "2 workers held")
        # Bound: on the learners' pool the check would wait for a poll's 60 s.
        health = health_pb2_grpc.HealthStub(channel)
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=20).status == 1
        for poll in polls:
            poll.cancel()


def test_a_pull_whose_reader_stops_reading_is_cut(start_server_process) -> None:
    server = start_server_process("--stream-idle-timeout-s", "1")
    with create_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.AggregatorStub(channel)
        # 32 MB: far more than HTTP/2's window (which BDP probing grows) and the loopback
        # sockets' buffers take unread, so the server's send must block.
        session = joined_session(stub, "a", initialize=True, size=8_000_000)
        request = pb.PullParamsRequest(session_id=session, have_version=-1)
        pull = stub.PullParams(request, metadata=((LEARNER_ID_HEADER, "a"),), timeout=60)
        assert next(pull).header.payload_bytes > 32_000_000
        cut = "diloco_server_cut_calls_total"
        wait_until(lambda: metric(server, cut, reason="idle") == 1, 20, "cut")
        with pytest.raises(grpc.RpcError) as err:
            list(pull)  # what the transport had taken, then the status
        # A reader that resumes within END_GRACE_S of the cut gets the reason; a send still
        # stuck then is cancelled (gRPC's public API ends a call from outside with no other
        # status): server/rpc/calls.py.
        ended = (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)
        assert err.value.code() in ended


# -- deadlines for streams, streams per connection, revocation --------------------------


def silent_push(session: str, release: threading.Event) -> Iterator[pb.PushFragmentRequest]:
    """A push that sends its header and then nothing, until `release` (the test's end)."""
    header = pb.PushHeader(
        session_id=session, kind=pb.PUSH_KIND_DELTA, base_version=0, payload_bytes=8
    )
    yield pb.PushFragmentRequest(header=header)
    release.wait(60)


@pytest.fixture
def release() -> Iterator[threading.Event]:
    """Ends the tests' silent request streams on the client side, whatever the outcome."""
    event = threading.Event()
    yield event
    event.set()


def test_silent_pushes_are_cut_and_leases_hold(start_server_process, release) -> None:
    """Twice as many silent pushes as worker threads: each is cut after the idle timeout,
    and a learner heartbeating on its own connection meanwhile keeps its lease. The
    whole-stream bound is off (0), so on a loaded machine it cannot fire first."""
    flags = ("--lease-s", "5", "--worker-threads", "4", "--stream-idle-timeout-s", "1")
    flags += ("--stream-min-bytes-per-s", "0")
    server = start_server_process(*flags)
    with (
        create_channel(f"127.0.0.1:{server.port}") as channel,
        create_channel(f"127.0.0.1:{server.port}") as own,
    ):
        stub, good_stub = pb_grpc.AggregatorStub(channel), pb_grpc.AggregatorStub(own)
        session = joined_session(stub, "a", initialize=True)
        good = joined_session(good_stub, "b")
        metadata = ((LEARNER_ID_HEADER, "a"),)
        pushes = [
            stub.PushFragment.future(silent_push(session, release), metadata=metadata)
            for _ in range(8)
        ]
        beats = 0
        # Bounded: the pushes end within seconds; without the cut, never.
        while not all(p.done() for p in pushes) and beats < 120:
            heartbeat = pb.HeartbeatRequest(session_id=good)
            good_stub.Heartbeat(heartbeat, metadata=((LEARNER_ID_HEADER, "b"),), timeout=5)
            beats += 1
            release.wait(0.25)  # a learner's heartbeat period
        for push in pushes:
            assert push.exception(timeout=1).code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert "stream_idle_timeout_s" in push.exception().details()
        cut = "diloco_server_cut_calls_total"
        wait_until(lambda: metric(server, cut, reason="idle") == 8, 10, "8 cuts counted")
        good_stub.Heartbeat(heartbeat, metadata=((LEARNER_ID_HEADER, "b"),), timeout=5)


def trickled_push(session: str, release: threading.Event) -> Iterator[pb.PushFragmentRequest]:
    """A push announcing 4,000 bytes that sends one byte every 0.2 s (never idle for long),
    for at most 30 s; then nothing until `release`."""
    header = pb.PushHeader(
        session_id=session, kind=pb.PUSH_KIND_DELTA, base_version=0, payload_bytes=4000
    )
    yield pb.PushFragmentRequest(header=header)
    for _ in range(150):
        if release.wait(0.2):
            return
        yield pb.PushFragmentRequest(chunk=b"\0")
    release.wait(60)


@pytest.mark.slow
def test_a_push_that_trickles_is_cut(start_server_process, release) -> None:
    """Never idle for the idle timeout (5 s), but at 5 bytes/s: cut once its whole-stream
    bound (5 s + 4,000 bytes at 1,000 bytes/s) has passed."""
    flags = ("--stream-idle-timeout-s", "5", "--stream-min-bytes-per-s", "1000")
    server = start_server_process(*flags)
    with create_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.AggregatorStub(channel)
        session = joined_session(stub, "a", initialize=True, size=2000)  # 8,000 bytes
        metadata = ((LEARNER_ID_HEADER, "a"),)
        push = stub.PushFragment.future(trickled_push(session, release), metadata=metadata)
        error = push.exception(timeout=60)
        assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "stream_min_bytes_per_s" in error.details()
        cut = "diloco_server_cut_calls_total"
        wait_until(lambda: metric(server, cut, reason="slow") == 1, 10, "1 cut counted")


def test_streams_per_connection_are_bounded(start_server_process) -> None:
    """With 4 long-polls open on a connection of a server that allows 4 streams, a fifth call
    on it waits for one to end; another connection is not affected."""
    server = start_server_process("--max-concurrent-streams", "4")
    with (
        create_channel(f"127.0.0.1:{server.port}") as channel,
        create_channel(f"127.0.0.1:{server.port}") as other,
    ):
        stub = pb_grpc.AggregatorStub(channel)
        session = joined_session(stub, "a", initialize=True)
        polls = [long_poll(stub, session, "a") for _ in range(4)]
        wait_until(lambda: metric(server, WAITING) == 4, 20, "4 long-polls waiting")
        heartbeat = pb.HeartbeatRequest(session_id=session)
        metadata = ((LEARNER_ID_HEADER, "a"),)
        queued = stub.Heartbeat.future(heartbeat, metadata=metadata, timeout=30)
        # The other connection answers while the fifth call on the first one waits (a
        # heartbeat takes milliseconds when the connection lets it through).
        pb_grpc.AggregatorStub(other).Heartbeat(heartbeat, metadata=metadata, timeout=10)
        with pytest.raises(grpc.FutureTimeoutError):
            queued.result(timeout=3)
        polls[0].cancel()
        assert queued.result(timeout=20).server_epoch  # it ran once a stream was free
        for poll in polls[1:]:
            poll.cancel()


def test_revoking_a_token_ends_its_open_calls(
    tmp_path: Path, start_server_process, release
) -> None:
    path = tmp_path / "tokens.txt"
    tokens = {learner: add_token(str(path), learner) for learner in ("a", "b")}
    server = start_server_process("--auth-token-file", str(path))
    with create_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.AggregatorStub(channel)
        creds = {
            learner: ((LEARNER_ID_HEADER, learner), ("authorization", f"Bearer {token}"))
            for learner, token in tokens.items()
        }
        a = joined_session(stub, "a", initialize=True, metadata=creds["a"])
        b = joined_session(stub, "b", metadata=creds["b"])
        # Bounds: without the revocation the poll waits 60 s, the push 30 s (idle).
        a_poll = long_poll(stub, a, "a", metadata=creds["a"], timeout_s=20)
        b_poll = long_poll(stub, b, "b", metadata=creds["b"])
        a_push = stub.PushFragment.future(silent_push(a, release), metadata=creds["a"])
        wait_until(lambda: metric(server, WAITING) == 2, 20, "2 long-polls waiting")
        kept = [line for line in path.read_text().splitlines() if not line.startswith("a ")]
        path.write_text("\n".join(kept) + "\n")
        server.signal(signal.SIGHUP)
        with pytest.raises(grpc.RpcError) as err:
            list(a_poll)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "revoked" in err.value.details()
        assert a_push.exception(timeout=20).code() == grpc.StatusCode.UNAUTHENTICATED
        revoked = "diloco_server_cut_calls_total"
        wait_until(lambda: metric(server, revoked, reason="revoked") == 2, 10, "2 counted")
        wait_until(lambda: metric(server, WAITING) == 1, 10, "b's long-poll alone")
        assert b_poll.is_active()
        b_poll.cancel()


def test_a_revoked_push_waiting_for_push_memory_ends_unauthenticated(
    tmp_path: Path, start_server_process, release
) -> None:
    """b's silent push holds the whole push memory budget (8 bytes); a's push waits for room
    (up to 30 s) when a's token is revoked: it ends with UNAUTHENTICATED, not as a push
    refused for memory nor cancelled."""
    path = tmp_path / "tokens.txt"
    tokens = {learner: add_token(str(path), learner) for learner in ("a", "b")}
    flags = ("--auth-token-file", str(path), "--push-budget-wait-s", "30")
    server = start_server_process(*flags, "--push-memory-budget-mb", str(8 / 2**20))
    with create_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.AggregatorStub(channel)
        creds = {
            learner: ((LEARNER_ID_HEADER, learner), ("authorization", f"Bearer {token}"))
            for learner, token in tokens.items()
        }
        a = joined_session(stub, "a", initialize=True, metadata=creds["a"])
        b = joined_session(stub, "b", metadata=creds["b"])
        b_push = stub.PushFragment.future(silent_push(b, release), metadata=creds["b"])
        wait_until(
            lambda: metric(server, "diloco_server_push_memory_reserved_bytes") == 8, 20, "b holds"
        )
        a_push = stub.PushFragment.future(silent_push(a, release), metadata=creds["a"])
        time.sleep(1)  # a's push is most likely waiting for room now; the outcome is the same
        kept = [line for line in path.read_text().splitlines() if not line.startswith("a ")]
        path.write_text("\n".join(kept) + "\n")
        server.signal(signal.SIGHUP)
        err = a_push.exception(timeout=20)
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED, err
        assert "revoked" in err.details()
        assert b_push.running()
        b_push.cancel()
