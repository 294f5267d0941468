"""The server's state directory: snapshots, and the write-ahead log of the outer steps since.

    persistence = Persistence(config.persistence, identity, events, lock)  # inert without a dir
    restored = persistence.restore()        # at start: a snapshot and the log's steps, or None
    restored = read_state_dir(path)         # the same, changing nothing (diloco-export)
    persistence.record(fragment_id, version, mean, every)      # each closed round, fsynced
    if persistence.round_closed(): persistence.start_snapshot(params)  # written off the lock

    state_dir/snapshot-<n>/     snapshot n (formats.py), a directory renamed into place whole
    state_dir/updates-<n>.log   the records of the rounds closed since snapshot n began

Write-ahead: a round's record is fsynced before its outer step (rounds/policy.py), so every
version a learner has seen is durable; after `kill -9` the newest snapshot and the logs from
its number on replay through the same deterministic outer step, bit-identical. Only the newest
log's tail can be torn: it is cut off, with a warning. A write that fails stops new versions
(StateDirFailed: UNAVAILABLE, health NOT_SERVING) until a restart with the disk back.

A snapshot starts its log, then copies the fragments one at a time into their files' images,
each under its own state lock (not the Aggregator's: it waits only for a close of that
fragment), and writes each (O_DIRECT) while the next is copied; the server carries on. The
last two snapshots are kept with their logs: an unreadable newest one is set aside (*.bad)
for the one before; one killed half way (*.tmp) is removed at start. An older server's
snapshot.pt is read with torch's weights-only loader and rewritten at start.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from common.direct_io import DirectAppend, PagePool
from common.errors import Unavailable
from server.state.formats import (
    Restored,
    SnapshotError,
    fsync_path,
    image_bytes,
    prepare_fragment,
    read_legacy_snapshot,
    read_snapshot,
    restored_from,
    write_fragment,
    write_manifest,
)
from server.state.log_records import LogRecord, append_record, read_log
from server.state.params import GlobalParams, check_state_identity

if TYPE_CHECKING:
    from server.aggregator import AggregatorEvents

log = logging.getLogger(__name__)

_NUMBERED = re.compile(r"^(snapshot|updates)-(\d{6})(\.log)?$")
_LEGACY_SNAPSHOT, _LEGACY_LOG = "snapshot.pt", "updates.log"
KEPT_SNAPSHOTS = 2


@dataclass(kw_only=True)
class PersistenceConfig:
    """The state directory: snapshots and the log of outer steps."""

    state_dir: str = ""
    """Directory for snapshots and the update log; empty keeps state in memory only. It holds
    the last two snapshots, each about the owned fragments' state (parameters, outer state,
    update log), so give it room for three times that."""
    snapshot_every_versions: int = 100
    """Write a snapshot (off the lock; a new log starts with it) once the log holds this many
    closed rounds (those a restart replayed count too)."""

    def __post_init__(self) -> None:
        if (every := self.snapshot_every_versions) < 1:
            raise ValueError(f"snapshot_every_versions must be >= 1, got {every}")


class StateDirFailed(Unavailable):
    """The state dir could not be written: the shard takes no new versions until it is
    restarted with the disk back (what it served is on disk, so the restart loses nothing)."""


class Persistence:
    """The Aggregator's state dir (inert without one): restore at start, then every closed
    round logged and a snapshot now and then. Called with the Aggregator's lock held."""

    def __init__(
        self,
        config: PersistenceConfig,
        identity: dict,
        events: AggregatorEvents,
        lock: threading.Condition | None = None,
        settings: dict | None = None,
        durable: Callable[[int | None], dict] = lambda fragment_id: {},
    ) -> None:
        """`identity`: params.state_identity(); `lock`: the Aggregator's; `settings`: what
        snapshots record of the settings (config.recorded_settings); `durable`: what else a
        restart needs (Admission.durable) of one fragment (a record) or all (None: a snapshot)."""
        self.state_dir = config.state_dir
        self._every = config.snapshot_every_versions
        self._identity, self._settings, self._durable = identity, settings or {}, durable
        self._admission: dict = {}  # durable(None) as the snapshot being written began
        self._events = events
        self._lock = lock or threading.Condition()
        self._store = StateStore(config.state_dir) if config.state_dir else None
        self._rounds_since_snapshot = 0
        self._pool = PagePool()  # buffers kept for the next snapshot (idle() between)
        self.snapshot_running = False
        self.failure: str | None = None  # why the state dir cannot be written, once it failed

    def restore(self) -> Restored | None:
        """The state the dir holds, None for an empty dir (or none). Raises ValueError for a
        dir written with other settings or without a readable snapshot, RuntimeError for a
        log without its snapshot."""
        if self._store is None:
            return None
        try:
            restored = _restore(self._store)
            if restored is None:
                return None
            check_state_identity(self.state_dir, restored.identity, self._identity)
        except BaseException:
            self.close()  # a server that cannot start lets the dir go
            raise
        return replace(restored, updates=self._counted(restored.updates))

    def _counted(self, updates: Iterator[LogRecord]) -> Iterator[LogRecord]:
        """The log's rounds count towards the next snapshot: a restart replays no more."""
        try:
            for self._rounds_since_snapshot, record in enumerate(updates, 1):
                yield record
        except BaseException:
            self.close()  # a log that cannot be replayed: the server does not start
            raise

    def record(self, fragment_id: int, version: int, mean: list[torch.Tensor], every: int) -> None:
        """Log the outer step that will make `version` of a fragment; on disk when this
        returns. StateDirFailed if it cannot be (the log is left as it was before)."""
        if self._store is None:
            return
        self.check_writable()
        record = LogRecord(fragment_id, version, mean, every, self._durable(fragment_id))
        try:
            self._store.append(record)
        except OSError as err:
            self._fail(f"cannot append to {self._store.log_path}: {err.strerror or err}")
            self.check_writable()

    def check_writable(self) -> None:
        """StateDirFailed once the state dir failed: no new version may be made."""
        if self.failure is not None:
            why = f"this shard takes no new versions: {self.failure}"
            raise StateDirFailed(f"{why}; it serves what it has until restarted with the disk back")

    def _fail(self, reason: str) -> None:
        self.failure = reason
        log.error("state dir failed: %s; this shard takes no new versions until it is "
                  "restarted (every version it served is on disk)", reason)  # fmt: skip

    def round_closed(self) -> bool:
        """Count a closed round; True when a snapshot is due."""
        if self._store is None:
            return False
        self._rounds_since_snapshot += 1
        return self._rounds_since_snapshot >= self._every

    def snapshot(self, params: GlobalParams) -> None:
        """Write the whole state now, holding the lock (after one being written ends)."""
        if self._store is None:
            return
        self._lock.wait_for(lambda: not self.snapshot_running)
        self.check_writable()
        if self._begin():  # else the dir failed, and says why
            self._write(params.fingerprint or [], params.fragments, off_lock=False)
        self.check_writable()

    def start_snapshot(self, params: GlobalParams) -> None:
        """Write the state off the lock (_write); nothing if one is being written already."""
        if self._store is None or self.snapshot_running or self.failure is not None:
            return
        if not self._begin():
            return
        args = (list(params.fingerprint or []), list(params.fragments), True)
        threading.Thread(target=self._write, args=args, name="snapshot", daemon=True).start()

    def _begin(self) -> bool:
        """Start the snapshot's log; False (the dir failed) if that cannot be written."""
        try:
            self._number, self._tmp = self._store.begin_snapshot()
        except OSError as err:
            self._fail(f"cannot start a snapshot in {self.state_dir}: {err.strerror or err}")
            return False
        self.snapshot_running, self._rounds_since_snapshot = True, 0
        self._admission = self._durable(None)
        return True

    def _write(self, fingerprint, fragments, off_lock: bool) -> None:
        """Write the snapshot, `off_lock` taking each fragment's own state lock for its copy
        (else the caller holds the Aggregator's lock throughout)."""
        held = self._lock if off_lock else contextlib.nullcontext()
        started, entries, failure, versions = time.perf_counter(), [], None, {}
        pool = self._pool
        try:
            # Each fragment's copy (its file's image) under its state lock, its CRCs and write
            # off it, while the next one is copied: at most two images at a time.
            with ThreadPoolExecutor(1, thread_name_prefix="snapshot-write") as writer:
                writing: Future | None = None
                for fragment in fragments:
                    own_lock = fragment.state_lock if off_lock else contextlib.nullcontext()
                    with own_lock:
                        size = image_bytes(fragment.state_dict())
                    pool.reserve(size)  # its pages faulted in off the lock (the copy's cost)
                    with own_lock:
                        prepared = prepare_fragment(fragment.state_dict(), pool)
                        versions[fragment.fragment_id] = fragment.version
                    prepared.checksum()
                    if writing is not None:
                        entries.append(writing.result())
                    fid = fragment.fragment_id
                    writing = writer.submit(write_fragment, self._tmp, fid, prepared, pool)
                    del prepared
                if writing is not None:
                    entries.append(writing.result())
            header = {"sequence": self._number, "layout": self._identity}
            header |= {"settings": self._settings, "admission": self._admission}
            header["fingerprint"] = [(p.name, p.shape, p.dtype) for p in fingerprint]
            self._store.commit_snapshot(self._number, self._tmp, header, entries)
        except Exception as err:  # noqa: BLE001 - any failure to write stops new versions
            failure = f"cannot write {self._tmp}: {getattr(err, 'strerror', None) or err}"
        else:  # one line per snapshot: the last one says what a restart resumes from
            path, seconds = self._store.snapshot_dir(self._number), time.perf_counter() - started
            log.info(
                "snapshot written to %s: fragment versions %s, in %.2f s", path, versions, seconds
            )
        finally:
            with held:  # waiters woken first: nothing after may keep them waiting
                self.snapshot_running = False
                self._lock.notify_all()
                if failure is not None:
                    self._fail(failure)
                self._events.snapshot_written(time.perf_counter() - started)
            pool.idle()

    def close(self) -> None:
        """Release the dir (after the last snapshot); nothing is written from then on."""
        self._lock.wait_for(lambda: not self.snapshot_running)
        if self._store is not None:
            self._store.release()
            self._store = None
        self._pool.close()


