"""server/rpc/receive.py: the push memory budget, its reused buffers, and chunks read in place."""

from __future__ import annotations

import threading

import pytest

from common.codec.fragment import max_fragment_bytes
from common.errors import InvalidArgument, ResourceExhausted
from common.generated.diloco.v1 import aggregator_pb2 as pb
from common.retry import wait_until
from server.rpc.receive import (
    AUTO_MAX_BYTES,
    AUTO_MIN_BYTES,
    BudgetExhausted,
    PushBudget,
    auto_budget_bytes,
    receive_into,
)


def test_reservations_are_bounded_and_returned() -> None:
    budget = PushBudget(budget_bytes=100, wait_s=0.0, keep=1)
    with budget.reserve(60) as first:
        assert len(first) == 60 and budget.reserved_bytes() == 60
        with pytest.raises(BudgetExhausted):
            with budget.reserve(50):
                pass
        with budget.reserve(40) as second:
            assert len(second) == 40
    # One buffer is kept for the next push (the first one back); the other went back to
    # the system.
    assert budget.reserved_bytes() == 40 and budget.refused == 1
    with budget.reserve(30):  # the kept 40-byte buffer: nothing new is allocated
        assert budget.reserved_bytes() == 40


def test_initial_values_larger_than_the_budget_are_received_alone() -> None:
    budget = PushBudget(budget_bytes=100, wait_s=0.0, keep=2)
    with budget.reserve(30):
        pass  # kept for reuse
    with pytest.raises(ResourceExhausted, match="exceeds the push memory budget of 100"):
        with budget.reserve(101):  # a delta larger than the budget: never
            pass
    with budget.reserve(20):
        with pytest.raises(BudgetExhausted, match="push_memory_budget_mb"):
            with budget.reserve(101, gone=lambda: True, initial=True):  # not beside another
                pass
    assert budget.refused == 1
    with budget.reserve(101, initial=True) as alone:  # the kept buffers are dropped for it
        assert len(alone) == 101 and budget.reserved_bytes() == 101
        with pytest.raises(BudgetExhausted):
            with budget.reserve(1):  # nothing fits beside it
                pass
    assert budget.reserved_bytes() == 0  # a one-off: freed


def test_new_pushes_wait_while_initial_values_wait_to_be_received_alone() -> None:
    """Pushes that keep coming cannot starve a fragment's initial values: while those wait,
    new pushes wait too, and once the ones in flight end the initial values go in."""
    budget = PushBudget(budget_bytes=100, wait_s=5.0, keep=0)
    first = budget.reserve(40)
    first.__enter__()
    admitted = threading.Event()

    def initial() -> None:
        with budget.reserve(150, initial=True):
            admitted.set()

    thread = threading.Thread(target=initial)
    thread.start()
    wait_until(lambda: budget._waiting_alone == 1, 10, "the initial push waiting")
    with pytest.raises(BudgetExhausted):
        with budget.reserve(40, gone=lambda: True):  # would fit, but waits its turn
            pass
    first.__exit__(None, None, None)
    thread.join(10)
    assert admitted.is_set() and budget.reserved_bytes() == 0


def test_a_failed_push_frees_its_buffer_and_kept_ones_make_room() -> None:
    budget = PushBudget(budget_bytes=100, wait_s=0.0, keep=2)
    with pytest.raises(InvalidArgument):
        with budget.reserve(80) as buffer:
            receive_into(buffer, [b"x" * 81])  # longer than announced
    assert budget.reserved_bytes() == 0  # a cancelled or refused push keeps nothing
    with budget.reserve(30):
        pass
    with budget.reserve(90):  # the kept 30-byte buffer is dropped to make room
        assert budget.reserved_bytes() == 90


def test_receive_into_needs_exactly_the_announced_bytes() -> None:
    buffer = memoryview(bytearray(6))
    assert bytes(receive_into(buffer, [b"abc", memoryview(b"..def")[2:]])) == b"abcdef"
    with pytest.raises(InvalidArgument, match="ended after 3 of the announced 6"):
        receive_into(buffer, [b"abc"])


def test_one_off_pushes_are_not_kept_and_small_pushes_take_small_buffers() -> None:
    budget = PushBudget(budget_bytes=200, wait_s=0.0, keep=4)
    with budget.reserve(100, initial=True):  # a fragment's initial values
        pass
    assert budget.reserved_bytes() == 0
    with budget.reserve(100):
        pass
    with budget.reserve(40):  # not the kept 100-byte buffer: it would waste most of it
        assert budget.reserved_bytes() == 140
    with budget.reserve(60):  # the kept 100-byte one fits
        assert budget.reserved_bytes() == 140


def test_the_automatic_budget_is_a_quarter_of_the_owned_bytes_within_bounds() -> None:
    mib = 2**20
    fp32 = lambda shapes: max_fragment_bytes(shapes, pb.CODEC_FP32)  # noqa: E731
    fp4 = lambda shapes: max_fragment_bytes(shapes, pb.CODEC_FP4_E2M1)  # noqa: E731
    small = [[(1024, 1024)], [(1024,)]]  # 4 MiB: the floor
    assert auto_budget_bytes(small) == AUTO_MIN_BYTES == 64 * mib
    middle = [[(128 * mib // 4,)], [(256 * mib // 4,)]]  # 384 MiB of fp32: a quarter
    assert auto_budget_bytes(middle) == (fp32(middle[0]) + fp32(middle[1])) // 4
    assert AUTO_MIN_BYTES < auto_budget_bytes(middle) < AUTO_MAX_BYTES
    many = [[(256 * mib // 4,)]] * 16  # 4 GiB in 16 fragments: the ceiling
    assert auto_budget_bytes(many) == AUTO_MAX_BYTES == 256 * mib
    big = [[(2048 * mib // 4,)]]  # one 2 GiB fragment: two of its fp4 pushes always fit
    assert auto_budget_bytes(big) == 2 * fp4(big[0]) > AUTO_MAX_BYTES


def test_an_automatic_budget_is_sized_once_by_fit_and_a_given_one_is_kept() -> None:
    budget = PushBudget(budget_bytes=None, wait_s=0.0)
    with pytest.raises(RuntimeError, match="fit"), budget.reserve(10):
        pass
    calls = []
    shapes = lambda: calls.append(1) or [[(4,)]]  # noqa: E731
    budget.fit(shapes)
    budget.fit(shapes)
    assert budget.budget_bytes == AUTO_MIN_BYTES and len(calls) == 1
    with budget.reserve(10) as buffer:
        assert len(buffer) == 10
    given = PushBudget(budget_bytes=100, wait_s=0.0)
    given.fit(shapes)
    assert given.budget_bytes == 100
