"""server/runtime.py: the arena cap is set on glibc, and skipped (with a reason) elsewhere."""

import logging
import platform

from server import runtime


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
