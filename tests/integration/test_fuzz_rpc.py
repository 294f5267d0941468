"""The fuzz cases through a real gRPC server on 127.0.0.1 port 0, with and without per-learner
tokens: the same properties as tests/unit/test_fuzz.py, with every message serialized, streamed
and answered by the real transport (an escaped exception would reach the client as UNKNOWN).
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir

from common.generated.diloco.v1 import aggregator_pb2 as pb
from tests.support.fuzz.cases import run_servicer_case
from tests.support.fuzz.grpc_caller import GrpcCaller
from tests.support.fuzz.strategies import mutated_push
from tests.support.fuzz.world import (
    FINGERPRINT,
    GOOD,
    MALLORY,
    Scenario,
    build_world,
    pull_wait_capped,
    state_digest,
)

set_hypothesis_home_dir(Path(tempfile.gettempdir()) / "diloco-hypothesis")  # not the repo
CI = settings(
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.fixture(scope="module")
def plain() -> Iterator[GrpcCaller]:
    with GrpcCaller() as caller:
        yield caller


@pytest.fixture(scope="module")
def authenticated() -> Iterator[GrpcCaller]:
    with tempfile.TemporaryDirectory() as tmp, GrpcCaller(token_dir=tmp) as caller:
        yield caller


@settings(CI, max_examples=60)
@given(data=st.data())
def test_hostile_calls_over_grpc(plain: GrpcCaller, data: st.DataObject) -> None:
    with pull_wait_capped():
        report = run_servicer_case(data.draw, plain)
    assert not report.violations, "\n".join(report.violations)


@settings(CI, max_examples=30)
@given(data=st.data())
def test_hostile_calls_with_tokens(authenticated: GrpcCaller, data: st.DataObject) -> None:
    with pull_wait_capped():
        report = run_servicer_case(data.draw, authenticated)
    assert not report.violations, "\n".join(report.violations)


@settings(CI, max_examples=20)
@given(data=st.data())
def test_acting_for_another_learner_is_denied(authenticated: GrpcCaller, data: st.DataObject):
    """Mallory's token on the good learner's session: PERMISSION_DENIED for any push that
    starts with a header, and for every other RPC; nothing changes."""
    world = build_world(Scenario())
    good = world.sessions[GOOD]
    messages = [
        pb.PushFragmentRequest.FromString(m.SerializeToString())
        for m in data.draw(mutated_push(world)).request
    ]
    for message in messages:
        if message.HasField("header"):
            message.header.session_id = good
    before = state_digest(world.aggregator)
    outcome = authenticated(world, "PushFragment", messages, as_learner=MALLORY)
    headed = bool(messages) and messages[0].HasField("header")
    denied = grpc.StatusCode.PERMISSION_DENIED
    assert outcome.code == (denied if headed else grpc.StatusCode.INVALID_ARGUMENT), outcome
    others = [
        ("Heartbeat", pb.HeartbeatRequest(session_id=good, step=1)),
        ("PullParams", pb.PullParamsRequest(session_id=good, have_version=-1)),
        ("Leave", pb.LeaveRequest(session_id=good)),
        ("Join", pb.JoinRequest(learner_id=GOOD, fingerprint=FINGERPRINT)),
    ]
    for rpc, request in others:
        assert authenticated(world, rpc, request, as_learner=MALLORY).code == denied, rpc
    assert state_digest(world.aggregator) == before
