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

Trimming: even with two arenas, the heap fragments. Model-sized buffers (round sums, outer
updates, snapshots) and message-sized ones (pushes, pull chunks) are made and freed by many
threads at once, and the free space between live blocks stays resident: at 64 learners
(bench/load.py, 4 MiB model) glibc held ~0.5 GB free against ~0.16 GB in use, and RSS grew
with the learners. malloc_trim(0) hands the free pages back (measured: peak RSS 664 -> 468 MB,
pushes/s unchanged) but holds the arena locks while it walks them (10-40 ms here), so it runs
once a second on its own thread: every 0.25 s gave 395 MB and cost a fifth of the push rate.
Returning every large buffer to the system instead (MALLOC_MMAP_THRESHOLD_=2 MiB) gave 420 MB
but cost a third of the push rate in page faults.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import threading

import torch

log = logging.getLogger("diloco.server")

M_ARENA_MAX = -8  # from glibc's malloc.h
DEFAULT_ARENAS = 2
DEFAULT_TRIM_INTERVAL_S = 1.0


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
    log.info("malloc: at most %d glibc arenas (bounded server memory, server/runtime.py)", arenas)
    return True


def single_threaded_torch() -> None:
    """One intra-op thread per calling thread (see the module docstring)."""
    torch.set_num_threads(1)
    log.info("torch: 1 intra-op thread per RPC thread (server/runtime.py)")


def start_malloc_trimmer(
    stop: threading.Event, interval_s: float = DEFAULT_TRIM_INTERVAL_S
) -> bool:
    """Hand glibc's free heap pages back to the system every `interval_s` until `stop` is set
    (see the module docstring); returns whether the trimmer thread was started."""
    if interval_s <= 0:
        raise ValueError(f"malloc trim interval must be > 0 s, got {interval_s}")
    libc_name, _ = platform.libc_ver()
    if libc_name != "glibc":
        log.info("malloc: libc is %s, not glibc; heap not trimmed", libc_name or "unknown")
        return False
    try:
        malloc_trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError) as err:
        log.warning("malloc: malloc_trim not found (%s); heap not trimmed", err)
        return False
    malloc_trim.argtypes, malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int

    def trim() -> None:
        while not stop.wait(interval_s):  # ctypes releases the GIL for the call
            malloc_trim(0)

    threading.Thread(target=trim, name="malloc-trim", daemon=True).start()
    log.info("malloc: free heap pages handed back every %.2f s (server/runtime.py)", interval_s)
    return True
