"""The server's state directory: atomic snapshots plus an append-only log of outer steps.

    persistence = Persistence(config.persistence, identity)   # inert without a state_dir
    restored = persistence.restore()       # at start: the snapshot and the log's steps, or None
    restored = read_state_dir(path)        # the same, changing nothing (diloco-export)
    persistence.record(fragment_id, version, mean, every)     # each closed round, fsynced
    if persistence.round_closed(): persistence.snapshot(fingerprint, fragments)

    state_dir/snapshot.pt   torch.save of the whole aggregator state, replaced atomically
                            (temp file, fsync, rename, fsync the directory): {"fingerprint",
                            "layout": the dir's identity (params.state_identity),
                            "fragments": [FragmentState.state_dict()]}
    state_dir/updates.log   one record per closed round since that snapshot:
                            magic "DLR2" | payload length (u64) | crc32 (u32) | payload
                            payload = meta length (u32) | meta (JSON: fragment, version,
                            every, shapes) | each mean tensor's float32 bytes (little-endian)
                            ("DLR1" records, payload = torch.save(...), are still read)

Invariant: a version that any learner has seen is durable. The round's record is appended
(and fsynced) before its outer step is taken (rounds/policy.py), all under the aggregator's
lock. After `kill -9` the server loads the snapshot and replays the means through the same
deterministic outer step, ending bit-identical, momentum and error feedback included. A torn
or corrupt record can only be the tail: replay stops at the first bad record, truncates the
log there and says so, and checks that versions follow on. A record that fails to be written
is cut off again, and the shard then takes no new versions (StateDirFailed: UNAVAILABLE to
pushes, health NOT_SERVING) until it is restarted with the disk back: it loses nothing.

Memory: a record is written from the mean tensors' own buffers and replay reads one record
at a time, so neither costs more than one model-sized tensor list.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import os
import struct
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import torch

from common.atomic import atomic_write
from common.checksum import crc32
from common.errors import NotFound, Unavailable
from server.state.fragment import FragmentState
from server.state.params import ParamSpec, check_state_dir_shard

if TYPE_CHECKING:
    from server.aggregator import AggregatorEvents

log = logging.getLogger(__name__)

_MAGIC = b"DLR2"
_MAGIC_TORCH = b"DLR1"  # written before raw records: payload = torch.save({...})
_HEADER = struct.Struct("<4sQI")
_META_LEN = struct.Struct("<I")


@dataclass(kw_only=True)
class PersistenceConfig:
    """The state directory: snapshots and the log of outer steps."""

    state_dir: str = ""
    """Directory for snapshots and the update log; empty keeps state in memory only."""
    snapshot_every_versions: int = 100
    """Write a full snapshot (and start a new log) once the log holds this many closed rounds
    (those a restart replayed count too)."""

    def __post_init__(self) -> None:
        if self.snapshot_every_versions < 1:
            raise ValueError(
                f"snapshot_every_versions must be >= 1, got {self.snapshot_every_versions}"
            )


class StateDirFailed(Unavailable):
    """The state dir could not be written: the shard takes no new versions until it is
    restarted with the disk back (what it served is on disk, so the restart loses nothing)."""


@dataclass(frozen=True)
class LogRecord:
    fragment_id: int
    version: int  # the version this step produced
    mean: list[torch.Tensor]
    outer_every: int = 0  # async: Delayed Nesterov's N at this step (it follows membership)


@dataclass
class Restored:
    """What a state dir holds: the snapshot's state, then the log's steps after it."""

    identity: dict  # what state_identity() returned for the server that wrote it
    fingerprint: list[ParamSpec]
    fragments: list[dict]  # FragmentState.state_dict() of each fragment, in fragment order
    updates: Iterator[LogRecord]  # each the next version of its fragment; read it to the end


class Persistence:
    """The Aggregator's state dir (inert without one): restore at start, then every closed
    round logged and a snapshot now and then. Called with the Aggregator's lock held."""

    def __init__(self, config: PersistenceConfig, identity: dict, events: AggregatorEvents):
        """`identity`: what params.state_identity() gives for the server's settings."""
        self.state_dir = config.state_dir
        self._every = config.snapshot_every_versions
        self._identity = identity
        self._events = events
        self._store = StateStore(config.state_dir) if config.state_dir else None
        self._rounds_since_snapshot = 0
        self.failure: str | None = None  # why the state dir cannot be written, once it failed

    def restore(self) -> Restored | None:
        """The state the dir holds, None for an empty dir (or none). Raises ValueError for a
        dir written with other settings, RuntimeError for a log without its snapshot."""
        if self._store is None:
            return None
        restored = _restore(self._store)
        if restored is None:
            return None
        check_state_dir_shard(self.state_dir, restored.identity, self._identity)
        if restored.identity != self._identity:
            raise ValueError(
                f"state dir {self.state_dir} was written with {restored.identity}; "
                f"start the server with the same settings or a new state dir"
            )
        return replace(restored, updates=self._counted(restored.updates))

    def _counted(self, updates: Iterator[LogRecord]) -> Iterator[LogRecord]:
        """The log's rounds count towards the next snapshot, so that each restart does not
        replay a longer log than the last."""
        for record in updates:
            self._rounds_since_snapshot += 1
            yield record

    def record(self, fragment_id: int, version: int, mean: list[torch.Tensor], every: int) -> None:
        """Log the outer step that will make `version` of a fragment; on disk when this
        returns. StateDirFailed if it cannot be (the log is left as it was before)."""
        if self._store is None:
            return
        self.check_writable()
        try:
            self._store.append(LogRecord(fragment_id, version, mean, every))
        except OSError as err:
            self._fail(f"cannot append to {self._store.log_path}: {err.strerror or err}")

    def check_writable(self) -> None:
        """StateDirFailed once the state dir failed: no new version may be made."""
        if self.failure is not None:
            raise StateDirFailed(
                f"this shard takes no new versions: {self.failure}; it serves what it has "
                f"until it is restarted with the disk back"
            )

    def _fail(self, reason: str) -> None:
        self.failure = reason
        log.error(
            "state dir failed: %s; this shard takes no new versions until it is restarted "
            "(every version it served is on disk)",
            reason,
        )
        self.check_writable()

    def round_closed(self) -> bool:
        """Count a closed round; True when a snapshot is due."""
        if self._store is None:
            return False
        self._rounds_since_snapshot += 1
        return self._rounds_since_snapshot >= self._every

    def snapshot(
        self, fingerprint: Sequence[ParamSpec], fragments: Sequence[FragmentState]
    ) -> None:
        """Write the whole state; the log starts over."""
        if self._store is None:
            return
        self.check_writable()
        started = time.perf_counter()
        try:
            self._store.write_snapshot(
                {
                    "fingerprint": [(p.name, p.shape, p.dtype) for p in fingerprint],
                    "layout": dict(self._identity),
                    "fragments": [f.state_dict() for f in fragments],
                }
            )
        except (OSError, RuntimeError) as err:  # torch.save reports a failed write so
            reason = getattr(err, "strerror", None) or str(err)
            self._fail(f"cannot write {self._store.snapshot_path}: {reason}")
        self._rounds_since_snapshot = 0
        self._events.snapshot_written(time.perf_counter() - started)

    def close(self) -> None:
        if self._store is not None:
            self._store.close()


