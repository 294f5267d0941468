"""Short, derandomized fuzz runs of the servicer (called directly) and the decoders, the
harness's own ability to see a failure, and regressions for the bugs the fuzzer found.

The long run is `python -m bench.fuzz --cases 10000` (bench/fuzz.py).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import grpc
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir

from common.codec.fragment import encode_fragment
from common.errors import InvalidArgument
from common.generated.diloco.v1 import aggregator_pb2 as pb
from tests.support.fuzz import decoders
from tests.support.fuzz.cases import (
    CaseReport,
    check_call,
    direct_caller,
    run_concurrent_case,
    run_servicer_case,
)
from tests.support.fuzz.decoders import run_decoder_case
from tests.support.fuzz.sparse_forgery import MUST_REFUSE
from tests.support.fuzz.strategies import Call
from tests.support.fuzz.world import (
    FINGERPRINT,
    MALLORY,
    Scenario,
    build_world,
    call_direct,
    pull_wait_capped,
    push_messages,
    small_delta,
    state_digest,
    state_is_finite,
)

# Hypothesis caches (constants, unicode tables) go to a temporary directory, not the repository.
set_hypothesis_home_dir(Path(tempfile.gettempdir()) / "diloco-hypothesis")
CI = settings(
    derandomize=True,  # the same examples on every run: CI never flakes on a new draw
    database=None,  # nothing written into the repository
    deadline=None,  # per-call time is bounded by the harness (CALL_TIMEOUT_S) instead
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@settings(CI, max_examples=120)
@given(st.data())
def test_servicer_survives_hostile_calls(data: st.DataObject) -> None:
    with pull_wait_capped():
        report = run_servicer_case(data.draw)
    assert not report.violations, "\n".join(report.violations)


@settings(CI, max_examples=200)
@given(st.data())
def test_decoders_refuse_hostile_bytes_cleanly(data: st.DataObject) -> None:
    report = run_decoder_case(data.draw)
    assert not report.violations, "\n".join(report.violations)


@settings(CI, max_examples=15)
@given(st.data())
def test_servicer_survives_concurrent_hostile_calls(data: st.DataObject) -> None:
    with pull_wait_capped():
        report = run_concurrent_case(data.draw)
    assert not report.violations, "\n".join(report.violations)


# -- the harness can fail ------------------------------------------------------------------


def test_digest_sees_a_single_bit_and_ignores_nothing_else() -> None:
    world = build_world(Scenario(mode="quorum", fragments=2))
    before = state_digest(world.aggregator)
    assert state_digest(world.aggregator) == before
    params = world.aggregator._params.fragments[1].params
    params[0].view(-1).view(torch.int32)[3] ^= 1  # one bit of one parameter
    assert state_digest(world.aggregator) != before


def test_harness_reports_a_servicer_that_changes_state_before_refusing(monkeypatch) -> None:
    """A bug of the kind hunted (touch the parameters, then refuse) must be caught."""
    world = build_world(Scenario(mode="quorum"))
    payload = encode_fragment(small_delta(world.shapes[0], seed=1), "fp32")
    call = Call("PushFragment", push_messages(world.sessions[MALLORY], 0, 4, payload), None, "t")

    def corrupting_push(self, session_id, fragment_id, *args, **kwargs):
        self._params.fragments[fragment_id].params[0].view(-1)[0] += 1.0
        raise InvalidArgument("refused after touching the state")

    monkeypatch.setattr("server.aggregator.Aggregator.push", corrupting_push)
    report = CaseReport()
    check_call(world, call, direct_caller, exact=True, report=report)
    assert [v.split(":")[0] for v in report.violations] == ["wrong_status", "state_change"]
    assert "params" in report.violations[1]


def test_harness_reports_a_crash_and_a_hang(monkeypatch) -> None:
    world = build_world(Scenario())
    request = pb.HeartbeatRequest(session_id=world.sessions[MALLORY])

    def boom(*args, **kwargs):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(world.aggregator, "heartbeat", boom)
    outcome = call_direct(world.servicer, "Heartbeat", request, timeout_s=5)
    assert "ZeroDivisionError" in outcome.crash and outcome.code is None

    monkeypatch.setattr(world.aggregator, "heartbeat", lambda *args, **kwargs: time.sleep(2))
    outcome = call_direct(world.servicer, "Heartbeat", request, timeout_s=0.2)
    assert outcome.hang


@settings(CI, max_examples=40)
@given(st.data())
def test_harness_reports_a_decoder_that_takes_forged_sparse_tensors(data: st.DataObject) -> None:
    """Decoders that take any sparse tensor must be caught on every forgery that the sparse
    checks have to refuse, and only on those."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(decoders, "decode", lambda msg, shape: torch.zeros(shape))
        patch.setattr(decoders, "decode_fragment", lambda data, shapes: [torch.zeros(shapes[0])])
        patch.setattr(decoders, "apply_updates", lambda replica, data, have: have + 1)
        report = decoders._forged_sparse_case(data.draw, CaseReport())
    forgery = report.labels[0].split(":")[0].removeprefix("sparse_")
    accepted = [v for v in report.violations if v.startswith("wrong_status")]
    assert len(accepted) == (forgery in MUST_REFUSE), (forgery, report.violations)


