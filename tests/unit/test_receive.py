"""server/receive.py: the push memory budget, its reused buffers, and chunks read in place."""

from __future__ import annotations

import pytest

from common.errors import InvalidArgument
from server.receive import BudgetExhausted, PushBudget, receive_into


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


def test_a_push_larger_than_the_budget_is_received_alone() -> None:
    budget = PushBudget(budget_bytes=100, wait_s=0.0, keep=2)
    with budget.reserve(30):
        pass  # kept for reuse
    with budget.reserve(20):
        with pytest.raises(BudgetExhausted, match="push_memory_budget_mb"):
            with budget.reserve(101):  # not beside another push
                pass
    assert budget.refused == 1
    with budget.reserve(101) as alone:  # the kept buffers are dropped for it
        assert len(alone) == 101 and budget.reserved_bytes() == 101
        with pytest.raises(BudgetExhausted):
            with budget.reserve(1):  # nothing fits beside it
                pass
    assert budget.reserved_bytes() == 101  # kept for the next push of its size
    with budget.reserve(10):  # too small for the kept one, which is dropped to make room
        assert budget.reserved_bytes() == 10


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
    with budget.reserve(100, reuse=False):  # a fragment's initial values
        pass
    assert budget.reserved_bytes() == 0
    with budget.reserve(100):
        pass
    with budget.reserve(40):  # not the kept 100-byte buffer: it would waste most of it
        assert budget.reserved_bytes() == 140
    with budget.reserve(60):  # the kept 100-byte one fits
        assert budget.reserved_bytes() == 140
