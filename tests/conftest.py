"""What every test shares: the tiers and their timeouts.

`make test` runs the tests not marked slow (unit and integration, minutes on 2 cores);
`make test-slow` runs the slow ones (chaos runs, multi-shard restarts, runs that wait on
learners of different speeds). Every test has a timeout (pytest-timeout): the default in
pyproject.toml, SLOW_TIMEOUT_S for a slow one unless it sets its own.
"""

from __future__ import annotations

import pytest

SLOW_TIMEOUT_S = 900


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("slow") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT_S))