def test_small_delta_is_reproducible() -> None:
    shapes = [(3, 4), (5,)]
    a, b = small_delta(shapes, seed=3), small_delta(shapes, seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


# -- regressions: bugs the fuzzer found ------------------------------------------------------


def test_pull_leaves_the_learners_reported_progress_alone() -> None:
    """PullParams renewed the lease through heartbeat(), which also overwrote the progress the
    learner had reported (step, tokens, loss) with zeros and NaN, even for a refused pull."""
    world = build_world(Scenario())
    session = world.sessions[MALLORY]
    heartbeat = pb.HeartbeatRequest(session_id=session, step=42, tokens=4200, loss=1.5)
    assert call_direct(world.servicer, "Heartbeat", heartbeat).code is None
    before = state_digest(world.aggregator)
    for fragment_id, code in ((99, grpc.StatusCode.NOT_FOUND), (0, None)):
        request = pb.PullParamsRequest(session_id=session, fragment_id=fragment_id, have_version=-1)
        assert call_direct(world.servicer, "PullParams", request).code == code
        assert state_digest(world.aggregator) == before


@pytest.mark.parametrize("mode", ["quorum", "async"])
def test_push_whose_claimed_weight_would_overflow_the_round_is_refused(mode: str) -> None:
    """tokens²/inner_steps can reach 8.5e37: times a pseudo-gradient of 1e10 the float32 round
    sum became infinite, the outer step crashed (UNKNOWN), and every later round of the
    fragment with it (momentum already infinite)."""
    world = build_world(Scenario(mode=mode, warm=False))
    large = [t * 1e10 for t in small_delta(world.shapes[0], seed=1)]
    payload = encode_fragment(large, "fp32")
    messages = push_messages(world.sessions[MALLORY], 0, 0, payload, tokens=2**63 - 1)
    before = state_digest(world.aggregator)
    outcome = call_direct(world.servicer, "PushFragment", messages, timeout_s=10)
    assert not outcome.crash and outcome.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "overflow" in outcome.details
    assert state_digest(world.aggregator) == before
    # The same values with a plausible weight are fine, and so is the state afterwards.
    messages = push_messages(world.sessions[MALLORY], 0, 0, payload, tokens=10**6, inner_steps=100)
    assert call_direct(world.servicer, "PushFragment", messages, timeout_s=10).code is None
    assert state_is_finite(world.aggregator)


@pytest.mark.parametrize(
    "schedule_step, step_time_s, code",
    [
        (2**63 - 1, 1.0, grpc.StatusCode.INVALID_ARGUMENT),
        (3, 5e-324, grpc.StatusCode.INVALID_ARGUMENT),
        (2**20, 1e-6, None),  # the far edges of what is taken
    ],
)
def test_join_survives_absurd_schedule_reports(
    schedule_step: int, step_time_s: float, code: grpc.StatusCode | None
) -> None:
    """One learner's heartbeat (schedule step near 2^63, or a subnormal step time) made every
    later Join crash: the estimate overflowed int64 or was int(inf). Such reports are now
    refused, and the most extreme ones taken leave Join working."""
    world = build_world(Scenario(mode="quorum"))
    heartbeat = pb.HeartbeatRequest(
        session_id=world.sessions[MALLORY], schedule_step=schedule_step, step_time_s=step_time_s
    )
    assert call_direct(world.servicer, "Heartbeat", heartbeat).code == code
    world.advance(2.0)
    request = pb.JoinRequest(learner_id="eve", fingerprint=FINGERPRINT)
    joined = call_direct(world.servicer, "Join", request, timeout_s=10)
    assert not joined.crash and joined.code is None, joined
    assert 0 <= joined.response.schedule_step <= 2**53


def test_long_run_saves_its_tally_after_every_batch(monkeypatch) -> None:
    """bench/fuzz.py keeps what a run has checked after each batch, so one stopped early
    (or a lost worker) still has its figures."""
    from bench import fuzz

    monkeypatch.setattr(fuzz, "BATCH", 4)
    saved: list[int] = []
    case = lambda draw: CaseReport(labels=[str(draw(st.integers(0, 2**40)))])  # noqa: E731
    tally = fuzz.run(10, case, 0, "t", lambda t, _: saved.append(t.cases))
    assert tally.cases == 10 and saved == [4, 8, 10]
