"""Per-learner tokens: no RPC but health without one, no acting as another learner, revocation."""

from __future__ import annotations

import signal
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.generated.diloco.v1 import aggregator_pb2 as pb
from common.generated.diloco.v1 import aggregator_pb2_grpc as pb_grpc
from common.retry import wait_until
from common.rpc import LEARNER_ID_HEADER, create_channel
from server.rpc.auth import add_token
from tests.support.processes import learner_log, server_process

SPECS = [pb.ParamSpec(name="w", shape=[4], dtype="float32")]


def creds(learner_id: str, token: str) -> tuple[tuple[str, str], ...]:
    return ((LEARNER_ID_HEADER, learner_id), ("authorization", f"Bearer {token}"))


@pytest.fixture
def tokens(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    path = tmp_path / "tokens.txt"
    return path, {lid: add_token(str(path), lid) for lid in ("a", "b")}


def calls(stub, session: str = "") -> dict:
    """One call of every Aggregator RPC, each taking the metadata to send."""
    header = pb.PushHeader(session_id=session, fragment_id=0, base_version=0)
    return {
        "Join": lambda md: stub.Join(
            pb.JoinRequest(learner_id="a", fingerprint=SPECS), metadata=md
        ),
        "PushFragment": lambda md: stub.PushFragment(
            iter([pb.PushFragmentRequest(header=header)]), metadata=md
        ),
        "PullParams": lambda md: list(
            stub.PullParams(pb.PullParamsRequest(session_id=session), metadata=md)
        ),
        "Heartbeat": lambda md: stub.Heartbeat(
            pb.HeartbeatRequest(session_id=session), metadata=md
        ),
        "Leave": lambda md: stub.Leave(pb.LeaveRequest(session_id=session), metadata=md),
    }


def code_of(call, metadata) -> grpc.StatusCode:
    try:
        call(metadata)
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


def test_no_rpc_but_health_without_a_valid_token(start_service, tokens) -> None:
    path, issued = tokens
    assert issued["a"] not in path.read_text()  # only salted hashes are stored
    service = start_service(auth_token_file=str(path))
    with create_channel(f"127.0.0.1:{service.port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        assert health.Check(health_pb2.HealthCheckRequest()).status == 1  # SERVING
        stub = pb_grpc.AggregatorStub(channel)
        session = stub.Join(
            pb.JoinRequest(learner_id="a", fingerprint=SPECS), metadata=creds("a", issued["a"])
        ).session_id
        for name, call in calls(stub, session).items():
            for metadata in ((), creds("a", "forged"), creds("b", issued["a"])):
                assert code_of(call, metadata) == grpc.StatusCode.UNAUTHENTICATED, name


def test_a_learner_cannot_act_as_another(start_service, tokens) -> None:
    path, issued = tokens
    service = start_service(auth_token_file=str(path))
    with create_channel(f"127.0.0.1:{service.port}") as channel:
        stub = pb_grpc.AggregatorStub(channel)
        a_session = stub.Join(
            pb.JoinRequest(learner_id="a", fingerprint=SPECS), metadata=creds("a", issued["a"])
        ).session_id
        as_b = creds("b", issued["b"])
        join_as_a = stub.Join  # b's token, a's id in the request
        with pytest.raises(grpc.RpcError) as err:
            join_as_a(pb.JoinRequest(learner_id="a", fingerprint=SPECS), metadata=as_b)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        for name, call in calls(stub, a_session).items():
            if name != "Join":
                assert code_of(call, as_b) == grpc.StatusCode.PERMISSION_DENIED, name
        assert service.aggregator.live_learners() == ["a"]  # b's attempts changed nothing


def test_sighup_reload_revokes_a_token(tmp_path: Path, tokens) -> None:
    path, issued = tokens
    server = server_process(tmp_path, "server", "--auth-token-file", str(path))
    try:
        with create_channel(f"127.0.0.1:{server.port}") as channel:
            stub = pb_grpc.AggregatorStub(channel)
            request = pb.JoinRequest(learner_id="a", fingerprint=SPECS)
            stub.Join(request, metadata=creds("a", issued["a"]))
            kept = [line for line in path.read_text().splitlines() if not line.startswith("a ")]
            path.write_text("\n".join(kept) + "\n")
            server.signal(signal.SIGHUP)
            join_a = lambda md: stub.Join(request, metadata=md)  # noqa: E731
            wait_until(
                lambda: code_of(join_a, creds("a", issued["a"])) == grpc.StatusCode.UNAUTHENTICATED,
                timeout_s=60,  # a bound: the signal is handled within moments, even loaded
                what="a's token refused after the reload",
            )
            stub.Join(
                pb.JoinRequest(learner_id="b", fingerprint=SPECS), metadata=creds("b", issued["b"])
            )
    finally:
        server.stop()


def test_a_learner_process_trains_with_its_token(
    start_service, start_learner, tokens, tmp_path: Path
) -> None:
    path, issued = tokens
    token_file = tmp_path / "a.token"
    token_file.write_text(issued["a"] + "\n")
    service = start_service(auth_token_file=str(path))
    learner = start_learner(
        service.port, "a", "--auth-token-file", str(token_file), "--max-outer-steps", "2"
    )
    assert learner.wait(timeout=120) == 0, learner_log(tmp_path, "a")
    assert service.aggregator.version(0) >= 2
