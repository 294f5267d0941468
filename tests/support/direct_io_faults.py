"""Filesystems that do not take O_DIRECT, faked in the process for common/direct_io.py's
writers: one refuses it at open (tmpfs), one at the write itself (some FUSE and overlay
mounts). Each also forgets which filesystems refused it before."""

from __future__ import annotations

import errno
import fcntl
import os

import common.direct_io as direct_io


def refuse_at_open(monkeypatch) -> None:
    real_open = os.open

    def no_direct(path, flags, *args):
        if flags & direct_io.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(direct_io.os, "open", no_direct)
    monkeypatch.setattr(direct_io, "_direct_refused", set())


def refuse_at_write(monkeypatch) -> None:
    real_write = os.pwrite

    def refuses_direct(fd, data, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & direct_io.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data, offset)

    monkeypatch.setattr(direct_io.os, "pwrite", refuses_direct)
    monkeypatch.setattr(direct_io, "_direct_refused", set())
