"""glibc malloc settings for the server process: a small, fixed number of malloc arenas.

Why (bench/load.py, 64 learners, 4 MiB model): glibc gives threads that contend for malloc
their own arena, up to 8 per core, and an arena keeps the memory freed into it. The server
runs a thread per RPC (a few hundred), and every push and pull allocates and frees buffers of
about a payload (gRPC messages, protobuf copies, decode chunks), so freed memory piled up in
many arenas: peak RSS 1.1 GB with the streaming ingest of server/ingest.py, 0.6 GB with two
arenas, at the same push rate. Forcing those buffers out to mmap instead
(MALLOC_MMAP_THRESHOLD_=131072) bounds memory too but cost 60% of the push rate here: every
buffer then costs page faults, which are slow in a VM.

An explicit MALLOC_ARENA_MAX in the environment wins (glibc has already applied it); on a
libc other than glibc nothing is changed and a log line says so.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

log = logging.getLogger("diloco.server")

M_ARENA_MAX = -8  # from glibc's malloc.h
DEFAULT_ARENAS = 2


def limit_malloc_arenas(arenas: int = DEFAULT_ARENAS) -> bool:
    """Cap glibc's malloc arenas at `arenas`; returns whether the cap was set by this call."""
    if "MALLOC_ARENA_MAX" in os.environ:
        log.info("malloc: MALLOC_ARENA_MAX=%s from the environment", os.environ["MALLOC_ARENA_MAX"])
        return False
    libc_name, _ = platform.libc_ver()
    if libc_name != "glibc":
        log.info("malloc: libc is %s, not glibc; arena limit not set", libc_name or "unknown")
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError) as err:
        log.warning("malloc: mallopt not found (%s); arena limit not set", err)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if mallopt(M_ARENA_MAX, arenas) != 1:
        log.warning("malloc: mallopt(M_ARENA_MAX, %d) failed; arena limit not set", arenas)
        return False
    log.info("malloc: at most %d glibc arenas (bounded server memory, server/memory.py)", arenas)
    return True
