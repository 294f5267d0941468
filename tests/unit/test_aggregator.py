"""Rules of the aggregator in sync mode: rounds, leases, validation, the outer step."""

import threading

import pytest
import torch

from common.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from server.aggregator import Aggregator
from server.config import aggregator_config
from server.rounds.outer import NesterovOuter
from server.state.params import ParamSpec
from tests.support.fakes import FINGERPRINT, SHAPES, FakeClock, tensors


def make(n_learners: int, **config) -> tuple[Aggregator, list[str], FakeClock]:
    clock = FakeClock()
    agg = Aggregator(aggregator_config(**config), clock=clock)
    sessions = [agg.join(f"l{i}", FINGERPRINT).session_id for i in range(n_learners)]
    agg.initialize(sessions[0], 0, tensors(0))
    return agg, sessions, clock


def test_outer_step_matches_torch_sgd_nesterov_on_mean_of_different_deltas() -> None:
    agg, sessions, _ = make(
        3,
        outer_lr=0.7,
        outer_momentum=0.9,
        outer_momentum_warmup_rounds=0,
        pull_codec="fp32",
        outer_state_dtype="float32",
    )
    reference = [torch.nn.Parameter(t.clone()) for t in tensors(0)]
    sgd = torch.optim.SGD(reference, lr=0.7, momentum=0.9, nesterov=True)
    for rnd in range(5):
        deltas = [tensors(100 * rnd + i) for i in range(3)]  # every learner differs
        for session, delta in zip(sessions, deltas, strict=True):
            agg.push(session, 0, rnd, delta)
        assert agg.version(0) == rnd + 1
        for i, p in enumerate(reference):
            p.grad = (deltas[0][i] + deltas[1][i] + deltas[2][i]) / 3
            # sanity: that is the mean
            torch.testing.assert_close(p.grad, torch.stack([d[i] for d in deltas]).mean(0))
        sgd.step()
        for got, want in zip(agg.params(0), reference, strict=True):
            assert torch.equal(got, want.detach()), f"round {rnd}"


def test_outer_momentum_warmup_is_torch_sgd_with_a_rising_momentum() -> None:
    """Momentum 0.5, 0.6, 0.7, 0.8, then 0.9 from the fifth step on, exactly as torch's SGD
    given that momentum at each step."""
    warm = {"outer_momentum_warmup_rounds": 4, "outer_momentum_warmup_start": 0.5}
    exact = {"pull_codec": "fp32", "outer_state_dtype": "float32"}
    agg, sessions, _ = make(2, outer_lr=0.7, outer_momentum=0.9, **exact, **warm)
    reference = [torch.nn.Parameter(t.clone()) for t in tensors(0)]
    sgd = torch.optim.SGD(reference, lr=0.7, momentum=0.9, nesterov=True)
    for rnd in range(7):
        deltas = [tensors(100 * rnd + i) for i in range(2)]
        for session, delta in zip(sessions, deltas, strict=True):
            agg.push(session, 0, rnd, delta)
        sgd.param_groups[0]["momentum"] = min(0.9, 0.5 + 0.1 * rnd)
        for i, p in enumerate(reference):
            p.grad = (deltas[0][i] + deltas[1][i]) / 2
        sgd.step()
        for got, want in zip(agg.params(0), reference, strict=True):
            assert torch.equal(got, want.detach()), f"round {rnd}"


def test_a_warm_up_never_raises_the_momentum_above_its_target() -> None:
    """A target below the warm-up's start (momentum 0 with the default warm-up on) is the
    momentum from the first step: no error, and no momentum above what was asked for."""
    from server.rounds.outer import warmed_momentum

    assert aggregator_config(outer_momentum=0.0).outer.outer_momentum_warmup_rounds > 0
    assert [warmed_momentum(0.0, 0.5, 4, taken) for taken in range(6)] == [0.0] * 6
    assert warmed_momentum(0.3, 0.5, 4, 0) == 0.3
    assert warmed_momentum(0.9, 0.5, 4, 2) == 0.7