def read_state_dir(state_dir: str | Path) -> Restored | None:
    """What `state_dir` holds, as a server starting on it would restore it, changing nothing
    (a torn log tail is skipped, not cut off); None without a snapshot. For diloco-export:
    raises what Persistence.restore raises, and OSError."""
    return _restore(StateStore(state_dir, read_only=True))


def _restore(store: StateStore) -> Restored | None:
    errors = []
    for number in store.snapshots():
        try:
            snapshot = read_snapshot(store.snapshot_dir(number))
            return restored_from(snapshot, store.replay(number), store.dir)
        except (SnapshotError, OSError) as err:
            log.warning("%s: restoring from the snapshot before it", err)
            errors.append(str(err))
            store.set_aside(number)
    if errors:
        raise SnapshotError(f"no snapshot in {store.dir} can be read: {'; '.join(errors)}")
    if (legacy := store.dir / _LEGACY_SNAPSHOT).exists():  # rewritten in this format at start
        snapshot = read_legacy_snapshot(legacy)
        return replace(restored_from(snapshot, store.replay(None), store.dir), rewrite=True)
    if next(store.replay(0), None) is not None:
        raise RuntimeError(f"{store.log_path} has records but there is no snapshot")
    return None


class StateStore:
    """The files: numbered snapshots and logs."""

    def __init__(self, state_dir: str | Path, read_only: bool = False) -> None:
        self.dir = Path(state_dir)  # read_only: no write at all (a server may be appending)
        self.read_only = read_only
        self._held: int | None = None  # the lock file's descriptor while this store has it
        if not read_only:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._held = _lock_dir(self.dir)
            for stale in self.dir.glob("snapshot-*.tmp"):  # a snapshot killed half way
                shutil.rmtree(stale)
        numbers = [n for _, n in self._numbered()]
        self.sequence = max(numbers, default=0)  # the log appends go to
        self._log: DirectAppend | None = None

    def _numbered(self) -> list[tuple[str, int]]:
        found = (_NUMBERED.match(p.name) for p in self.dir.iterdir()) if self.dir.is_dir() else ()
        return [(m.group(1), int(m.group(2))) for m in found if m]

    @property
    def log_path(self) -> Path:
        return self._log_file(self.sequence)

    def _log_file(self, number: int) -> Path:
        return self.dir / f"updates-{number:06d}.log"

    def snapshot_dir(self, number: int) -> Path:  # whole once its manifest is there
        return self.dir / f"snapshot-{number:06d}"

    def snapshots(self) -> list[int]:
        """The complete snapshots' numbers, newest first."""
        numbers = (n for kind, n in self._numbered() if kind == "snapshot")
        complete = (n for n in numbers if (self.snapshot_dir(n) / "manifest.json").exists())
        return sorted(complete, reverse=True)

    def set_aside(self, number: int) -> None:
        """Keep an unreadable snapshot for inspection, out of the way (snapshot-<n>.bad)."""
        if not self.read_only:
            path = self.snapshot_dir(number)
            path.rename(path.with_name(path.name + ".bad"))

    def replay(self, first: int | None) -> Iterator[LogRecord]:
        """The valid records of the logs from number `first` on (None: an older server's
        updates.log), one at a time; a torn or corrupt tail of the newest is cut off."""
        if first is None:
            paths = [self.dir / _LEGACY_LOG]
        else:
            numbers = sorted(n for kind, n in self._numbered() if kind == "updates" and n >= first)
            paths = [self._log_file(n) for n in numbers]
        for path in paths:
            yield from read_log(path, cut_tail=not self.read_only and path == paths[-1])

    def begin_snapshot(self) -> tuple[int, Path]:
        """Start snapshot n: its log (every later record goes there) and its directory."""
        self.close()
        number = self.sequence + 1
        with open(self._log_file(number), "ab") as f:
            os.fsync(f.fileno())
        fsync_path(self.dir)
        self.sequence = number
        tmp = self.snapshot_dir(number).with_suffix(".tmp")
        tmp.mkdir()
        return number, tmp

    def commit_snapshot(self, number: int, tmp: Path, header: dict, fragments: list) -> None:
        """Make snapshot n whole: its manifest, then the directory renamed into place; then
        the snapshots and logs older than the last KEPT_SNAPSHOTS go."""
        write_manifest(tmp, header, fragments)
        fsync_path(tmp)
        os.replace(tmp, self.snapshot_dir(number))
        fsync_path(self.dir)
        kept = self.snapshots()[:KEPT_SNAPSHOTS]
        for kind, n in self._numbered():
            if n < min(kept):
                path = self.snapshot_dir(n) if kind == "snapshot" else self._log_file(n)
                shutil.rmtree(path) if path.is_dir() else path.unlink()
        for name in (_LEGACY_SNAPSHOT, _LEGACY_LOG):  # rewritten in this format now
            (self.dir / name).unlink(missing_ok=True)

    def append(self, record: LogRecord) -> None:
        """Append one record, fsynced when this returns (else cut back off: log_records.py)."""
        if self._log is None:
            self._log = DirectAppend(self.log_path)
        append_record(self._log, record)

    def close(self) -> None:  # the next append reopens the log
        with contextlib.closing(self._log) if self._log else contextlib.nullcontext():
            self._log = None

    def release(self) -> None:
        """Close the log and let another server have the dir."""
        self.close()
        if self._held is not None:
            os.close(self._held)  # the lock goes with it
            self._held = None


def _lock_dir(path: Path) -> int:
    """Hold `path`'s lock file for as long as the descriptor returned is open: two servers on
    one state dir would write each other's snapshots and logs."""
    fd = os.open(path / "lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        os.close(fd)
        raise ValueError(
            f"state dir {path} is in use by another server ({path / 'lock'} is locked); "
            "stop that server first, or give this one another state dir"
        ) from err
    return fd
