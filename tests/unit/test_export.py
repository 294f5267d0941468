"""diloco-export's reading and merging (server/export.py): a state dir restores to the
server's exact parameters in every mode, without being written to; dirs of shards merge by
name, and dirs that do not fit together are refused with a sentence naming the dir."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from server.aggregator import Aggregator
from server.config import aggregator_config
from server.export import ExportError, main, merge, read_state_params
from server.state.params import ParamSpec

SPECS = [ParamSpec("blocks.0.w", (8, 4), "float32"), ParamSpec("blocks.1.w", (40,), "float32")]


def trained(state_dir: Path, fragments: tuple[int, ...] = (0, 1), **config) -> Aggregator:
    """An Aggregator on `state_dir` after 5 rounds of the given fragments, not checkpointed
    (as if killed): its dir holds a snapshot and a log."""
    agg = Aggregator(aggregator_config(state_dir=str(state_dir), fragments=2, **config))
    session = agg.join("l0", SPECS).session_id
    g = torch.Generator().manual_seed(0)
    for fid in fragments:
        agg.initialize(session, fid, [torch.randn(SPECS[fid].shape, generator=g)])
    for _ in range(5):
        for fid in fragments:
            delta = torch.randn(SPECS[fid].shape, generator=g) * 0.01
            version = agg.push(session, fid, agg.version(fid), [delta], tokens=64, inner_steps=4)
            assert agg.wait_for_version(fid, version, timeout_s=60) == version
    assert agg.wait_for_snapshot(timeout_s=60)
    return agg


def named(agg: Aggregator) -> dict[str, torch.Tensor]:
    return {SPECS[fid].name: agg.params(fid)[0] for fid, _, version in agg.layout() if version >= 0}


@pytest.mark.parametrize(
    "config",
    [
        {},
        {"pull_codec": "fp32", "snapshot_every_versions": 2},
        {"mode": "quorum", "outer_momentum_warmup_rounds": 8, "outer_momentum_warmup_start": 0.2},
        {"mode": "async", "outer_lr": 0.5, "outer_momentum": 0.8},
        {"outer_state_dtype": "bfloat16", "outer_lr": 0.6},
    ],
    ids=["sync-fp4", "sync-fp32", "quorum-warmup", "async", "bfloat16-state"],
)
def test_a_state_dir_restores_to_the_servers_params(tmp_path, config) -> None:
    agg = trained(tmp_path, **config)
    log = max(tmp_path.glob("updates-*.log"))
    log.write_bytes(log.read_bytes() + b"DLR2 torn")  # a record cut short by a crash
    size = log.stat().st_size
    got = read_state_params(str(tmp_path))
    assert got.versions == [5, 5] and list(got.params) == [s.name for s in SPECS]
    for name, tensor in named(agg).items():
        assert torch.equal(got.params[name], tensor), name
    assert log.stat().st_size == size  # read only: the torn tail is skipped, not cut


def test_shards_merge_by_name_and_must_fit_together(tmp_path) -> None:
    trained(tmp_path / "s0", fragments=(0,))  # a shard that serves fragment 0 only
    trained(tmp_path / "s1", fragments=(1,))
    shard0, shard1 = (read_state_params(str(tmp_path / s)) for s in ("s0", "s1"))
    merged = merge([shard0, shard1])
    assert list(merged) == ["blocks.0.w", "blocks.1.w"]
    assert torch.equal(merged["blocks.0.w"], shard0.params["blocks.0.w"])
    with pytest.raises(ExportError, match=r"blocks\.1\.w has no values in state dir .*s0"):
        merge([shard0])
    with pytest.raises(ExportError, match=r"blocks\.0\.w is in both state dir .*s0 and .*s0"):
        merge([shard0, shard1, shard0])
    other = tmp_path / "other"
    agg = Aggregator(aggregator_config(state_dir=str(other)))
    session = agg.join("l0", [ParamSpec("w", (3,), "float32")]).session_id
    agg.initialize(session, 0, [torch.zeros(3)])
    with pytest.raises(ExportError, match=r"state dir .*other holds another model than .*s0"):
        merge([shard0, read_state_params(str(other))])


def test_unreadable_dirs_are_one_sentence(tmp_path) -> None:
    (tmp_path / "snapshot.pt").write_bytes(b"not a snapshot")
    with pytest.raises(ExportError, match="cannot read state dir"):
        read_state_params(str(tmp_path))
    (tmp_path / "snapshot.pt").unlink()
    (tmp_path / "notes.txt").write_text("")
    with pytest.raises(ExportError, match="holds no snapshot"):
        read_state_params(str(tmp_path))


def test_format_flag_overrides_the_suffix(tmp_path, capsys) -> None:
    agg = trained(tmp_path / "state")
    out = tmp_path / "model.bin"
    main(["--state-dir", str(tmp_path / "state"), "--out", str(out), "--format", "pt"])
    state_dict = torch.load(out, weights_only=True)
    assert all(torch.equal(state_dict[n], t) for n, t in named(agg).items())
    with pytest.raises(SystemExit) as exit_info:
        main(["--state-dir", str(tmp_path / "state"), "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "is a directory" in capsys.readouterr().err
