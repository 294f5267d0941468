"""Atomic file replacement: a reader sees the old file or the new one, never half of one.

    atomic_write(path, b"bytes")                       # or a str, or a writer function:
    atomic_write(path, lambda f: torch.save(state, f))
    with atomic_path(target) as tmp:                   # for a file another program writes
        subprocess.run(["cc", "-o", str(tmp), ...], check=True)

The new content goes to a temporary file in the same directory (a rename is atomic only
within one file system), is fsynced, renamed over the target, and the directory is fsynced,
so after a crash or power cut the target holds either version in full. Every writer gets a
temporary name of its own, so two processes writing the same target do not mix their bytes.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

Content = bytes | bytearray | memoryview | str | Callable[[BinaryIO], None]


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, *, mode: int | None = None) -> Iterator[Path]:
    """A fresh temporary path next to `path`; when the block ends without an error the file
    written there is made durable and renamed over `path` (with permission bits `mode` if
    given); on an error it is removed and `path` is left as it was."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex[:12]}.tmp")
    # Created empty (honouring the umask, as open() would) so the name is ours alone.
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666 if mode is None else mode))
    try:
        yield tmp
        if mode is not None:
            os.chmod(tmp, mode)
        _fsync_path(tmp, os.O_RDONLY)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_path(target.parent, os.O_RDONLY)  # the rename itself survives a power cut


def atomic_write(path: str | os.PathLike, content: Content, *, mode: int | None = None) -> None:
    """Replace `path` with `content` atomically: bytes, text (UTF-8), or a function that
    writes to the binary file it is given (e.g. torch.save)."""
    with atomic_path(path, mode=mode) as tmp, open(tmp, "wb") as f:
        if callable(content):
            content(f)
        else:
            f.write(content.encode() if isinstance(content, str) else content)


def _fsync_path(path: Path, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
