"""The write-ahead log's records: one per closed round since the snapshot the log began with.

    append_record(log_file, LogRecord(fragment_id, version, mean, every, admission))
    for record in read_log(path, cut_tail=True): ...     # a torn tail cut off (newest log)

updates-<n>.log holds one record per closed round since snapshot <n> began:
  magic "DLR2" | payload length (u64) | crc32 (u32) | payload
  payload = meta length (u32) | meta (JSON: fragment, version, every, shapes)
            | each mean tensor's float32 bytes (little-endian)
Records of older servers ("DLR1", payload = torch.save(...)) are read with torch's
weights-only loader, which runs no code.
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import struct
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from common.checksum import crc32
from common.direct_io import DirectAppend

log = logging.getLogger(__name__)

_MAGIC = b"DLR2"
_MAGIC_TORCH = b"DLR1"
_HEADER = struct.Struct("<4sQI")
_META_LEN = struct.Struct("<I")


@dataclass(frozen=True)
class LogRecord:
    fragment_id: int
    version: int  # the version this step produced
    mean: list[torch.Tensor]
    outer_every: int = 0  # async: Delayed Nesterov's N at this step (it follows membership)
    admission: dict | None = None  # Admission.durable() as the round closed (JSON)


def append_record(log_file: DirectAppend, record: LogRecord) -> None:
    """Append `record` to the log and fsync it; the tensors' bytes are written from their
    own memory. On an error the file is cut back to where it was: a record that did not make
    it must not stay, torn or whole (its round was dropped)."""
    log_file.append(_record_pieces(record))


def read_log(path: Path, cut_tail: bool) -> Iterator[LogRecord]:
    """The valid records of the log at `path`, one at a time; a torn or corrupt tail is
    reported, and with `cut_tail` cut off once the good records are read."""
    if not path.exists():
        return
    size = path.stat().st_size
    with open(path, "rb") as f:
        count, valid_bytes = 0, 0
        while (record := read_record(f, size - valid_bytes)) is not None:
            count, valid_bytes = count + 1, f.tell()
            yield record
    if valid_bytes < size:
        tail = size - valid_bytes
        log.warning("%s: dropping a torn or corrupt tail of %d bytes after %d good records",
                    path, tail, count)  # fmt: skip
        if cut_tail:
            with open(path, "r+b") as f:
                f.truncate(valid_bytes)
                os.fsync(f.fileno())


def _record_pieces(record: LogRecord) -> list[bytes | memoryview]:
    """The record's bytes in order, its tensors' bytes as views of their own memory."""
    views = [_float32_view(t) for t in record.mean]
    shapes = [list(t.shape) for t in record.mean]
    meta = json.dumps({"fragment": record.fragment_id, "version": record.version, "every":
        record.outer_every, "shapes": shapes, "admission": record.admission}).encode()  # fmt: skip
    head = _META_LEN.pack(len(meta)) + meta
    crc = crc32(head)
    for view in views:
        crc = crc32(view, crc)
    length = len(head) + sum(view.nbytes for view in views)
    return [_HEADER.pack(_MAGIC, length, crc) + head, *views]


def _float32_view(t: torch.Tensor) -> memoryview:
    """The little-endian float32 bytes of a contiguous CPU tensor, uncopied."""
    if t.dtype != torch.float32 or not t.is_contiguous() or sys.byteorder != "little":
        t = t.to(torch.float32).contiguous()
        if sys.byteorder != "little":
            t = t.view(torch.int32).byteswap_().view(torch.float32)  # pragma: no cover
    return memoryview(t.detach().numpy()).cast("B")


def read_record(f: BinaryIO, remaining: int) -> LogRecord | None:
    """The record at f's position, or None if it is torn, corrupt or absent. Nothing is
    allocated beyond what the file still holds."""
    header = f.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    magic, length, crc = _HEADER.unpack(header)
    if length > remaining - _HEADER.size:
        return None
    if magic == _MAGIC_TORCH:
        data = f.read(length)
        if crc32(data) != crc:
            return None
        try:
            fields = torch.load(io.BytesIO(data), weights_only=True)
        except Exception:  # noqa: BLE001 - any unreadable payload ends the valid prefix
            return None
        return LogRecord(
            fields["fragment"], fields["version"], fields["mean"], fields.get("every", 0)
        )
    if magic != _MAGIC:
        return None
    try:
        return _read_raw_record(f, length, crc)
    except (ValueError, KeyError, TypeError):  # a corrupt meta ends the valid prefix
        return None


def _read_raw_record(f: BinaryIO, length: int, crc: int) -> LogRecord | None:
    head = f.read(_META_LEN.size)
    (meta_len,) = _META_LEN.unpack(head)
    if _META_LEN.size + meta_len > length:
        return None
    meta_bytes = f.read(meta_len)
    meta = json.loads(meta_bytes)
    shapes = [tuple(int(d) for d in shape) for shape in meta["shapes"]]
    if any(d < 0 for shape in shapes for d in shape):
        return None
    if _META_LEN.size + meta_len + sum(4 * math.prod(shape) for shape in shapes) != length:
        return None
    running = crc32(meta_bytes, crc32(head))
    mean = []
    for shape in shapes:
        t = torch.empty(shape, dtype=torch.float32)
        view = _float32_view(t)
        if f.readinto(view) != view.nbytes:
            return None
        running = crc32(view, running)
        mean.append(t)
    if running != crc:
        return None
    fields = int(meta["fragment"]), int(meta["version"]), mean, int(meta["every"])
    return LogRecord(*fields, meta.get("admission"))
