"""A state dir that cannot be written: the record of a round that fails to be written is cut
off again and no version is made of it; the shard then takes no new versions, serves what
it has, and a restart on the same dir (the disk back) loses nothing it served.

Faults are injected in the process (an fsync that fails with EIO, a write that stops half
way with ENOSPC, a snapshot that cannot be written) where the OS cannot make them on demand.
"""

from __future__ import annotations

import errno
import os
import threading
import time

import grpc
import pytest
import torch

import common.direct_io as direct_io
import server.state.formats as formats
from common.tensor_file import TensorFileImage
from server.aggregator import Aggregator
from server.config import aggregator_config
from server.state.params import ParamSpec
from server.state.store import StateDirFailed

SPECS = [ParamSpec("blocks.0.w", (64, 33), "float32")]


def start(state_dir, **config) -> tuple[Aggregator, str]:
    settings = {"state_dir": str(state_dir), "snapshot_every_versions": 100, **config}
    agg = Aggregator(aggregator_config(**settings))
    return agg, agg.join("a", SPECS).session_id


def push(agg: Aggregator, session: str, seed: int) -> int:
    """A push, waited for as a learner waits (a round closes late while a snapshot writes its
    fragment)."""
    g = torch.Generator().manual_seed(seed)
    version = agg.push(session, 0, agg.version(0), [torch.randn(64, 33, generator=g) * 1e-2])
    assert agg.wait_for_version(0, version, timeout_s=60) == version
    return version


def log_bytes(state_dir) -> int:
    return max(state_dir.glob("updates-*.log")).stat().st_size


def fails_once(monkeypatch, name: str, err: OSError, target=os) -> None:
    """`target.name` raises `err` at its next call, then works as before."""
    real, calls = getattr(target, name), []

    def once(*args, **kwargs):
        calls.append(args)
        if len(calls) == 1:
            raise err
        return real(*args, **kwargs)

    monkeypatch.setattr(target, name, once)


def test_an_fsync_that_fails_makes_no_version_and_stops_new_ones(tmp_path, monkeypatch) -> None:
    agg, session = start(tmp_path)
    agg.initialize(session, 0, [torch.ones(64, 33)])
    assert push(agg, session, 1) == 1
    served = agg.params(0)
    logged = log_bytes(tmp_path)
    fails_once(monkeypatch, "fsync", OSError(errno.EIO, "Input/output error"))
    with pytest.raises(StateDirFailed, match=r"cannot append to .*updates-\d+.log: Input/") as err:
        push(agg, session, 2)
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    # Nothing of the failed round: no version, no record (cut off again), the log as it was.
    assert agg.version(0) == 1 and torch.equal(agg.params(0)[0], served[0])
    assert log_bytes(tmp_path) == logged
    assert "Input/output error" in agg.state_failure()
    # No new versions from now on, refused before any payload; what was served still is.
    with pytest.raises(StateDirFailed, match="takes no new versions"):
        agg.check_push(session, 0, 1)
    assert agg.pull(session, 0, -1).version == 1
    agg.checkpoint()  # at shutdown: no snapshot of a failed dir; the dir is let go
    restarted, _ = start(tmp_path)
    assert restarted.version(0) == 1 and torch.equal(restarted.params(0)[0], served[0])
    assert (
        restarted.state_failure() is None
        and push(restarted, restarted.join("a", SPECS).session_id, 3) == 2
    )


