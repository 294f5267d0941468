"""The state dir's formats: snapshots (safetensors for tensors, JSON for the rest) and log
records.

    state_dir/snapshot-000042/        one snapshot: a directory renamed into place when whole
        manifest.json                 the format and its version, the dir's identity, the
                                      fingerprint, and each fragment's fields
        fragment-0.safetensors        the fragment's tensors (parameters, outer state, residual)
        fragment-0.updates            its update log's encoded chains, back to back

A fragment's state (FragmentState.state_dict) is split into JSON, tensors ({"__tensor__":
name}, the safetensors entry) and bytes ({"__bytes__": [offset, length, crc32]} in .updates).
The manifest keeps every tensor's dtype, shape and CRC32 and every file's size; loading checks
them all, each error naming the file (SnapshotError). Nothing is unpickled: reading a state
dir runs no code. Tensors are written from their own memory (no copy).
"""

from __future__ import annotations

import io
import itertools
import json
import logging
import math
import os
import struct
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch
from safetensors import SafetensorError, safe_open

from common.atomic import atomic_write
from common.checksum import crc32
from common.direct_io import DirectAppend, PagePool, write_parts
from common.errors import NotFound
from common.tensor_file import TensorFileImage
from server.state.params import ParamSpec

log = logging.getLogger(__name__)

FORMAT = "diloco-state-snapshot"
FORMAT_VERSION = 1
FORMAT_KEY = (FORMAT, FORMAT_VERSION)
MANIFEST = "manifest.json"


class SnapshotError(ValueError):
    """A snapshot that cannot be read as written; the message names the file."""


def _split(value: Any, tensors: dict[str, torch.Tensor], blobs: list[bytes]) -> Any:
    """`value` as JSON, its tensors moved to `tensors` and its bytes to `blobs`."""
    if isinstance(value, torch.Tensor):
        name = str(len(tensors))
        tensors[name] = value
        return {"__tensor__": name}
    if isinstance(value, (bytes, bytearray, memoryview)):
        blobs.append(value)
        return {"__bytes__": len(blobs) - 1}
    if isinstance(value, dict):
        if any(not isinstance(k, str) or k.startswith("__") for k in value):
            raise TypeError(f"snapshot keys must be plain strings, got {list(value)}")
        return {k: _split(v, tensors, blobs) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_split(v, tensors, blobs) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"a snapshot cannot hold a {type(value).__name__}")


def _join(value: Any, tensor: Callable[[str], torch.Tensor], blob: Callable[[list], bytes]):
    if isinstance(value, dict):
        if "__tensor__" in value:
            return tensor(value["__tensor__"])
        if "__bytes__" in value:
            return blob(value["__bytes__"])
        return {k: _join(v, tensor, blob) for k, v in value.items()}
    if isinstance(value, list):
        return [_join(v, tensor, blob) for v in value]
    return value


@dataclass
class PreparedFragment:
    """One fragment's state ready to write: its JSON fields, its tensors copied into their
    file's image, and its update chains (bytes: immutable, not copied)."""

    fields: Any
    image: TensorFileImage
    blobs: list[bytes]

    def checksum(self) -> None:
        """Take the image's CRCs now (off the lock, while the disk takes the fragment before;
        else write_fragment takes them between its writes)."""
        self.image.specs()


def prepare_fragment(state: dict, pool: PagePool | None = None) -> PreparedFragment:
    """A fragment's state (FragmentState.state_dict) ready to write: its tensors copied into
    an image in `pool`'s pages (under the caller's lock: the copy is the only one)."""
    tensors: dict[str, torch.Tensor] = {}
    blobs: list[bytes] = []
    fields = _split(state, tensors, blobs)
    return PreparedFragment(fields, TensorFileImage(tensors, pool), blobs)


def write_fragment(
    directory: Path, index: int, prepared: PreparedFragment, pool: PagePool | None = None
) -> dict:
    """Write a prepared fragment into `directory` (fsynced); returns its manifest entry. The
    image's buffer goes back to its pool, and the update chains are staged in `pool`'s."""
    image, blobs = prepared.image, prepared.blobs
    tensor_file = directory / f"fragment-{index}.safetensors"
    try:
        image.write(tensor_file)
        specs = image.specs()  # dtype, shape and CRC32 of each tensor
    finally:
        image.close()
    blob_file = directory / f"fragment-{index}.updates"
    ends = list(itertools.accumulate(len(data) for data in blobs))
    offsets = [
        [end - len(data), len(data), crc32(data)] for end, data in zip(ends, blobs, strict=True)
    ]
    write_parts(blob_file, blobs, pool)  # O_DIRECT too: a buffered write + fsync is 2-7x slower
    fields = _join(
        prepared.fields, lambda name: {"__tensor__": name}, lambda i: {"__bytes__": offsets[i]}
    )
    return {
        "fields": fields,
        "tensors": specs,
        "tensor_file": [tensor_file.name, tensor_file.stat().st_size],
        "updates_file": [blob_file.name, blob_file.stat().st_size],
    }


def write_manifest(directory: Path, header: dict, fragments: list[dict]) -> None:
    manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, **header}
    atomic_write(directory / MANIFEST, json.dumps(manifest | {"fragments": fragments}))


