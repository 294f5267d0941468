"""How the size of one write() call sets the state dir's write speed on a busy server.

    python -m bench.write_blocks            # 1 GiB a write, in the checkout's parent dir
    python -m bench.write_blocks --dir D --gib 2

The state dir's writer (common/direct_io.write_pages, as a snapshot's tensors and the
write-ahead log's records go to disk) hands its bytes to the kernel WRITE_BLOCK at a time,
with O_DIRECT where the filesystem takes it. The kernel call lets the GIL go; between two calls
the writing thread takes it back, and on a serving shard another thread (a gRPC handler)
holds it for up to a switch interval (5 ms). This writes the same bytes at several block sizes,
alone and beside one thread that runs Python without pause, and prints each speed and its
ratio to the same block size alone (measured in the same run, one after the other).
"""

from __future__ import annotations

import argparse
import mmap
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import common.direct_io as direct_io

BLOCKS_MIB = (8, 64, 256)


def write_s(directory: Path, view: memoryview, block: int) -> float:
    """Seconds for write_pages to write all of `view` as a new file in `directory` (fsynced),
    `block` bytes a call; the file is deleted after."""
    path = directory / "write-blocks.tmp"
    saved, direct_io.WRITE_BLOCK = direct_io.WRITE_BLOCK, block
    try:
        started = time.perf_counter()
        direct_io.write_pages(path, view, view.nbytes)
        return time.perf_counter() - started
    finally:
        direct_io.WRITE_BLOCK = saved
        path.unlink(missing_ok=True)


class BusyPython(threading.Thread):
    """A thread that holds the GIL whenever the interpreter gives it (pure Python work)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.done = threading.Event()

    def run(self) -> None:
        count = 0
        while not self.done.is_set():
            count += 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path(__file__).resolve().parents[2])
    parser.add_argument("--gib", type=float, default=1.0, help="bytes written each time")
    args = parser.parse_args()
    size = int(args.gib * (1 << 30)) // direct_io.PAGE * direct_io.PAGE
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp, mmap.mmap(-1, size) as buffer:
        buffer.write(os.urandom(1 << 20) * (size >> 20))  # incompressible, every page mapped
        with memoryview(buffer) as view:
            rows = []
            for mib in BLOCKS_MIB:
                alone = write_s(Path(tmp), view, mib << 20)
                busy = BusyPython()
                busy.start()
                try:
                    beside = write_s(Path(tmp), view, mib << 20)
                finally:
                    busy.done.set()
                    busy.join()
                rows.append((mib, size / alone / 1e6, size / beside / 1e6))
    print(f"{size / 1e9:.2f} GB a write, O_DIRECT where {args.dir} takes it, then fsync")
    print("| block | alone MB/s | beside a busy Python thread MB/s | beside / alone |")
    print("|---|---|---|---|")
    for mib, alone, beside in rows:
        print(f"| {mib} MiB | {alone:.0f} | {beside:.0f} | {beside / alone:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
