"""Test doubles shared by the unit tests."""


class FakeClock:
    """A clock that moves only when a test sets `now` (seconds): no sleeps in tests."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now
