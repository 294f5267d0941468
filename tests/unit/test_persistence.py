"""The state directory: restart resumes every version with its optimizer state; a torn or
corrupt log tail is detected and dropped, never loaded blindly. A restart here follows
`kill`: the old server writes nothing more (no final snapshot) and lets the dir go."""

import io
import logging
import struct
import zlib
from pathlib import Path

import pytest
import torch

from server.aggregator import Aggregator
from server.config import aggregator_config
from server.state.log_records import LogRecord
from server.state.params import ParamSpec
from server.state.store import StateStore, read_state_dir

SPECS = [ParamSpec("blocks.0.w", (8, 4), "float32"), ParamSpec("blocks.1.w", (40,), "float32")]


def delta(seed: int) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(8, 4, generator=g) * 0.01], [torch.randn(40, generator=g) * 0.01]]


def start(state_dir, **config) -> tuple[Aggregator, str]:
    """A server on `state_dir` (None: in memory, the reference a restarted one must equal)."""
    dirs = {"state_dir": str(state_dir or "")}
    agg = Aggregator(aggregator_config(**dirs, fragments=2, **config))
    return agg, agg.join("l0", SPECS).session_id


def kill(agg: Aggregator) -> None:
    """As if the process died: nothing more is written and the dir is free for the next."""
    assert agg.wait_for_snapshot(timeout_s=60)
    with agg._cond:
        agg._store.close()


def initialize_both(agg: Aggregator, session: str) -> None:
    agg.initialize(session, 0, [torch.ones(8, 4)])
    agg.initialize(session, 1, [torch.ones(40)])


def run_rounds(agg: Aggregator, session: str, rounds: range) -> None:
    """One push to each fragment per round, each waited for as a learner does (a round
    closes late while a snapshot writes its fragment)."""
    for r in rounds:
        for fid, tensors in enumerate(delta(r)):
            version = agg.push(session, fid, agg.version(fid), tensors)
            assert agg.wait_for_version(fid, version, timeout_s=60) == version


def state(agg: Aggregator) -> list[list[torch.Tensor]]:
    return [agg.params(fid) for fid in (0, 1)]


