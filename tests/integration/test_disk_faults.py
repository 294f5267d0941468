"""Storage faults against a real server process: a disk that fills up (a small tmpfs), during
a log append and during a snapshot, and kill -9 in the middle of a snapshot write. In each,
nothing the shard served is lost, the error names its cause, and a restart recovers.

Mounting a tmpfs needs root: without it these tests skip, unless DILOCO_REQUIRE_TMPFS is set
(CI sets it), in which case they fail.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from common.codec.fragment import decode_fragment, encode_fragment
from common.generated.diloco.v1 import aggregator_pb2 as pb
from learner.client import AggregatorClient
from tests.support.processes import server_process

MIB = 1 << 20


def model(side: int) -> tuple[list[tuple[int, int]], list[pb.ParamSpec]]:
    shapes = [(side, side)]
    return shapes, [pb.ParamSpec(name="w", shape=shapes[0], dtype="float32")]


@pytest.fixture
def small_disk(tmp_path) -> Iterator[Path]:
    """A 24 MiB tmpfs (the bytes it takes are real: a full one refuses writes with ENOSPC)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0 or not shutil.which("mount"):
        if os.environ.get("DILOCO_REQUIRE_TMPFS"):
            pytest.fail("mounting a tmpfs needs root and mount(8)")
        pytest.skip("mounting a tmpfs needs root (CI runs these as root)")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


class Shard:
    """One server process with a state dir, a learner session on it, and what it served."""

    def __init__(self, tmp_path: Path, name: str, state_dir: Path, side: int, *flags: str):
        self.shapes, fingerprint = model(side)
        flags = ("--state-dir", str(state_dir), "--pull-codec", "fp32", "--lease-s", "60", *flags)
        self.daemon = server_process(tmp_path, name, *flags)
        self.client = AggregatorClient(f"127.0.0.1:{self.daemon.port}")
        self.client.wait_ready(30)
        self.session = self.client.join("a", fingerprint).session_id
        self.served: dict[int, list[torch.Tensor]] = {}

    def initialize(self) -> None:
        init = pb.PushHeader(session_id=self.session, kind=pb.PUSH_KIND_INITIAL, base_version=-1)
        self.client.push(init, encode_fragment([torch.ones(s) for s in self.shapes], "fp32"))

    def pull(self) -> int:
        header, payload = self.client.pull(self.session, 0, -1)
        self.served[header.version] = decode_fragment(payload, self.shapes)
        return header.version

    def round(self, seed: int) -> int:
        """One round (one live learner: its push closes it); returns the version served then."""
        base = self.pull()
        g = torch.Generator().manual_seed(seed)
        delta = [torch.randn(s, generator=g) * 1e-2 for s in self.shapes]
        header = pb.PushHeader(session_id=self.session, kind=pb.PUSH_KIND_DELTA, base_version=base)
        self.client.push(header, encode_fragment(delta, "fp32"))
        return self.pull()

    def stop(self) -> None:
        self.client.close()
        self.daemon.stop()


def rounds_until_refused(shard: Shard, limit: int) -> grpc.RpcError:
    for seed in range(limit):
        try:
            shard.round(seed)
        except grpc.RpcError as err:
            return err
    raise AssertionError(f"{limit} rounds and the disk never filled")


def fill(mount: Path, leave_bytes: int) -> Path:
    """A file taking all but `leave_bytes` of the free space."""
    stats = os.statvfs(mount)
    filler = mount / "filler"
    with open(filler, "wb") as f:
        f.write(b"\0" * (stats.f_bavail * stats.f_frsize - leave_bytes))
    return filler


@pytest.mark.parametrize("where", ["log", "snapshot"])
def test_a_full_disk_stops_new_versions_and_a_restart_with_room_loses_nothing(
    tmp_path, small_disk, where
) -> None:
    """Side 512: a log record is 1 MiB (the fp32 mean), a snapshot about 3 MiB. "log": no
    snapshot is due, the third record does not fit. "snapshot": one is due after the second
    round and does not fit beside the two records."""
    state_dir = small_disk / "state"
    every = "100" if where == "log" else "2"
    shard = Shard(tmp_path, "first", state_dir, 512, "--snapshot-every-versions", every)
    try:
        shard.initialize()
        filler = fill(small_disk, int(2.5 * MIB))
        err = rounds_until_refused(shard, 6)
        assert err.code() == grpc.StatusCode.UNAVAILABLE, err
        assert "No space left on device" in err.details() and "no new versions" in err.details()
        cause = "cannot write" if where == "snapshot" else "cannot append"
        assert cause in err.details() and str(state_dir) in err.details()
        newest = max(shard.served)
        assert newest >= 2
        assert shard.pull() == newest  # pulls go on serving the last durable version
        with pytest.raises(grpc.RpcError) as again:
            shard.round(99)
        assert again.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        shard.stop()
    assert "state dir failed" in shard.daemon.log_text() or cause in shard.daemon.log_text()
    filler.unlink()  # the disk has room again
    restarted = Shard(tmp_path, "second", state_dir, 512, "--snapshot-every-versions", every)
    try:
        assert restarted.pull() == newest
        assert torch.equal(restarted.served[newest][0], shard.served[newest][0])
        assert restarted.round(7) == newest + 1  # and takes new versions again
    finally:
        restarted.stop()


def test_kill_9_while_a_snapshot_is_written_loses_no_served_version(tmp_path) -> None:
    """Side 2048 (16 MiB of parameters, about 50 MiB a snapshot): a watcher kills the server
    as soon as a snapshot's .tmp dir appears, while rounds go on; the restart removes the
    .tmp dir and replays the snapshot before it and the logs."""
    state_dir = tmp_path / "state"
    shard = Shard(tmp_path, "first", state_dir, 2048, "--snapshot-every-versions", "2")
    caught: list[bool] = []

    def kill_mid_snapshot() -> None:
        deadline = time.monotonic() + 120  # bounded, as every fault loop
        while time.monotonic() < deadline and shard.daemon.running():
            if list(state_dir.glob("snapshot-*.tmp")):
                shard.daemon.kill()
                caught.append(bool(list(state_dir.glob("snapshot-*.tmp"))))
                return
            time.sleep(0.001)

    try:
        shard.initialize()  # its snapshot is written before the watcher starts
        watcher = threading.Thread(target=kill_mid_snapshot)
        watcher.start()
        with pytest.raises(grpc.RpcError):
            for seed in range(200):
                shard.round(seed)
        watcher.join(timeout=130)
    finally:
        shard.client.close()
        shard.daemon.stop()
    assert caught == [True], "no snapshot was caught half written"
    newest = max(shard.served)
    restarted = Shard(tmp_path, "second", state_dir, 2048)
    try:
        assert not list(state_dir.glob("snapshot-*.tmp"))
        assert restarted.pull() >= newest
        if max(restarted.served) == newest:
            assert torch.equal(restarted.served[newest][0], shard.served[newest][0])
    finally:
        restarted.stop()
