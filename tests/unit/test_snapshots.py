"""Snapshots: copied and written off the lock a fragment at a time, safetensors and JSON with
checksums, a torn or corrupt newest one passed over for the one before it, one killed half
way harmless, no pickle read, one server per state dir, an older server's dir rewritten."""

from __future__ import annotations

import logging
import os
import shutil
import threading
from pathlib import Path

import pytest
import torch

import server.state.store as store_module
from server.aggregator import Aggregator
from server.config import aggregator_config
from server.state.formats import SnapshotError, read_snapshot
from server.state.params import ParamSpec

SPECS = [ParamSpec("blocks.0.w", (8, 4), "float32"), ParamSpec("blocks.1.w", (40,), "float32")]
WAIT_S = 30  # a bound on each wait; the tests end in well under a second


def start(state_dir: Path | None, **config) -> tuple[Aggregator, str]:
    settings = {"state_dir": str(state_dir or ""), "fragments": 2, **config}
    agg = Aggregator(aggregator_config(**settings))
    return agg, agg.join("l0", SPECS).session_id


def delta(fid: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(SPECS[fid].shape, generator=g) * 0.01]


def rounds(agg: Aggregator, session: str, seeds: range, initialize: bool = False) -> None:
    """Both fragments through the rounds of `seeds`, each push waited for."""
    if initialize:
        for fid in (0, 1):
            agg.initialize(session, fid, [torch.ones(SPECS[fid].shape)])
    for seed in seeds:
        for fid in (0, 1):
            version = agg.push(session, fid, agg.version(fid), delta(fid, seed))
            assert agg.wait_for_version(fid, version, WAIT_S) == version
    assert agg.wait_for_snapshot(WAIT_S)


def kill(agg: Aggregator) -> None:
    """As if the process died: nothing more is written and the dir is free for the next."""
    with agg._cond:
        agg._store.close()


def assert_same(a: Aggregator, b: Aggregator) -> None:
    for fid in (0, 1):
        assert a.version(fid) == b.version(fid)
        assert all(torch.equal(x, y) for x, y in zip(a.params(fid), b.params(fid), strict=True))


class HeldWrite:
    """Holds a snapshot's write of one fragment until `release()`: what the server does
    meanwhile is the test."""

    def __init__(self, monkeypatch, fragment: int) -> None:
        self.entered, self._release = threading.Event(), threading.Event()
        real = store_module.write_fragment

        def held(directory, index, state, pool=None):
            if index == fragment:
                self.entered.set()
                self._release.wait(WAIT_S)
            return real(directory, index, state, pool)

        monkeypatch.setattr(store_module, "write_fragment", held)

    def release(self) -> None:
        self._release.set()


def test_the_server_goes_on_while_a_snapshot_is_written(tmp_path, monkeypatch) -> None:
    """A fragment is copied under the lock and written off it: while its bytes are written,
    heartbeats and pulls answer and every fragment's rounds close, the one being written
    included. The snapshot holds the versions it copied; a restart replays the rest."""
    agg, s = start(tmp_path, snapshot_every_versions=2)
    reference, r = start(None)
    rounds(agg, s, range(1), initialize=True)
    rounds(reference, r, range(4), initialize=True)
    held = HeldWrite(monkeypatch, fragment=0)
    agg.push(s, 0, 1, delta(0, 1))
    agg.push(s, 1, 1, delta(1, 1))  # a snapshot is due
    assert held.entered.wait(WAIT_S)
    assert agg.heartbeat(s, step=10) == ([2, 2], 1)
    assert agg.pull(s, 0, 1).version == 2
    for seed in (2, 3):
        for fid in (0, 1):
            assert agg.push(s, fid, seed, delta(fid, seed)) == seed + 1
            assert agg.version(fid) == seed + 1  # closed at once, mid-write
    held.release()
    assert agg.wait_for_snapshot(WAIT_S)
    assert_same(agg, reference)
    written = read_snapshot(max(tmp_path.glob("snapshot-*")))
    # Fragment 0 as copied before its write was held; fragment 1 as copied while it was
    # held, before or after some of its rounds here (the copy runs beside them).
    versions = [f["version"] for f in written["fragments"]]
    assert versions[0] == 2 and 2 <= versions[1] <= 4
    kill(agg)
    restarted, _ = start(tmp_path, snapshot_every_versions=2)
    assert_same(restarted, reference)


