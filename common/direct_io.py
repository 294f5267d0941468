"""Writes that skip the page cache: whole files, and appends to a log, with O_DIRECT where the
filesystem takes it.

    write_pages(path, view, size)       # a page-aligned buffer's first `size` bytes as a file
    write_parts(path, [blob1, blob2])   # byte strings one after another as a file
    pool = PagePool()                   # page-aligned buffers kept from one write to the next
    write_parts(path, blobs, pool)      # staged in a pooled buffer; pool.close() at the end
    pool.reserve(nbytes)                # mapped and faulted in now, for a take() under a lock
    log = DirectAppend(path)            # an append-only file (a write-ahead log)
    log.append([head, tensor_bytes])    # on disk and fsynced when it returns; cut back on error
    log.close()

Why: the server's state dir takes gigabytes at a time (a snapshot; a round's fp32 mean in the
write-ahead log, 537 MB a fragment at 537 M parameters). Through the page cache with an fsync
such writes ran at 0.27-0.90 GB/s here against 1.9 GB/s with O_DIRECT, cost a memory copy into
the cache, and their writeback competed with every other write on the disk.

A writer of several files stages them in a PagePool's buffers: a copy into pages already
mapped took 0.10 s for 1.3 GB here, into fresh ones 0.30-0.40 s (a page fault and the
kernel's zeroing of each 4 KiB).

O_DIRECT wants page-aligned memory, offsets and lengths. A whole file is written from an
aligned buffer in whole pages and then cut to its size. An append rewrites the file's last
partial page (kept in memory) followed by the new bytes, through a page-aligned bounce buffer
of BOUNCE_BYTES, then cuts the file to its true end: the bytes on disk are exactly those a
plain append writes, so readers see no difference. A crash between the write and the cut
leaves zeros after the last record, which a reader takes for a torn tail. Filesystems without
O_DIRECT (tmpfs, some network filesystems) get plain writes, said once in the log. Copies
into the bounce buffer go through numpy, which lets the GIL go.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import mmap
import os
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy

log = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE
O_DIRECT = getattr(os, "O_DIRECT", 0)  # Linux; elsewhere every write is buffered
# Bytes one write() call hands over. Between two calls the writing thread takes the GIL back,
# and on a serving shard another thread holds it for up to a switch interval (5 ms): beside one
# busy Python thread, O_DIRECT writes of 8 MiB ran at 0.9 GB/s here, of 256 MiB at 2.1 (the
# disk's speed, as alone).
WRITE_BLOCK = 256 << 20
BOUNCE_BYTES = 64 << 20  # an append's aligned staging buffer (a multiple of PAGE); see above
_PRIVATE_MAPPING = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
_LAZY_FREE = getattr(mmap, "MADV_FREE", None)  # Linux 4.5+, the BSDs, macOS
_lazy_free_refused: list[OSError] = []  # the kernel's refusal of MADV_FREE, said once
_direct_refused: set[int] = set()  # the filesystems (st_dev) that refused O_DIRECT, said once


def write_pages(path: Path, view: memoryview, size: int) -> None:
    """Write the first `size` bytes of the page-aligned `view` (whole pages) as the file at
    `path`, with O_DIRECT where its filesystem takes it (else through the page cache); fsync."""
    device = os.stat(path.parent).st_dev
    if O_DIRECT and device not in _direct_refused:
        try:
            return _write_file(path, view, size, O_DIRECT)
        except OSError as err:  # at open, or at a write (some FUSE and overlay mounts)
            if err.errno != errno.EINVAL:
                raise
            _refused(device, path)
    _write_file(path, view, size, 0)


def _write_file(path: Path, view: memoryview, size: int, direct: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | direct, 0o644)
    try:
        # The view is released even on an error, whose traceback would keep it (and so the
        # buffer it views) alive.
        with view[: math.ceil(size / PAGE) * PAGE] as pages:
            pwrite_all(fd, pages, 0, path)
        os.ftruncate(fd, size)
        os.fsync(fd)
    finally:
        os.close(fd)


def write_parts(path: Path, parts: Sequence[bytes], pool: PagePool | None = None) -> None:
    """Write `parts` one after another as the file at `path`, as an image is written: copied
    into one page-aligned buffer (`pool`'s, else a fresh one), then O_DIRECT where the
    filesystem takes it; fsync."""
    size = sum(len(part) for part in parts)
    pool = pool if pool is not None else PagePool(keep=0)
    buffer = pool.take(size)
    try:
        # numpy's copy lets the GIL go (a memoryview's held it 0.49 s for 200 MB: a serving
        # shard's heartbeats waited that long); the views go before the buffer closes.
        target, position = numpy.frombuffer(buffer, dtype=numpy.uint8), 0
        try:
            for part in parts:
                end = position + len(part)
                numpy.copyto(target[position:end], numpy.frombuffer(part, numpy.uint8))
                position = end
        finally:
            del target
        with memoryview(buffer) as view:
            write_pages(path, view, size)
    finally:
        pool.give(buffer)


class PagePool:
    """Page-aligned buffers handed from one write to the next (module docstring); a buffer
    is taken by one caller at a time, from any thread. It holds at most `keep` free buffers
    (0: a buffer is unmapped as it comes back), the smallest going first."""

    def __init__(self, keep: int = 4) -> None:
        self.keep = keep
        self._free: list[mmap.mmap] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> mmap.mmap:
        """The smallest free buffer of at least `nbytes` (whole pages), else a new one."""
        pages = max(PAGE, math.ceil(nbytes / PAGE) * PAGE)
        with self._lock:
            fits = [buffer for buffer in self._free if len(buffer) >= pages]
            if fits:
                chosen = min(fits, key=len)
                self._free.remove(chosen)
                return chosen
        # Private: its pages are the process's own (a shared mapping's live in shmem, whose
        # faults cost more) and may be lent back to the kernel (idle()).
        return mmap.mmap(-1, pages, flags=_PRIVATE_MAPPING)

    def reserve(self, nbytes: int) -> None:
        """Have a free buffer of at least `nbytes` with its pages in memory, so that the next
        take() of that size, under a caller's lock, neither maps nor faults: a fresh 1 GiB
        faulted in 0.65 s here (idle), a loaded machine's 1.07 GB in 1.1-1.5 s. The touch
        goes through numpy, which lets the GIL go (MAP_POPULATE holds it throughout); on
        pages already in memory, or lent back with idle() and not yet taken, it is quick."""
        if self.keep == 0:
            return  # nothing stays free for the take() after
        buffer = self.take(nbytes)
        try:
            numpy.frombuffer(buffer, dtype=numpy.uint8)[::PAGE] = 0  # a write a page
        finally:
            self.give(buffer)

    def give(self, buffer: mmap.mmap) -> None:
        with self._lock:
            self._free.append(buffer)
            self._free.sort(key=len)
            surplus = max(0, len(self._free) - self.keep)
            extra, self._free = self._free[:surplus], self._free[surplus:]
        _unmap(extra)

    def idle(self) -> None:
        """Lend the free buffers' pages back to the kernel until they are next written
        (MADV_FREE): it takes them only when memory runs short, and a copy into pages it
        left costs a third more than into pages kept (1.07 GB: 0.17 s; kept 0.085, fresh
        0.24, on an idle machine here; a loaded one faulted fresh pages in 1.1-1.5 s)."""
        if _LAZY_FREE is None or _lazy_free_refused:
            return
        with self._lock:  # no take() meanwhile: a page written before the advice could go
            for buffer in self._free:
                try:
                    buffer.madvise(_LAZY_FREE)
                except OSError as err:  # a kernel without it (Linux < 4.5): the pages stay
                    _lazy_free_refused.append(err)
                    log.warning("MADV_FREE refused (%s): idle snapshot buffers stay resident", err)
                    return

    def close(self) -> None:
        """Unmap every free buffer (one still viewed unmaps when its last view goes)."""
        with self._lock:
            free, self._free = self._free, []
        _unmap(free)


def _unmap(buffers: list[mmap.mmap]) -> None:
    for buffer in buffers:
        with contextlib.suppress(BufferError):  # still viewed: its last view unmaps it
            buffer.close()


class DirectAppend:
    """An append-only file written with O_DIRECT (module docstring); not thread-safe."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        device = os.stat(self.path.parent).st_dev
        self._direct = bool(O_DIRECT) and device not in _direct_refused
        self._fd = self._open()
        try:
            self.size = os.fstat(self._fd).st_size
            with open(self.path, "rb") as f:  # the last partial page, rewritten next append
                f.seek(self.size - self.size % PAGE)
                self._tail = f.read()
            self._bounce = mmap.mmap(-1, BOUNCE_BYTES)
        except BaseException:
            os.close(self._fd)
            raise

    def _open(self) -> int:
        flags = os.O_WRONLY | os.O_CREAT
        if self._direct:
            try:
                return os.open(self.path, flags | O_DIRECT, 0o644)
            except OSError as err:
                if err.errno != errno.EINVAL:
                    raise
                self._plain_from_now()
        return os.open(self.path, flags, 0o644)

    def _plain_from_now(self) -> None:
        self._direct = False
        _refused(os.stat(self.path.parent).st_dev, self.path)

    def append(self, pieces: Sequence[bytes | memoryview]) -> None:
        """Append `pieces` in order and fsync. On an error the file is cut back to where it
        was (a record that did not make it must not stay, torn or whole) and the error raised."""
        start, views = self.size, [memoryview(piece).cast("B") for piece in pieces]
        try:
            if self._direct:
                try:
                    self._append_direct(views)
                except OSError as err:  # O_DIRECT taken at open, refused at a write
                    if err.errno != errno.EINVAL:
                        raise
                    self._plain_from_now()
                    plain = self._open()  # before the old one closes: its number stays ours
                    os.close(self._fd)
                    self._fd = plain
                    os.ftruncate(self._fd, start)
            if not self._direct:
                self._append_plain(views)
            os.fsync(self._fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, start)
                os.fsync(self._fd)
            raise
        self.size = start + sum(view.nbytes for view in views)
        # The new last partial page: the end of the old one and the views (each view's last
        # page holds all of it that can lie in the file's last page).
        joined = self._tail + b"".join(bytes(view[-PAGE:]) for view in views)
        self._tail = joined[len(joined) - self.size % PAGE :] if self.size % PAGE else b""

    def _append_plain(self, views: list[memoryview]) -> None:
        position = self.size
        for view in views:
            pwrite_all(self._fd, view, position, self.path)
            position += view.nbytes
        os.ftruncate(self._fd, position)  # nothing of an older, longer attempt stays after it

    def _append_direct(self, views: list[memoryview]) -> None:
        """The views after the kept partial page, through the bounce buffer."""
        bounce = numpy.frombuffer(self._bounce, dtype=numpy.uint8)
        offset, filled = self.size - len(self._tail), len(self._tail)  # offset: page-aligned
        try:
            bounce[:filled] = numpy.frombuffer(self._tail, dtype=numpy.uint8)
            for view in views:
                source = numpy.frombuffer(view, dtype=numpy.uint8)
                while source.size:
                    take = min(source.size, BOUNCE_BYTES - filled)
                    numpy.copyto(bounce[filled : filled + take], source[:take])
                    filled, source = filled + take, source[take:]
                    if filled == BOUNCE_BYTES:
                        self._write_bounce(offset, BOUNCE_BYTES)
                        offset, filled = offset + BOUNCE_BYTES, 0
        finally:
            del bounce
        if filled:
            # The padding is zeros: until the cut below, a crash leaves it in the file, and
            # there the bounce buffer's older bytes could read as earlier, valid records.
            padded = math.ceil(filled / PAGE) * PAGE
            self._bounce[filled:padded] = bytes(padded - filled)
            self._write_bounce(offset, padded)
        os.ftruncate(self._fd, offset + filled)  # the last page's padding goes

    def _write_bounce(self, offset: int, length: int) -> None:
        with memoryview(self._bounce)[:length] as pages:
            pwrite_all(self._fd, pages, offset, self.path)

    def close(self) -> None:
        try:
            os.close(self._fd)
        finally:
            with contextlib.suppress(BufferError):  # still viewed: its last view unmaps it
                self._bounce.close()


def pwrite_all(fd: int, view: memoryview, offset: int, path: Path) -> None:
    """Write all of `view` at `offset` (a write may take part of it, a block at a time)."""
    written = 0
    while written < view.nbytes:
        step = os.pwrite(
            fd, view[written : min(view.nbytes, written + WRITE_BLOCK)], offset + written
        )
        if step <= 0:
            raise OSError(errno.EIO, f"wrote nothing to {path}")
        written += step


def _refused(device: int, path: Path) -> None:
    if device not in _direct_refused:
        _direct_refused.add(device)
        log.info("%s takes no O_DIRECT writes: its files go through the page cache", path.parent)
