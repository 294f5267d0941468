"""common/retry.py's wait_until: returns the first truthy value, names what timed out."""

from __future__ import annotations

import pytest

from common.retry import wait_until


def test_returns_the_first_truthy_value() -> None:
    answers = iter([None, 0, "", 7, 8])
    assert wait_until(lambda: next(answers), timeout_s=10, what="a value", interval_s=0) == 7


def test_times_out_naming_what_it_waited_for() -> None:
    with pytest.raises(TimeoutError, match="the port file: not within 0 s"):
        wait_until(lambda: None, timeout_s=0, what="the port file", interval_s=0)


def test_an_error_in_the_check_ends_the_wait() -> None:
    def died() -> None:
        raise RuntimeError("exited")

    with pytest.raises(RuntimeError, match="exited"):
        wait_until(died, timeout_s=10, what="never")