def assert_same(got: list[list[torch.Tensor]], want: list[list[torch.Tensor]]) -> None:
    for a, b in zip(got, want, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def newest_log(state_dir: Path) -> Path:
    return max(state_dir.glob("updates-*.log"))


@pytest.mark.parametrize("pull_codec", ["fp4_e2m1", "fp32", "sparse_2bit"])
@pytest.mark.parametrize("snapshot_every", [1, 4, 100])
@pytest.mark.parametrize("warmup_rounds", [0, 12])  # 12: killed mid momentum warm-up
def test_restart_resumes_exactly_where_it_stopped(
    tmp_path, pull_codec, snapshot_every, warmup_rounds
) -> None:
    config = {
        "pull_codec": pull_codec,
        "snapshot_every_versions": snapshot_every,
        "outer_momentum_warmup_rounds": warmup_rounds,
    }
    agg, s = start(tmp_path, **config)
    reference, r = start(None, **config)
    for server, session in ((agg, s), (reference, r)):
        initialize_both(server, session)
        run_rounds(server, session, range(7))
    kill(agg)
    restarted, s2 = start(tmp_path, **config)
    assert [restarted.version(f) for f in (0, 1)] == [7, 7]
    assert_same(state(restarted), state(reference))
    # ... continues exactly as the original would: momentum and residual came back too.
    run_rounds(reference, r, range(7, 10))
    run_rounds(restarted, s2, range(7, 10))
    assert_same(state(restarted), state(reference))
    # And pulls of the 4-bit or sparse chain still work across the restart, byte for byte:
    # learners that pulled from the first server continue bit-identical.
    assert restarted.pull(s2, 0, 8).version == 10
    assert restarted.pull(s2, 0, 8).payload == reference.pull(r, 0, 8).payload


@pytest.mark.parametrize("snapshot_every", [1, 100])  # restored from a snapshot; replayed
@pytest.mark.parametrize("pull_codec", ["fp4_e2m1", "fp32"])  # fp32: every bit of θ shows
def test_bfloat16_outer_state_resumes_exactly_and_a_change_of_dtype_converts(
    tmp_path, caplog, snapshot_every, pull_codec
) -> None:
    same = {"snapshot_every_versions": snapshot_every, "pull_codec": pull_codec}
    compact = {"outer_state_dtype": "bfloat16", **same}
    agg, s = start(tmp_path / "a", **compact)
    reference, r = start(None, **compact)
    for server, session in ((agg, s), (reference, r)):
        initialize_both(server, session)
        run_rounds(server, session, range(7))
    kill(agg)
    restarted, s2 = start(tmp_path / "a", **compact)
    run_rounds(reference, r, range(7, 10))
    run_rounds(restarted, s2, range(7, 10))
    assert_same(state(restarted), state(reference))
    held = restarted._params.fragment(0)
    assert held.outer.momentum_buffers[0].dtype == torch.bfloat16
    assert (
        held._residual is None
        if pull_codec == "fp32"
        else held._residual[0].dtype == torch.bfloat16
    )
    # A float32 state dir taken up with bfloat16 (killed each time, never checkpointed):
    # the log replays in the dtype it was made in, every served version comes back exactly,
    # and the state is kept in bfloat16 from then on, which the log says.
    float32 = {"outer_state_dtype": "float32", **same}
    exact, s3 = start(tmp_path / "b", **float32)
    initialize_both(exact, s3)
    run_rounds(exact, s3, range(10))
    assert exact._params.fragment(0).outer.momentum_buffers[0].dtype == torch.float32
    kill(exact)
    with caplog.at_level(logging.WARNING, logger="server.state.params"):
        converted, s4 = start(tmp_path / "b", **compact)
    assert "converted to bfloat16" in caplog.text
    assert_same(state(converted), state(exact))
    assert converted._params.fragment(0).outer.momentum_buffers[0].dtype == torch.bfloat16
    run_rounds(converted, s4, range(10, 14))
    kill(converted)
    again, _ = start(tmp_path / "b", **compact)
    assert [again.version(f) for f in (0, 1)] == [14, 14]
    assert_same(state(again), state(converted))
    kill(again)
    back, _ = start(tmp_path / "b", **float32)
    assert_same(state(back), state(converted))


def test_torn_tail_is_dropped_and_the_log_truncated(tmp_path, caplog) -> None:
    agg, s = start(tmp_path)
    initialize_both(agg, s)
    run_rounds(agg, s, range(3))  # 6 records
    kill(agg)
    log_path = newest_log(tmp_path)
    data = log_path.read_bytes()
    log_path.write_bytes(data[:-10])  # the last record torn mid-write
    restarted, _ = start(tmp_path)
    assert [restarted.version(0), restarted.version(1)] == [3, 2]
    assert "torn or corrupt tail" in caplog.text
    assert log_path.stat().st_size < len(data) - 10  # truncated to the good prefix


def test_corrupt_record_ends_the_replay(tmp_path) -> None:
    agg, s = start(tmp_path)
    initialize_both(agg, s)
    run_rounds(agg, s, range(3))
    kill(agg)
    log_path = newest_log(tmp_path)
    data = bytearray(log_path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # flip a byte in the middle record's payload
    log_path.write_bytes(bytes(data))
    restarted, _ = start(tmp_path)
    versions = [restarted.version(0), restarted.version(1)]
    assert sum(versions) < 6 and min(versions) >= 1  # the prefix before the flip survives


def test_state_dir_refuses_other_settings(tmp_path) -> None:
    agg, s = start(tmp_path)
    agg.initialize(s, 0, [torch.ones(8, 4)])
    kill(agg)
    with pytest.raises(ValueError, match="was written with"):
        Aggregator(aggregator_config(state_dir=str(tmp_path), fragments=1))


def test_state_dir_refuses_another_sparse_fraction(tmp_path) -> None:
    agg, s = start(tmp_path, pull_codec="sparse_2bit", pull_topk_fraction=1 / 64)
    agg.initialize(s, 0, [torch.ones(8, 4)])
    kill(agg)
    with pytest.raises(ValueError, match="pull_topk_fraction"):
        start(tmp_path, pull_codec="sparse_2bit", pull_topk_fraction=1 / 32)


def test_a_record_in_both_a_snapshot_and_its_log_is_replayed_once(tmp_path) -> None:
    """A round that closes after the snapshot's log began but before its fragment was
    written is in both: replay skips the versions the snapshot holds."""
    agg, s = start(tmp_path)
    initialize_both(agg, s)
    run_rounds(agg, s, range(3))
    old_log = newest_log(tmp_path).read_bytes()
    agg.checkpoint()  # snapshot at versions (3, 3), and a new empty log after it
    newest_log(tmp_path).write_bytes(old_log)  # as if those rounds had closed meanwhile
    restarted, _ = start(tmp_path)
    assert [restarted.version(0), restarted.version(1)] == [3, 3]
    assert_same(state(restarted), state(agg))


def test_records_keep_async_momentum_every_and_old_records_still_load(tmp_path) -> None:
    store = StateStore(tmp_path)
    mean = [torch.randn(3, 5), torch.randn(0), torch.randn(7)]
    store.append(LogRecord(1, 4, mean, outer_every=3))
    # A record as written before raw records (torch.save payload, magic DLR1).
    buffer = io.BytesIO()
    torch.save({"fragment": 0, "version": 9, "mean": mean[:1]}, buffer)
    payload = buffer.getvalue()
    with open(store.log_path, "ab") as f:
        f.write(struct.pack("<4sQI", b"DLR1", len(payload), zlib.crc32(payload)) + payload)
    raw, old = list(store.replay(0))
    assert (raw.fragment_id, raw.version, raw.outer_every) == (1, 4, 3)
    assert all(torch.equal(a, b) for a, b in zip(raw.mean, mean, strict=True))
    assert (old.fragment_id, old.version, old.outer_every) == (0, 9, 0)
    assert torch.equal(old.mean[0], mean[0])


def test_a_record_claiming_more_bytes_than_the_file_holds_is_a_torn_tail(tmp_path) -> None:
    store = StateStore(tmp_path)
    store.append(LogRecord(0, 1, [torch.ones(4)]))
    store.close()
    good = store.log_path.stat().st_size
    with open(store.log_path, "ab") as f:  # a header announcing 1 TB, then nothing
        f.write(struct.pack("<4sQI", b"DLR2", 1 << 40, 0))
    assert [r.version for r in store.replay(0)] == [1]
    assert store.log_path.stat().st_size == good


def test_a_snapshot_from_before_the_warmup_resumes_past_it_and_the_config_wins() -> None:
    """An old snapshot has no step count: it took one outer step per version. The warm-up's
    settings come from the config, whatever the snapshot says."""
    from server.rounds.outer import NesterovOuter
    from server.state.fragment import FragmentState

    def fragment(warmup_rounds: int) -> FragmentState:
        outer = NesterovOuter(warmup_rounds=warmup_rounds)
        return FragmentState(0, [0], [(40,)], outer, "fp32", 16)

    old = fragment(warmup_rounds=0)
    old.initialize([torch.ones(40)])
    for r in range(5):
        old.apply_mean(delta(r)[1])
    state = old.state_dict()
    for name in ("steps_taken", "warmup_rounds", "warmup_start"):
        del state["outer"][name]  # a snapshot without the warm-up's fields
    resumed = fragment(warmup_rounds=20)
    resumed.load_state_dict(state)
    assert resumed.outer.steps_taken == 5 and resumed.outer.warmup_rounds == 20
    new_state = fragment(warmup_rounds=3)
    new_state.load_state_dict(old.state_dict())  # a snapshot saying warmup_rounds=0
    assert new_state.outer.warmup_rounds == 3 and new_state.outer.steps_taken == 5


def test_a_server_killed_before_each_snapshot_still_compacts_its_log(tmp_path) -> None:
    """Rounds replayed at a restart count towards the next snapshot: a server killed every
    few rounds, never closing snapshot_every_versions rounds in one life, still snapshots,
    so each restart replays at most that many records."""
    agg, s = start(tmp_path, snapshot_every_versions=8)
    initialize_both(agg, s)
    replayed = []
    for life in range(6):  # 3 rounds of 2 fragments each life, then killed (no checkpoint)
        run_rounds(agg, s, range(3 * life, 3 * life + 3))
        kill(agg)
        replayed.append(sum(1 for _ in read_state_dir(tmp_path).updates))
        agg, s = start(tmp_path, snapshot_every_versions=8)
        assert [agg.version(0), agg.version(1)] == [3 * life + 3] * 2
    assert max(replayed) <= 8


def test_a_snapshot_whose_outer_lr_follows_a_schedule_is_refused() -> None:
    """This server's outer lr is constant: a state dir whose optimizer followed a schedule
    would step differently after a restart, so it is refused with what to do."""
    from server.rounds.outer import NesterovOuter

    state = {**vars(NesterovOuter()), "lr_schedule": "cosine", "lr_schedule_rounds": 10}
    with pytest.raises(ValueError, match="outer_lr_schedule cosine.*diloco-export"):
        NesterovOuter().restore(state, version=3)
    constant = {**vars(NesterovOuter(lr=0.5)), "lr_schedule": "constant"}
    restored = NesterovOuter()
    restored.restore(constant, version=3)
    assert restored.lr == 0.5 and not hasattr(restored, "lr_schedule")
