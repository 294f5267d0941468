"""What the benchmarks read of a process from Linux's /proc: memory and CPU time.

    rss_mb(pid)          # resident now (VmRSS)
    peak_rss_mb(pid)     # peak resident (VmHWM; of this process image, unlike ru_maxrss)
    cpu_s(pid)           # user + system CPU seconds so far
    field_kib("/proc/meminfo", "MemAvailable")

A field that is absent reads as NaN, so that a figure on a system without it shows as
missing rather than as zero.
"""

from __future__ import annotations

import os
from pathlib import Path


def field_kib(path: str, key: str) -> float:
    """A `key: N kB` line of a /proc file (VmRSS in /proc/PID/status, MemAvailable...)."""
    for line in Path(path).read_text().splitlines():
        if line.startswith(key + ":"):
            return float(line.split()[1])
    return float("nan")


def rss_mb(pid: int | str = "self") -> float:
    return field_kib(f"/proc/{pid}/status", "VmRSS") / 1024


def peak_rss_mb(pid: int | str = "self") -> float:
    """Not ru_maxrss: Linux carries that across fork and exec, so a child started by a large
    parent reports the parent's peak; VmHWM belongs to this process image."""
    return field_kib(f"/proc/{pid}/status", "VmHWM") / 1024


def cpu_s(pid: int | str = "self") -> float:
    """utime + stime, from /proc/PID/stat (after the command name, which may hold spaces)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
