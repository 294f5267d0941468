"""server/main.py: the arena cap and heap trimmer run on glibc, and are skipped (with a
reason) elsewhere."""

import logging
import platform
import threading

import pytest

from server import main as runtime


def test_arena_cap_is_set_on_glibc_only(monkeypatch, caplog) -> None:
    on_glibc = platform.libc_ver()[0] == "glibc"
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    caplog.set_level(logging.INFO, logger="diloco.server")
    monkeypatch.setattr(platform, "libc_ver", lambda: ("musl", "1.2"))
    assert runtime.limit_malloc_arenas() is False
    assert "libc is musl, not glibc" in caplog.text
    if on_glibc:  # 8 per core is glibc's own default cap: harmless for the test process
        monkeypatch.undo()
        assert runtime.limit_malloc_arenas(8) is True
        assert "at most 8 glibc arenas" in caplog.text
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    assert runtime.limit_malloc_arenas() is False
    assert "MALLOC_ARENA_MAX=4 from the environment" in caplog.text


def test_malloc_trimmer_runs_on_glibc_and_stops(monkeypatch, caplog) -> None:
    caplog.set_level(logging.INFO, logger="diloco.server")
    stop = threading.Event()
    with pytest.raises(ValueError, match="interval must be > 0"):
        runtime.start_malloc_trimmer(stop, 0)
    if platform.libc_ver()[0] == "glibc":
        assert runtime.start_malloc_trimmer(stop, 0.01) is True
        trimmer = next(t for t in threading.enumerate() if t.name == "malloc-trim")
        stop.set()
        trimmer.join(timeout=5)
        assert not trimmer.is_alive()
    monkeypatch.setattr(platform, "libc_ver", lambda: ("musl", "1.2"))
    assert runtime.start_malloc_trimmer(stop) is False
    assert "heap not trimmed" in caplog.text