def test_a_disk_that_fills_half_way_through_a_record_leaves_no_torn_record(
    tmp_path, monkeypatch
) -> None:
    agg, session = start(tmp_path)
    agg.initialize(session, 0, [torch.ones(64, 33)])
    push(agg, session, 1)
    served, logged = agg.params(0), log_bytes(tmp_path)
    real = direct_io.pwrite_all

    def half_then_full(fd, view, offset, path) -> None:
        if view.nbytes > 1000:  # the mean's bytes: half of them land, then the disk is full
            real(fd, view[: view.nbytes // 2], offset, path)
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, view, offset, path)

    monkeypatch.setattr(direct_io, "pwrite_all", half_then_full)
    with pytest.raises(StateDirFailed, match="No space left on device"):
        push(agg, session, 2)
    assert log_bytes(tmp_path) == logged
    monkeypatch.setattr(direct_io, "pwrite_all", real)  # space is back
    agg.checkpoint()  # the server stops (no snapshot of a failed dir)
    restarted, _ = start(tmp_path)
    assert restarted.version(0) == 1 and torch.equal(restarted.params(0)[0], served[0])


def test_a_snapshot_that_cannot_be_written_keeps_the_step_it_followed(
    tmp_path, monkeypatch
) -> None:
    agg, session = start(tmp_path, snapshot_every_versions=2)
    agg.initialize(session, 0, [torch.ones(64, 33)])
    push(agg, session, 1)
    fails_once(monkeypatch, "write", OSError(errno.ENOSPC, "No space left"), TensorFileImage)
    assert push(agg, session, 2) == 2  # logged before the snapshot was due: it stands
    assert agg.wait_for_snapshot(timeout_s=60)  # written off the lock, and failed
    assert agg.version(0) == 2 and "No space left" in agg.state_failure()
    assert "snapshot-000002.tmp" in agg.state_failure()
    served = agg.params(0)
    with pytest.raises(StateDirFailed):
        push(agg, session, 3)
    agg.checkpoint()
    restarted, _ = start(tmp_path, snapshot_every_versions=2)  # old snapshot + both logs
    assert restarted.version(0) == 2 and torch.equal(restarted.params(0)[0], served[0])


def test_initial_values_that_cannot_be_made_durable_are_not_taken(tmp_path, monkeypatch) -> None:
    agg, session = start(tmp_path)
    fails_once(monkeypatch, "write", OSError(errno.EIO, "Input/output error"), TensorFileImage)
    with pytest.raises(StateDirFailed, match=r"snapshot-000001.tmp: Input/output error"):
        agg.initialize(session, 0, [torch.ones(64, 33)])
    assert agg.version(0) == -1  # another learner's offer is refused too, until a restart
    with pytest.raises(StateDirFailed):
        agg.initialize(session, 0, [torch.ones(64, 33)])


def test_an_fsync_that_takes_seconds_drops_no_live_learner(tmp_path, monkeypatch) -> None:
    """The log's fsync stalls for 4 leases while the aggregator's lock is held (the
    write-ahead record precedes the step). The other learner's heartbeats are answered
    meanwhile, so its lease never runs out because of the server's own stall."""
    agg, a = start(tmp_path, lease_s=0.5, min_contributors=1)
    b = agg.join("b", SPECS).session_id
    agg.initialize(a, 0, [torch.zeros(64, 33)])
    real, stalled = os.fsync, threading.Event()

    def slow_fsync(fd: int) -> None:
        stalled.set()
        time.sleep(2.0)
        real(fd)

    monkeypatch.setattr(formats.os, "fsync", slow_fsync)
    update = [torch.full((64, 33), 1e-3)]
    closing = threading.Thread(
        target=lambda: (agg.push(a, 0, 0, update), agg.push(b, 0, 0, update))
    )
    closing.start()
    assert stalled.wait(timeout=30)
    answered = []
    while closing.is_alive() and len(answered) < 100:  # the stall lasts 2 s: about 20
        started = time.perf_counter()
        agg.heartbeat(b, step=len(answered))
        agg.heartbeat(a, step=len(answered))
        answered.append(time.perf_counter() - started)
        time.sleep(0.1)
    closing.join(timeout=30)
    assert agg.version(0) == 1
    assert len(answered) >= 10 and max(answered) < 0.25  # half a lease
    assert agg.expire_leases() == [] and agg.live_learners() == ["a", "b"]
