"""The state dir's snapshot format: safetensors for tensors, JSON for the rest (the log's
records: log_records.py).

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

import itertools
import json
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from common.atomic import atomic_write
from common.checksum import crc32
from common.direct_io import PagePool, write_parts
from common.errors import NotFound
from common.tensor_file import TensorFileImage
from server.state.log_records import LogRecord
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


def image_bytes(state: dict) -> int:
    """The size of the image prepare_fragment(state) builds (nothing copied)."""
    tensors: dict[str, torch.Tensor] = {}
    _split(state, tensors, [])
    return TensorFileImage.size_of(tensors)


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
