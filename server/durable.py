"""The server's state directory: atomic snapshots plus an append-only log of outer steps.

    state_dir/snapshot.pt   torch.save of the whole aggregator state, replaced atomically
                            (write a temp file, fsync, rename, fsync the directory)
    state_dir/updates.log   one record per closed round since that snapshot:
                            magic "DLR1" | payload length (u64) | crc32 (u32) | payload
                            payload = torch.save({"fragment", "version", "mean"})

Invariant: a version that any learner has seen is durable. The aggregator appends (and
fsyncs) the round's record before it releases its lock, so no pull can see a version whose
record is not on disk; after `kill -9` the server loads the snapshot and replays the means
through the same deterministic outer step, ending bit-identical, momentum and error feedback
included. A torn or corrupt record can only be the tail (a write the crash interrupted,
whose version was never served): loading stops at the first bad record, truncates the log
there and says so. Replay checks that versions follow on, so nothing is applied blindly.
"""

from __future__ import annotations

import io
import logging
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from common.checksum import crc32

log = logging.getLogger(__name__)

_MAGIC = b"DLR1"
_HEADER = struct.Struct("<4sQI")


@dataclass(frozen=True)
class LogRecord:
    fragment_id: int
    version: int  # the version this step produced
    mean: list[torch.Tensor]
    outer_every: int = 0  # async: Delayed Nesterov's N at this step (it follows membership)


class StateStore:
    def __init__(self, state_dir: str | Path) -> None:
        self.dir = Path(state_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.snapshot_path = self.dir / "snapshot.pt"
        self.log_path = self.dir / "updates.log"
        self._log = None

    def load(self) -> tuple[dict | None, list[LogRecord]]:
        """The latest snapshot (None if there is none) and the valid records after it."""
        snapshot = None
        if self.snapshot_path.exists():
            snapshot = torch.load(self.snapshot_path, weights_only=False)
        records: list[LogRecord] = []
        if self.log_path.exists():
            records, valid_bytes = _read_records(self.log_path.read_bytes())
            size = self.log_path.stat().st_size
            if valid_bytes < size:
                log.warning(
                    "updates.log: dropping a torn or corrupt tail of %d bytes after %d "
                    "good records",
                    size - valid_bytes,
                    len(records),
                )
                with open(self.log_path, "r+b") as f:
                    f.truncate(valid_bytes)
                    os.fsync(f.fileno())
        return snapshot, records

    def write_snapshot(self, state: dict) -> None:
        """Replace the snapshot atomically, then start an empty log."""
        tmp = self.snapshot_path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.snapshot_path)
        self._fsync_dir()
        self.close()
        with open(self.log_path, "wb") as f:  # the snapshot covers everything logged so far
            os.fsync(f.fileno())

    def append(self, record: LogRecord) -> None:
        """Append one record and fsync it before returning."""
        buffer = io.BytesIO()
        torch.save(
            {"fragment": record.fragment_id, "version": record.version, "mean": record.mean}, buffer
        )
        payload = buffer.getvalue()
        if self._log is None:
            self._log = open(self.log_path, "ab")
        self._log.write(_HEADER.pack(_MAGIC, len(payload), crc32(payload)) + payload)
        self._log.flush()
        os.fsync(self._log.fileno())

    def close(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def _fsync_dir(self) -> None:
        fd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _read_records(data: bytes) -> tuple[list[LogRecord], int]:
    """Parse records until the first torn or corrupt one; returns them and the good length."""
    records, offset = [], 0
    while offset + _HEADER.size <= len(data):
        magic, length, crc = _HEADER.unpack_from(data, offset)
        start, end = offset + _HEADER.size, offset + _HEADER.size + length
        if magic != _MAGIC or end > len(data) or crc32(data[start:end]) != crc:
            break
        try:
            fields = torch.load(io.BytesIO(data[start:end]), weights_only=True)
        except Exception:  # noqa: BLE001 - any unreadable payload ends the valid prefix
            break
        records.append(
            LogRecord(fields["fragment"], fields["version"], fields["mean"], fields.get("every", 0))
        )
        offset = end
    return records, offset