def read_snapshot(directory: Path) -> dict:
    """The snapshot in `directory`: its manifest's header fields, and "fragments", each
    fragment's state as FragmentState.load_state_dict takes it. SnapshotError if any file is
    missing, torn or corrupt, or of another format."""
    path = directory / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise SnapshotError(f"{path}: unreadable manifest ({err})") from err
    found, known = (manifest.get("format"), manifest.get("format_version")), FORMAT_KEY
    if found != known:
        raise SnapshotError(f"{path}: format and version {found}; this server reads {known}")
    try:
        fragments = [_read_fragment(directory, entry) for entry in manifest["fragments"]]
    except (KeyError, TypeError) as err:
        raise SnapshotError(f"{path}: malformed manifest ({err!r})") from err
    return {**manifest, "fragments": fragments}


def _read_fragment(directory: Path, entry: dict) -> dict:
    tensor_file, blob_file = (
        _sized(directory, *entry[key]) for key in ("tensor_file", "updates_file")
    )
    specs = entry["tensors"]
    try:
        with safe_open(tensor_file, framework="pt") as f:
            if set(f.keys()) != set(specs):
                raise SnapshotError(f"{tensor_file}: holds {sorted(f.keys())}, not {sorted(specs)}")
            tensors = {n: _checked(tensor_file, n, f.get_tensor(n), specs[n]) for n in specs}
    except SafetensorError as err:
        raise SnapshotError(f"{tensor_file}: {err}") from err
    blob_data = blob_file.read_bytes()

    def blob(place: list) -> bytes:
        offset, length, crc = place
        data = blob_data[offset : offset + length]
        if len(data) != length or crc32(data) != crc:
            raise SnapshotError(f"{blob_file}: bytes at {offset} fail their checksum")
        return data

    return _join(entry["fields"], tensors.__getitem__, blob)


def _sized(directory: Path, name: str, size: int) -> Path:  # if it holds `size` bytes
    file = directory / Path(name).name  # a name, never a path out of the directory
    actual = file.stat().st_size if file.exists() else None
    if actual != size:
        raise SnapshotError(f"{file}: {actual} bytes, the manifest says {size}")
    return file


def _checked(file: Path, name: str, t: torch.Tensor, spec: dict) -> torch.Tensor:
    dtype = str(t.dtype).removeprefix("torch.")
    if dtype != spec["dtype"] or list(t.shape) != spec["shape"]:
        raise SnapshotError(
            f"{file}: tensor {name} is {dtype} {list(t.shape)}, the manifest says "
            f"{spec['dtype']} {spec['shape']}"
        )
    owned = t.clone()  # in memory of its own, not a mapping of the file
    if crc32(owned.reshape(-1).view(torch.uint8).numpy()) != spec["crc32"]:
        raise SnapshotError(f"{file}: tensor {name} fails its checksum")
    return owned


def read_legacy_snapshot(path: Path) -> dict:
    """An older server's snapshot (torch.save), read with torch's weights-only loader, which
    builds tensors and plain containers only and runs no code."""
    try:
        return torch.load(path, weights_only=True)
    except Exception as err:  # noqa: BLE001 - torch's loader raises many kinds
        raise SnapshotError(f"{path}: unreadable ({err})") from err


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a rename or a new file in it survives a power cut)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---- Log records ------------------------------------------------------------------------
#
# updates-<n>.log holds one record per closed round since snapshot <n> began:
#   magic "DLR2" | payload length (u64) | crc32 (u32) | payload
#   payload = meta length (u32) | meta (JSON: fragment, version, every, shapes)
#             | each mean tensor's float32 bytes (little-endian)
# Records of older servers ("DLR1", payload = torch.save(...)) are read with torch's
# weights-only loader, which runs no code.

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


@dataclass
class Restored:
    """What a state dir holds: the snapshot's state, then the log's steps after it."""

    identity: dict  # what state_identity() returned for the server that wrote it
    fingerprint: list[ParamSpec]
    fragments: list[dict]  # FragmentState.state_dict() of each fragment, in fragment order
    updates: Iterator[LogRecord]  # each the next version of its fragment; read it to the end
    settings: dict  # what the snapshot recorded of the settings ({}: nothing)
    admission: dict  # Admission.durable(): the snapshot's, updated by each record read
    rewrite: bool = False  # an older server's format: write a snapshot in this one at start


def restored_from(snapshot: dict, records: Iterator[LogRecord], where: Path) -> Restored:
    """What a snapshot and the log records after it (read lazily) restore; `where` for errors."""
    fingerprint = [ParamSpec(n, tuple(shape), d) for n, shape, d in snapshot["fingerprint"]]
    fragments = snapshot["fragments"]
    versions = [state["version"] for state in fragments]
    admission = snapshot.get("admission") or {"norms": {}, "weights": {}}
    updates = _updates(where, records, versions, admission)
    settings = snapshot.get("settings", {})
    return Restored(snapshot["layout"], fingerprint, fragments, updates, settings, admission)


def _updates(where: Path, records: Iterator[LogRecord], versions: list[int], admission: dict):
    """The log's records that follow the snapshot's `versions`, one in memory at a time;
    `admission` takes each record's (all of them: the log began with the snapshot)."""
    replayed = 0
    for record in records:
        replayed += 1
        for key, value in (record.admission or {}).items():
            admission.setdefault(key, {}).update(value)
        fid = record.fragment_id
        if not 0 <= fid < len(versions):
            raise NotFound(f"fragment {fid} does not exist")
        if record.version <= versions[fid]:
            continue  # a round closed before its fragment was written: in the snapshot
        if record.version != versions[fid] + 1:
            raise RuntimeError(
                f"{where}: a record for fragment {fid} version {record.version} does "
                f"not follow version {versions[fid]}"
            )
        yield record
        versions[fid] += 1
    log.info("restored from %s: versions %s (replayed %d records)", where, versions, replayed)