def test_update_chunks_warms_up_like_step() -> None:
    """With 4-bit pulls the server applies `update_chunks`; it must warm up like `step`."""
    warm = NesterovOuter(0.7, 0.9, warmup_rounds=3, warmup_start=0.2)
    chunked = NesterovOuter(0.7, 0.9, warmup_rounds=3, warmup_start=0.2)
    params = tensors(0)
    for rnd in range(5):
        grads = tensors(10 + rnd)
        before = [p.clone() for p in params]
        warm.step(params, grads)
        for i, start, values in chunked.update_chunks(grads):
            moved = (params[i] - before[i]).view(-1)[start : start + values.numel()]
            torch.testing.assert_close(moved, values, rtol=0, atol=1e-6)
    assert warm.steps_taken == chunked.steps_taken == 5


def test_bfloat16_momentum_is_the_float32_step_rounded() -> None:
    """The compact state advances each chunk in float32 and stores it rounded: its steps
    stay within bfloat16's rounding of the exact ones, and its buffers take half the bytes."""
    exact = NesterovOuter(0.7, 0.9, warmup_rounds=3, warmup_start=0.2)
    compact = NesterovOuter(0.7, 0.9, warmup_rounds=3, warmup_start=0.2, state_dtype="bfloat16")
    ref, params = tensors(0), tensors(0)
    for rnd in range(6):
        grads = tensors(10 + rnd)
        exact.step(ref, grads)
        compact.step(params, grads)
        for got, want in zip(params, ref, strict=True):
            # The momentum is a few gradients' size; bfloat16 keeps 8 bits of it.
            torch.testing.assert_close(got, want, rtol=0, atol=0.7 * 0.9 * 8 * 2**-8)
    assert compact.steps_taken == 6 and compact.momentum_buffers is not None
    assert all(b.dtype == torch.bfloat16 for b in compact.momentum_buffers)
    assert any(not torch.equal(a, b) for a, b in zip(params, ref, strict=True))


def test_round_waits_for_every_live_learner() -> None:
    agg, (a, b), _ = make(2)
    assert agg.push(a, 0, 0, tensors(1)) == 1
    assert agg.version(0) == 0
    agg.push(b, 0, 0, tensors(2))
    assert agg.version(0) == 1


def test_min_contributors_holds_the_round_open() -> None:
    agg, (a, b), _ = make(2, min_contributors=3)
    agg.push(a, 0, 0, tensors(1))
    agg.push(b, 0, 0, tensors(2))
    assert agg.version(0) == 0
    c = agg.join("l2", FINGERPRINT).session_id
    agg.push(c, 0, 0, tensors(3))
    assert agg.version(0) == 1


def test_expired_lease_drops_learner_and_closes_round() -> None:
    agg, (a, b), clock = make(2, lease_s=5.0)
    clock.now = 3.0
    agg.push(a, 0, 0, tensors(1))  # renews a's lease to 8.0; b's stays at 5.0
    clock.now = 6.0
    assert agg.expire_leases() == ["l1"]
    assert agg.version(0) == 1
    assert agg.live_learners() == ["l0"]
    with pytest.raises(NotFound, match="join again"):
        agg.push(b, 0, 1, tensors(2))


def test_a_heartbeat_between_expiry_and_close_keeps_the_session(monkeypatch) -> None:
    """Heartbeats take the learners' lock, not the aggregator's: one that renews a lease after
    expire_leases found it run out, but before the session was closed, keeps it."""
    agg, (a, b), clock = make(2)
    clock.now = 11.0  # past both leases (10 s)
    real_expired = agg._learners.expired

    def then_a_heartbeat():
        found = real_expired()
        agg.heartbeat(b)  # b renews in between
        return found

    monkeypatch.setattr(agg._learners, "expired", then_a_heartbeat)
    assert agg.expire_leases() == ["l0"]
    assert agg.live_learners() == ["l1"]


def test_leave_closes_round() -> None:
    agg, (a, b), _ = make(2)
    agg.push(a, 0, 0, tensors(1))
    agg.leave(b)
    assert agg.version(0) == 1


def test_heartbeat_keeps_a_learner_alive() -> None:
    agg, (a, b), clock = make(2, lease_s=5.0)
    for now in (4.0, 8.0, 12.0):
        clock.now = now
        agg.heartbeat(a)
        agg.heartbeat(b)
    assert agg.expire_leases() == []


@pytest.mark.parametrize(
    "base, error, message",
    [(1, InvalidArgument, "from the future"), (-1, FailedPrecondition, "stale")],
)
def test_push_base_version_checks(base: int, error: type, message: str) -> None:
    agg, (a, _), _ = make(2)
    with pytest.raises(error, match=message):
        agg.push(a, 0, base, tensors(1))
    assert agg.version(0) == 0


