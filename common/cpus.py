"""How many CPUs this process may use, for sizing thread pools.

    threads = usable_cpus()

The smallest of the machine's cores, the process's CPU affinity and a container's CPU quota
(cgroup v2 `cpu.max`, or v1 `cpu.cfs_quota_us`), rounded up. In a pod with a CPU limit,
os.cpu_count() is the node's cores: pools sized from it oversubscribe the pod's share, and
the kernel then throttles it.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

__all__ = ["cpu_quota", "usable_cpus"]

CGROUP = Path("/sys/fs/cgroup")


def cpu_quota(quota: str, period: str) -> int | None:
    """CPUs a quota of `quota` µs every `period` µs allows, rounded up; None for no quota
    ("max" in cgroup v2, -1 in v1) or values that do not parse."""
    try:
        quota_us, period_us = int(quota), int(period)
    except ValueError:
        return None
    if quota_us <= 0 or period_us <= 0:
        return None
    return max(1, math.ceil(quota_us / period_us))


def _cgroup_quota(root: Path) -> int | None:
    try:
        return cpu_quota(*(root / "cpu.max").read_text().split()[:2])  # v2: "QUOTA PERIOD"
    except (OSError, TypeError):
        pass
    try:
        v1 = root / "cpu"
        quota = (v1 / "cpu.cfs_quota_us").read_text().strip()
        return cpu_quota(quota, (v1 / "cpu.cfs_period_us").read_text().strip())
    except OSError:
        return None


def usable_cpus(cgroup: Path = CGROUP) -> int:
    """The CPUs this process may use (at least 1)."""
    counts = [os.cpu_count() or 1]
    if hasattr(os, "sched_getaffinity"):
        counts.append(len(os.sched_getaffinity(0)))
    quota = _cgroup_quota(cgroup)
    if quota is not None:
        counts.append(quota)
    return max(1, min(counts))
