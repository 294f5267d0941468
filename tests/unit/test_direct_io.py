"""DirectAppend: an O_DIRECT append leaves exactly the bytes a plain append leaves, on any
filesystem, and an append that fails leaves nothing."""

from __future__ import annotations

import errno
import logging
import os
import random

import pytest

import common.direct_io as direct_io
from common.direct_io import PAGE, DirectAppend
from tests.support.direct_io_faults import refuse_at_open, refuse_at_write

# Sizes that start and end inside pages, fill pages exactly and span the bounce buffer.
SIZES = [1, 7, PAGE - 8, PAGE, 3 * PAGE + 5, 0, 2 * PAGE - 1, 5 * PAGE, 123]


def chunks(seed: int) -> list[list[bytes]]:
    rng = random.Random(seed)
    return [[rng.randbytes(size), rng.randbytes(rng.randrange(50))] for size in SIZES]


@pytest.fixture
def small_bounce(monkeypatch):
    monkeypatch.setattr(direct_io, "BOUNCE_BYTES", 2 * PAGE)  # appends span several fills


def append_all(path, records: list[list[bytes]]) -> bytes:
    log = DirectAppend(path)
    try:
        for record in records:
            log.append([memoryview(piece) for piece in record])
            assert log.size == os.path.getsize(path)
    finally:
        log.close()
    return b"".join(b"".join(record) for record in records)


def test_appends_leave_exactly_their_bytes_and_reopening_goes_on(tmp_path, small_bounce) -> None:
    path = tmp_path / "updates.log"
    expected = append_all(path, chunks(0)[:4])
    expected += append_all(path, chunks(1)[4:])  # reopened with a partial last page
    assert path.read_bytes() == expected


@pytest.mark.skipif(not direct_io.O_DIRECT, reason="O_DIRECT is Linux's")
def test_a_filesystem_without_o_direct_gets_plain_appends(tmp_path, monkeypatch, caplog) -> None:
    refuse_at_open(monkeypatch)
    with caplog.at_level(logging.INFO, logger="common.direct_io"):
        expected = append_all(tmp_path / "a.log", chunks(2))
        append_all(tmp_path / "b.log", chunks(2))
    assert (tmp_path / "a.log").read_bytes() == expected
    assert caplog.text.count("takes no O_DIRECT writes") == 1


@pytest.mark.skipif(not direct_io.O_DIRECT, reason="O_DIRECT is Linux's")
def test_o_direct_refused_at_a_write_goes_on_plain(tmp_path, monkeypatch, small_bounce) -> None:
    """Some mounts (FUSE, overlays) open with O_DIRECT and refuse the write itself."""
    refuse_at_write(monkeypatch)
    expected = append_all(tmp_path / "f.log", chunks(3))
    assert (tmp_path / "f.log").read_bytes() == expected
    assert direct_io._direct_refused == {os.stat(tmp_path).st_dev}


def test_an_append_that_fails_half_way_leaves_the_file_as_it_was(tmp_path, small_bounce) -> None:
    path = tmp_path / "f.log"
    log = DirectAppend(path)
    real = direct_io.pwrite_all
    try:
        log.append([b"x" * (PAGE + 10)])
        calls = []

        def full_on_the_second(fd, view, offset, where) -> None:
            calls.append(offset)
            if len(calls) == 2:
                real(fd, view[: view.nbytes // 2], offset, where)  # half lands, then ENOSPC
                raise OSError(errno.ENOSPC, "No space left on device")
            real(fd, view, offset, where)

        direct_io.pwrite_all = full_on_the_second
        try:
            with pytest.raises(OSError, match="No space left"):
                log.append([b"y" * (5 * PAGE)])
        finally:
            direct_io.pwrite_all = real
        assert path.read_bytes() == b"x" * (PAGE + 10) and log.size == PAGE + 10
        log.append([b"z" * 3])  # space is back: the kept last page is still right
    finally:
        log.close()
    assert path.read_bytes() == b"x" * (PAGE + 10) + b"zzz"


class Crash(BaseException):
    """The process dies here: nothing after it runs."""


@pytest.mark.skipif(not direct_io.O_DIRECT, reason="O_DIRECT is Linux's")
def test_a_crash_before_the_cut_leaves_zeros_after_the_record(tmp_path, monkeypatch) -> None:
    """The last page goes out whole; until the file is cut to its end, a crash keeps its
    padding in the file, and a reader must find zeros there, never older bytes that could
    parse as records."""
    path = tmp_path / "updates.log"
    log = DirectAppend(path)
    log.append([b"x" * (2 * PAGE - 200)])  # the bounce buffer now holds x's past PAGE
    if not log._direct:
        pytest.skip("this filesystem takes no O_DIRECT")

    def crash(fd, length) -> None:
        raise Crash

    monkeypatch.setattr(direct_io.os, "ftruncate", crash)
    with pytest.raises(Crash):
        log.append([b"y" * 10])
    data = path.read_bytes()
    assert data[: 2 * PAGE - 190] == b"x" * (2 * PAGE - 200) + b"y" * 10
    assert data[2 * PAGE - 190 :] == bytes(len(data) - (2 * PAGE - 190))
