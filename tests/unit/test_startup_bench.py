"""bench/startup.py measures each phase in a fresh interpreter's CPU time."""

from __future__ import annotations

import sys

import pytest

from bench import startup


def test_a_phase_is_timed_in_a_fresh_process() -> None:
    # A fresh interpreter has not imported torch; this one's modules do not leak into it.
    assert "torch" in sys.modules
    seconds = startup.cpu_seconds("import sys", "assert 'torch' not in sys.modules")
    assert 0.0 <= seconds < 60.0


def test_a_failing_phase_is_an_error_not_a_figure() -> None:
    with pytest.raises(Exception, match="returned non-zero"):
        startup.cpu_seconds("", "raise SystemExit(3)")


def test_every_phase_names_code_to_run() -> None:
    assert set(startup.PHASES) >= {"import_server_main", "first_adamw", "load_corpus_1mb"}
    assert all(code for _, code in startup.PHASES.values())