def read_state_dir(state_dir: str | Path) -> Restored | None:
    """What `state_dir` holds, as a server starting on it would restore it, changing nothing
    (a torn log tail is skipped, not truncated); None without a snapshot. For diloco-export:
    raises what Persistence.restore raises, and OSError or torch.load's error."""
    return _restore(StateStore(state_dir, read_only=True))


def _restore(store: StateStore) -> Restored | None:
    snapshot = store.load_snapshot()
    if snapshot is None:
        if next(store.replay(), None) is not None:
            raise RuntimeError(f"{store.log_path} has records but there is no snapshot")
        return None
    fingerprint = [ParamSpec(n, tuple(shape), d) for n, shape, d in snapshot["fingerprint"]]
    fragments = snapshot["fragments"]
    versions = [state["version"] for state in fragments]
    return Restored(snapshot["layout"], fingerprint, fragments, _updates(store, versions))


def _updates(store: StateStore, versions: list[int]) -> Iterator[LogRecord]:
    """The log's records that follow the snapshot's `versions`, one in memory at a time."""
    replayed = 0
    for record in store.replay():
        replayed += 1
        fid = record.fragment_id
        if not 0 <= fid < len(versions):
            raise NotFound(f"fragment {fid} does not exist")
        if record.version <= versions[fid]:
            continue  # a crash between snapshot and log reset: already in the snapshot
        if record.version != versions[fid] + 1:
            raise RuntimeError(
                f"{store.log_path}: record for fragment {fid} version "
                f"{record.version} does not follow version {versions[fid]}"
            )
        yield record
        versions[fid] += 1
    log.info("restored from %s: versions %s (replayed %d records)", store.dir, versions, replayed)