def test_check_push_refuses_a_header_before_any_payload() -> None:
    agg, (a, b), _ = make(2)
    assert agg.check_push(a, 0, 0) == SHAPES
    with pytest.raises(AlreadyExists, match="already initialized"):
        agg.check_push(b, 0, -1, initial=True)
    agg.push(a, 0, 0, tensors(1))
    with pytest.raises(AlreadyExists, match="already pushed"):
        agg.check_push(a, 0, 0)
    with pytest.raises(NotFound):
        agg.check_push("nobody", 0, 0)


def test_second_push_for_same_round_is_rejected_and_changes_nothing() -> None:
    agg, (a, b), _ = make(2)
    agg.push(a, 0, 0, tensors(1))
    with pytest.raises(AlreadyExists):
        agg.push(a, 0, 0, tensors(3))
    agg.push(b, 0, 0, tensors(2))
    reference, (ra, rb), _ = make(2)  # the same round without the duplicate
    reference.push(ra, 0, 0, tensors(1))
    reference.push(rb, 0, 0, tensors(2))
    for got, want in zip(agg.params(0), reference.params(0), strict=True):
        assert torch.equal(got, want)


def test_wrong_shapes_and_unknown_fragment_are_rejected() -> None:
    agg, (a, _), _ = make(2)
    with pytest.raises(InvalidArgument, match="expects 2 tensors"):
        agg.push(a, 0, 0, [torch.zeros(3, 4)])
    with pytest.raises(NotFound, match="fragment 7"):
        agg.push(a, 7, 0, tensors(1))


def test_initialize_only_once_and_fingerprint_must_match() -> None:
    agg, (a, _), _ = make(2)
    with pytest.raises(AlreadyExists, match="already initialized"):
        agg.initialize(a, 0, tensors(5))
    other = [ParamSpec("p0", (3, 4), "float32"), ParamSpec("p1", (6,), "float32")]
    with pytest.raises(FailedPrecondition, match="differs at parameter p1"):
        agg.join("l9", other)


def test_rejoin_replaces_the_old_session() -> None:
    agg, (a, _), _ = make(2)
    agg.join("l0", FINGERPRINT)
    assert agg.live_learners() == ["l0", "l1"]
    with pytest.raises(NotFound):
        agg.heartbeat(a)


def test_config_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match="outer_momentum"):
        aggregator_config(outer_momentum=1.0)
    with pytest.raises(ValueError, match="mode"):
        aggregator_config(mode="gossip")
    with pytest.raises(ValueError, match="outer_momentum_warmup_rounds"):
        aggregator_config(outer_momentum_warmup_rounds=-1)
    with pytest.raises(ValueError, match="outer_momentum_warmup_start"):
        aggregator_config(outer_momentum_warmup_start=1.0)
    with pytest.raises(ValueError, match="async"):
        aggregator_config(mode="async", outer_momentum_warmup_rounds=10)
    with pytest.raises(ValueError, match="outer_state_dtype must be one of float32, bfloat16"):
        aggregator_config(outer_state_dtype="float16")
    with pytest.raises(ValueError, match="outer_state_dtype bfloat16 is for sync and quorum"):
        aggregator_config(
            mode="async", outer_momentum_warmup_rounds=0, outer_state_dtype="bfloat16"
        )


def test_wake_never_waits_for_the_lock_and_starts_one_waiting_thread() -> None:
    """gRPC calls wake on the thread all calls' events pass through: while a round's close
    holds the lock, wake returns at once, and however many wakes come, one thread waits to
    notify; its notify reaches a long-poll whose caller left meanwhile."""
    agg, _, _ = make(2)
    left = threading.Event()
    polled: list[int] = []
    poll = threading.Thread(
        target=lambda: polled.append(agg.wait_for_version(0, 5, 30, gone=left.is_set))
    )
    poll.start()
    holding, release = threading.Event(), threading.Event()

    def hold_the_lock() -> None:
        with agg._cond:
            holding.set()
            release.wait(30)

    holder = threading.Thread(target=hold_the_lock)
    holder.start()
    assert holding.wait(30)
    left.set()
    for _ in range(50):
        agg.wake()  # returns at once, the lock being held
    assert sum(t.name == "wake" for t in threading.enumerate()) == 1
    release.set()
    holder.join(30)
    poll.join(30)
    assert polled == [0]
