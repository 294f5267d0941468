"""Thread pools are sized from the CPUs a process may use: a container's CPU quota counts,
not only the node's cores (common/cpus.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from common.cpus import cpu_quota, usable_cpus


@pytest.mark.parametrize(
    "quota, period, cpus",
    [("200000", "100000", 2), ("150000", "100000", 2), ("50000", "100000", 1),
     ("max", "100000", None), ("-1", "100000", None), ("100000", "0", None)],
)  # fmt: skip
def test_a_quota_is_its_cpus_rounded_up(quota: str, period: str, cpus: int | None) -> None:
    assert cpu_quota(quota, period) == cpus


def machine_cpus() -> int:
    return min(os.cpu_count() or 1, len(os.sched_getaffinity(0)))


def test_a_cgroup_v2_limit_caps_the_count(tmp_path: Path) -> None:
    (tmp_path / "cpu.max").write_text("100000 100000\n")
    assert usable_cpus(tmp_path) == 1
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert usable_cpus(tmp_path) == machine_cpus()


def test_a_cgroup_v1_limit_caps_the_count(tmp_path: Path) -> None:
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("100000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert usable_cpus(tmp_path) == 1


def test_no_cgroup_files_mean_the_machines_cpus(tmp_path: Path) -> None:
    assert usable_cpus(tmp_path / "absent") == machine_cpus() >= 1