class StateStore:
    """The files: the snapshot and the log's records."""

    def __init__(self, state_dir: str | Path, read_only: bool = False) -> None:
        """`read_only`: never write (no dir made, a torn log tail left in place), so that a
        reader cannot cut a record a running server is still appending."""
        self.dir = Path(state_dir)
        self.read_only = read_only
        if not read_only:
            self.dir.mkdir(parents=True, exist_ok=True)
        self.snapshot_path = self.dir / "snapshot.pt"
        self.log_path = self.dir / "updates.log"
        self._log = None

    def load_snapshot(self) -> dict | None:
        """The latest snapshot, None if there is none."""
        if not self.snapshot_path.exists():
            return None
        return torch.load(self.snapshot_path, weights_only=False)

    def replay(self) -> Iterator[LogRecord]:
        """The valid records after the snapshot, one at a time; a torn or corrupt tail is
        dropped (the log truncated to the good prefix) once the good records are read."""
        if not self.log_path.exists():
            return
        size = self.log_path.stat().st_size
        with open(self.log_path, "rb") as f:
            count, valid_bytes = 0, 0
            while (record := _read_record(f, size - valid_bytes)) is not None:
                count, valid_bytes = count + 1, f.tell()
                yield record
        if valid_bytes < size:
            log.warning(
                "updates.log: dropping a torn or corrupt tail of %d bytes after %d good records",
                size - valid_bytes,
                count,
            )
            if self.read_only:
                return
            with open(self.log_path, "r+b") as f:
                f.truncate(valid_bytes)
                os.fsync(f.fileno())

    def write_snapshot(self, state: dict) -> None:
        """Replace the snapshot atomically, then start an empty log."""
        atomic_write(self.snapshot_path, lambda f: torch.save(state, f))
        self.close()
        with open(self.log_path, "wb") as f:  # the snapshot covers everything logged so far
            os.fsync(f.fileno())

    def append(self, record: LogRecord) -> None:
        """Append one record and fsync it before returning; the tensors' bytes are written
        from their own buffers."""
        views = [_bytes_view(t) for t in record.mean]
        shapes = [list(t.shape) for t in record.mean]
        fields = {"fragment": record.fragment_id, "version": record.version}
        meta = json.dumps({**fields, "every": record.outer_every, "shapes": shapes}).encode()
        head = _META_LEN.pack(len(meta)) + meta
        crc = crc32(head)
        for view in views:
            crc = crc32(view, crc)
        length = len(head) + sum(view.nbytes for view in views)
        if self._log is None:
            self._log = open(self.log_path, "ab", buffering=0)  # nothing left in a buffer
        start = self._log.seek(0, os.SEEK_END)
        try:
            for piece in (_HEADER.pack(_MAGIC, length, crc) + head, *views):
                _write_all(self._log, piece)
            os.fsync(self._log.fileno())
        except OSError:
            # A record that did not make it must not stay as a torn piece in the middle of
            # the log, nor as a whole one whose round was dropped: back to where it started.
            with contextlib.suppress(OSError):
                os.ftruncate(self._log.fileno(), start)
                os.fsync(self._log.fileno())
            raise

    def close(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None


def _write_all(f: BinaryIO, data: bytes | memoryview) -> None:
    """Write all of `data` to the unbuffered file `f` (a raw write may take part of it)."""
    view = memoryview(data).cast("B")
    while view.nbytes:
        written = f.write(view)
        if not written:
            raise OSError(f"wrote nothing to {f.name}")
        view = view[written:]


def _bytes_view(t: torch.Tensor) -> memoryview:
    """The little-endian float32 bytes of a contiguous CPU tensor, uncopied."""
    if t.dtype != torch.float32 or not t.is_contiguous() or sys.byteorder != "little":
        t = t.to(torch.float32).contiguous()
        if sys.byteorder != "little":
            t = t.view(torch.int32).byteswap_().view(torch.float32)  # pragma: no cover
    return memoryview(t.detach().numpy()).cast("B")


def _read_record(f: BinaryIO, remaining: int) -> LogRecord | None:
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
        view = _bytes_view(t)
        if f.readinto(view) != view.nbytes:
            return None
        running = crc32(view, running)
        mean.append(t)
    if running != crc:
        return None
    return LogRecord(int(meta["fragment"]), int(meta["version"]), mean, int(meta["every"]))
