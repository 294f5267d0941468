"""The disk speeds bench/snapshots.py holds a snapshot's speed against: a plain sequential
write (buffered or O_DIRECT, the faster), on the idle machine or between two snapshots while
the shard serves, and the snapshot writer alone on the idle machine."""

from __future__ import annotations

import math
import mmap
import os
import shutil
import time
from pathlib import Path

import torch

from bench.scale_fleet import FRAGMENTS, TENSORS, Model
from bench.snapshot_probes import POLL_EVERY_S, dir_bytes
from common.direct_io import O_DIRECT, PAGE, WRITE_BLOCK, PagePool
from server.state.formats import prepare_fragment, write_fragment

DISK_BLOCK = WRITE_BLOCK  # as the snapshot writer hands its bytes over


def disk_write_s(directory: Path, nbytes: int) -> float:
    """Seconds to write `nbytes` to a new file in `directory` in DISK_BLOCK blocks and fsync
    it (then deleted), the faster of two ways: through the page cache, and with O_DIRECT from
    a page-aligned buffer (as the snapshot writes; where the filesystem takes it)."""
    return min(_write_s(directory, nbytes, direct) for direct in (False, True))


def _write_s(directory: Path, nbytes: int, direct: bool) -> float:
    if direct and not O_DIRECT:
        return math.inf
    path = directory / "disk-speed.tmp"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (O_DIRECT if direct else 0))
    except OSError:  # no O_DIRECT on this filesystem: the buffered figure stands
        return math.inf
    with mmap.mmap(-1, DISK_BLOCK) as block:  # page-aligned, as O_DIRECT needs
        block.write(os.urandom(DISK_BLOCK))
        started = time.perf_counter()
        try:
            with memoryview(block) as view:
                for offset in range(0, nbytes, DISK_BLOCK):  # whole pages
                    size = min(DISK_BLOCK, math.ceil((nbytes - offset) / PAGE) * PAGE)
                    os.write(fd, view[:size])
            os.fsync(fd)
            return time.perf_counter() - started
        finally:
            os.close(fd)
            path.unlink(missing_ok=True)


def write_between_snapshots(state_dir: Path, directory: Path, nbytes: int) -> float | None:
    """disk_write_s while the server still serves its learners, between two snapshots: the
    disk and CPUs as busy as a snapshot finds them, less the snapshot itself. None if a
    snapshot overlapped each of three tries."""
    for _ in range(3):
        deadline = time.perf_counter() + 300
        while list(state_dir.glob("*.tmp")) and time.perf_counter() < deadline:
            time.sleep(POLL_EVERY_S)
        before = sorted(p.name for p in state_dir.glob("snapshot-*"))
        seconds = disk_write_s(directory, nbytes)
        if sorted(p.name for p in state_dir.glob("snapshot-*")) == before:
            return seconds
    return None


def writer_alone_s(directory: Path, model: Model) -> tuple[int, float]:
    """(bytes, seconds) of the snapshot writer (server/state/formats.py write_fragment, as a
    snapshot calls it) writing FRAGMENTS fragments of the server's shapes on an idle machine:
    per parameter fp32 values, bfloat16 momentum and residual (the default outer state), and
    an update chain of one fp4 update (0.5 bytes)."""
    shape, per_fragment = (model.side, model.side), TENSORS // FRAGMENTS

    def bf16() -> list[torch.Tensor]:
        return [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(per_fragment)]

    state = {
        "version": 1,
        "params": [torch.randn(shape) for _ in range(per_fragment)],
        "outer": {"momentum": bf16()},
        "residual": bf16(),
        "updates": [[0, os.urandom(per_fragment * model.side * model.side // 2)]],
    }
    target = directory / "writer-alone"
    target.mkdir()
    started, pool = time.perf_counter(), PagePool()  # buffers reused as the server's writer does
    try:
        for index in range(FRAGMENTS):
            write_fragment(target, index, prepare_fragment(state, pool), pool)
        return dir_bytes(target) or 0, time.perf_counter() - started
    finally:
        pool.close()
        shutil.rmtree(target, ignore_errors=True)
