"""A safetensors file built in memory as one page-aligned image, then written with O_DIRECT.

    image = TensorFileImage({"0": t0, "1": t1})   # copies the tensors' bytes (take a lock)
    specs = image.specs()                          # each tensor's dtype, shape and CRC32
    image.write(path)                              # O_DIRECT where the filesystem takes it; fsync
    image.close()                                  # its memory goes back
    TensorFileImage(tensors, pool)                 # built in a PagePool's pages, given back
                                                   # to it at close() for the next image

Why: a server snapshots its state while it serves. Through the page cache a write costs a
memory copy into the cache on top of the copy that takes the state out from under the lock,
and on a busy machine that copy runs at a fraction of the disk's speed (bench/snapshots.py).
Here the one copy builds the file's bytes, and O_DIRECT hands them to the disk from there.
A fresh buffer costs a page fault for each 4 KiB it maps and the kernel's zeroing of it: three
quarters of a copy's time into it (1.3 GB: 0.34 s, 0.10 s into a buffer already mapped), and
that copy is taken under a fragment's lock. A writer of several images reuses their buffers
(common/direct_io.PagePool).
Filesystems without O_DIRECT (tmpfs, some network filesystems) get the same bytes through
the page cache, said once in the log. The file is a plain safetensors file: the JSON header
is padded with spaces (as the format allows) so that the data starts on a page boundary.
"""

from __future__ import annotations

import json
import math
import mmap
import struct
from pathlib import Path

import torch

from common.checksum import crc32
from common.direct_io import PAGE, PagePool, write_pages

_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


class TensorFileImage:
    """The bytes of one safetensors file holding `tensors` (name -> tensor), in memory."""

    def __init__(self, tensors: dict[str, torch.Tensor], pool: PagePool | None = None) -> None:
        """`pool`: where the image's buffer comes from and goes back to at close()."""
        head, offsets, self._data_start, self.size = _layout(tensors)
        self._pool = pool if pool is not None else PagePool(keep=0)
        self._buffer: mmap.mmap | None = self._pool.take(self.size)  # page-aligned
        self._view = memoryview(self._buffer)
        self._specs: dict[str, dict] | None = None
        padded = head + b" " * (self._data_start - 8 - len(head))
        self._view[: self._data_start] = struct.pack("<Q", len(padded)) + padded
        self._regions = {}
        self._described = {
            name: (str(t.dtype).removeprefix("torch."), list(t.shape))
            for name, t in tensors.items()
        }
        for name, t in tensors.items():
            start, end = offsets[name]
            region = self._view[self._data_start + start : self._data_start + end]
            if end > start:
                flat = t.detach().reshape(-1).view(torch.uint8)
                torch.frombuffer(region, dtype=torch.uint8).copy_(flat)
            self._regions[name] = region

    @staticmethod
    def size_of(tensors: dict[str, torch.Tensor]) -> int:
        """The bytes an image of `tensors` takes (nothing copied)."""
        return _layout(tensors)[3]

    def specs(self) -> dict[str, dict]:
        """Each tensor's dtype (torch's name: "float32"), shape and CRC32 (over its bytes as
        written), by name; computed at the first call (a writer calls it while the disk
        takes the image before)."""
        if self._specs is None:
            self._specs = {
                name: {"dtype": dtype, "shape": shape, "crc32": crc32(self._regions[name])}
                for name, (dtype, shape) in self._described.items()
            }
        return self._specs

    def write(self, path: Path) -> None:
        """Write the file at `path` (new or replaced) and fsync it."""
        write_pages(path, self._view, self.size)

    def close(self) -> None:
        """Give the buffer back to its pool (the memory back, without one); once."""
        if self._buffer is None:
            return
        for region in self._regions.values():
            region.release()
        self._regions = {}
        self._view.release()
        buffer, self._buffer = self._buffer, None
        self._pool.give(buffer)


def _layout(tensors: dict[str, torch.Tensor]) -> tuple[bytes, dict, int, int]:
    """The header, each tensor's (start, end) in the data, where the data starts (the header
    padded to a page) and the image's size."""
    offsets, position = {}, 0
    for name, t in tensors.items():
        if t.dtype not in _DTYPES:
            raise TypeError(f"tensor {name}: a snapshot cannot hold {t.dtype}")
        size = t.numel() * t.element_size()
        offsets[name] = (position, position + size)
        position += size
    header = {
        name: {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": offsets[name]}
        for name, t in tensors.items()
    }
    head = json.dumps(header, separators=(",", ":")).encode()
    data_start = math.ceil((8 + len(head)) / PAGE) * PAGE
    return head, offsets, data_start, data_start + position