def two_snapshots(tmp_path: Path) -> tuple[Aggregator, list[Path]]:
    """A reference after 4 rounds, and a killed server's dir: its two newest snapshots (the
    older ones are gone), oldest first, and the logs from the older one on."""
    agg, s = start(tmp_path, snapshot_every_versions=2)
    rounds(agg, s, range(4), initialize=True)
    kill(agg)
    kept = sorted(tmp_path.glob("snapshot-*"))
    assert len(kept) == 2
    reference, r = start(None)
    rounds(reference, r, range(4), initialize=True)
    return reference, kept


@pytest.mark.parametrize("damage", ["truncated", "flipped byte", "no manifest entry"])
def test_a_damaged_newest_snapshot_gives_way_to_the_one_before(tmp_path, caplog, damage) -> None:
    reference, (_, newest) = two_snapshots(tmp_path)
    tensors = newest / "fragment-0.safetensors"
    data = bytearray(tensors.read_bytes())
    if damage == "truncated":
        tensors.write_bytes(data[: len(data) // 2])
    elif damage == "flipped byte":
        data[-5] ^= 0x40  # in the tensors' bytes, past the header
        tensors.write_bytes(bytes(data))
    else:
        (newest / "manifest.json").write_text('{"format": "diloco-state-snapshot"}')
    with pytest.raises(SnapshotError) as err:
        read_snapshot(newest)
    named = "manifest.json" if damage == "no manifest entry" else "fragment-0.safetensors"
    assert named in str(err.value)
    with caplog.at_level(logging.WARNING):
        restarted, _ = start(tmp_path, snapshot_every_versions=2)
    assert named in caplog.text and "restoring from the snapshot before it" in caplog.text
    assert_same(restarted, reference)
    assert newest.with_name(newest.name + ".bad").is_dir()  # kept for a look, out of the way


def test_a_dir_without_a_readable_snapshot_is_refused_naming_each(tmp_path) -> None:
    _, kept = two_snapshots(tmp_path)
    for snapshot in kept:
        (snapshot / "fragment-0.safetensors").write_bytes(b"torn")
    with pytest.raises(SnapshotError) as err:
        start(tmp_path)
    assert all(snapshot.name in str(err.value) for snapshot in kept)


def test_a_snapshot_killed_half_way_loses_nothing(tmp_path, monkeypatch) -> None:
    """What kill -9 leaves while fragment 1 is written: fragment 0's file in snapshot-n.tmp
    and the new log. The copy of the dir at that moment restarts with every version."""
    agg, s = start(tmp_path / "live", snapshot_every_versions=2)
    rounds(agg, s, range(1), initialize=True)
    held = HeldWrite(monkeypatch, fragment=1)
    agg.push(s, 0, 1, delta(0, 1))
    agg.push(s, 1, 1, delta(1, 1))
    assert held.entered.wait(WAIT_S)
    assert agg.push(s, 0, 2, delta(0, 2)) == 3 and agg.version(0) == 3  # into the new log
    shutil.copytree(tmp_path / "live", tmp_path / "killed", ignore=shutil.ignore_patterns("lock"))
    held.release()
    [half] = (tmp_path / "killed").glob("snapshot-*.tmp")
    assert sorted(p.name for p in half.iterdir()) == [
        "fragment-0.safetensors",
        "fragment-0.updates",
    ]
    reference, r = start(None)
    rounds(reference, r, range(2), initialize=True)
    reference.push(r, 0, 2, delta(0, 2))
    restarted, _ = start(tmp_path / "killed", snapshot_every_versions=2)
    assert [restarted.version(0), restarted.version(1)] == [3, 2]
    assert_same(restarted, reference)
    assert not half.exists()


def test_a_snapshot_holds_no_pickle_and_an_older_pickle_runs_no_code(tmp_path) -> None:
    agg, s = start(tmp_path / "state")
    rounds(agg, s, range(1), initialize=True)
    agg.checkpoint()
    snapshot = max((tmp_path / "state").glob("snapshot-*"))
    assert sorted(p.suffix for p in snapshot.iterdir()) == [
        ".json",
        ".safetensors",
        ".safetensors",
        ".updates",
        ".updates",
    ]
    marker = tmp_path / "ran"

    class Payload:  # what a pickle can make torch.load run
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    hostile = tmp_path / "hostile"
    hostile.mkdir()
    torch.save({"fingerprint": [], "layout": {}, "fragments": [Payload()]}, hostile / "snapshot.pt")
    with pytest.raises(SnapshotError, match=r"snapshot\.pt: unreadable"):
        start(hostile)
    assert not marker.exists()


def test_one_server_per_state_dir(tmp_path) -> None:
    agg, _ = start(tmp_path)
    with pytest.raises(ValueError, match="in use by another server"):
        start(tmp_path)
    agg.checkpoint()  # stopped: the dir is free
    start(tmp_path)


def test_an_older_servers_state_dir_is_read_and_rewritten(tmp_path) -> None:
    """snapshot.pt (torch.save of the same fields) and updates.log: read with torch's
    weights-only loader, replayed, and rewritten as snapshot-000001."""
    agg, s = start(tmp_path / "new", snapshot_every_versions=4)
    rounds(agg, s, range(3), initialize=True)  # a snapshot after round 1; round 2 logged
    kill(agg)
    newest = max((tmp_path / "new").glob("snapshot-*"))
    snapshot = read_snapshot(newest)  # each fragment as it was when written
    older = tmp_path / "older"
    older.mkdir()
    fields = ("fingerprint", "layout", "fragments")
    torch.save({k: snapshot[k] for k in fields}, older / "snapshot.pt")
    shutil.copy(newest.parent / f"updates-{newest.name[-6:]}.log", older / "updates.log")
    reference, r = start(None)
    rounds(reference, r, range(3), initialize=True)
    restarted, _ = start(older)
    assert_same(restarted, reference)
    assert not (older / "snapshot.pt").exists() and not (older / "updates.log").exists()
    assert (older / "snapshot-000001" / "manifest.json").exists()


def test_a_snapshot_copies_each_fragment_without_the_aggregators_lock(
    tmp_path, monkeypatch
) -> None:
    """Each copy takes only its fragment's state lock: while another caller holds the
    aggregator's lock (a round's close, for seconds at real size), a snapshot still copies
    every fragment."""
    agg, s = start(tmp_path, snapshot_every_versions=2)
    rounds(agg, s, range(1), initialize=True)
    first_copy, go = threading.Event(), threading.Event()
    real = store_module.prepare_fragment

    def waits_once(state, pool=None):
        if not first_copy.is_set():
            first_copy.set()
            go.wait(WAIT_S)
        return real(state, pool)

    monkeypatch.setattr(store_module, "prepare_fragment", waits_once)
    held = HeldWrite(monkeypatch, fragment=1)  # reached once both fragments are copied
    agg.push(s, 0, 1, delta(0, 1))
    agg.push(s, 1, 1, delta(1, 1))  # a snapshot is due
    assert first_copy.wait(WAIT_S)
    acquired = agg._cond.acquire(timeout=2)
    try:
        go.set()
        assert acquired, "the snapshot's copy held the aggregator's lock"
        assert held.entered.wait(WAIT_S)  # both copied while this thread held the lock
    finally:
        if acquired:
            agg._cond.release()
        held.release()
    assert agg.wait_for_snapshot(WAIT_S)
    kill(agg)
    restarted, _ = start(tmp_path, snapshot_every_versions=2)
    assert [restarted.version(f) for f in (0, 1)] == [2, 2]


def test_initial_values_wait_for_a_snapshot_being_written(tmp_path, monkeypatch) -> None:
    """Taking a fragment's initial values snapshots them before anyone may pull them; with a
    snapshot being written, that waits for it, and until then the fragment has no version."""
    agg, s = start(tmp_path, snapshot_every_versions=2)
    agg.initialize(s, 0, [torch.ones(SPECS[0].shape)])
    held = HeldWrite(monkeypatch, fragment=0)
    for seed in range(2):  # fragment 0's rounds alone: a snapshot is due after the second
        agg.push(s, 0, seed, delta(0, seed))
    assert held.entered.wait(WAIT_S)
    offer = threading.Thread(target=agg.initialize, args=(s, 1, [torch.ones(SPECS[1].shape)]))
    offer.start()
    offer.join(0.3)
    assert offer.is_alive() and agg.version(1) == -1  # waiting, not taken
    held.release()
    offer.join(WAIT_S)
    assert agg.version(1) == 0
    assert agg.wait_for_snapshot(WAIT_S)
    kill(agg)
    restarted, _ = start(tmp_path, snapshot_every_versions=2)
    assert [restarted.version(f) for f in (0, 1)] == [2, 0]


def test_each_snapshot_is_one_line_with_its_path_versions_and_seconds(tmp_path, caplog) -> None:
    agg, session = start(tmp_path / "state")
    with caplog.at_level(logging.INFO, "server.state.store"):
        rounds(agg, session, range(2), initialize=True)
        agg.checkpoint()  # as at shutdown
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("snapshot")]
    last = lines[-1].split(", in ")
    assert last[0] == (
        f"snapshot written to {tmp_path / 'state'}/snapshot-{len(lines):06d}: "
        "fragment versions {0: 2, 1: 2}"
    )
    assert last[1].endswith(" s") and float(last[1][:-2]) >= 0
