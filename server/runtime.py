"""Process-wide settings of the server: a few glibc malloc arenas, one torch thread per call.

Why (bench/load.py, 64 learners, 4 MiB model): glibc gives threads that contend for malloc
their own arena, up to 8 per core, and an arena keeps the memory freed into it. The server
runs a thread per RPC (a few hundred), and every push and pull allocates and frees buffers of
about a payload (gRPC messages, protobuf copies, decode chunks), so freed memory piled up in
many arenas: peak RSS 1.1 GB with the streaming ingest of server/ingest.py, 0.6 GB with two
arenas, at the same push rate. Forcing those buffers out to mmap instead
(MALLOC_MMAP_THRESHOLD_=131072) bounds memory too but cost 60% of the push rate here: every
buffer then costs page faults, which are slow in a VM.

Torch threads: the server's parallelism is its concurrent pushes (server/ingest.py slots), and
each RPC thread that enters an OpenMP region gets its own team of workers. With a busy CPU a
team waits for preempted workers at every barrier: the ingest of a 4 M-value fp4 push took
68 ms with 2 torch threads and 20 ms with 1 here (load average 6 on 2 cores).

An explicit MALLOC_ARENA_MAX in the environment wins (glibc has already applied it); on a
libc other than glibc nothing is changed and a log line says so.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

import torch

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


def single_threaded_torch() -> None:
    """One intra-op thread per calling thread (see the module docstring)."""
    torch.set_num_threads(1)
    log.info("torch: 1 intra-op thread per RPC thread (server/runtime.py)")
