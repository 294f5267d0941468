"""common/atomic.py: a target is replaced whole or not at all, and no temporary file stays."""

from __future__ import annotations

import stat

import pytest

from common.atomic import atomic_path, atomic_write


def test_bytes_text_and_writer_functions_replace_the_target(tmp_path) -> None:
    target = tmp_path / "f"
    atomic_write(target, b"one")
    assert target.read_bytes() == b"one"
    atomic_write(target, "two\n")
    assert target.read_text() == "two\n"
    atomic_write(target, lambda f: f.write(b"three"))
    assert target.read_bytes() == b"three"
    assert [p.name for p in tmp_path.iterdir()] == ["f"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path) -> None:
    target = tmp_path / "f"
    atomic_write(target, b"old")

    def fail(f) -> None:
        f.write(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(target, fail)
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["f"]


def test_mode_sets_the_permission_bits(tmp_path) -> None:
    target = tmp_path / "secret"
    atomic_write(target, "token", mode=0o600)
    assert stat.S_IMODE(target.stat().st_mode) == 0o600


def test_atomic_path_renames_what_another_writer_put_there(tmp_path) -> None:
    target = tmp_path / "lib.so"
    with atomic_path(target) as tmp:
        assert tmp.parent == tmp_path and tmp != target
        tmp.write_bytes(b"\x7fELF")
    assert target.read_bytes() == b"\x7fELF"
    assert [p.name for p in tmp_path.iterdir()] == ["lib.so"]
