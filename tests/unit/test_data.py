"""Corpus inputs and the sharded, restorable sampler (learner/data.py)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from common.config import build_config
from learner.config import LearnerConfig
from learner.data import TEXT_SUFFIXES, ShardedSampler, load_corpus, text_files

T = 8


def windows_of(sampler: ShardedSampler, batches: int) -> list[int]:
    """Window indices drawn (the tokens are 0..N-1, so a row's first token names its window)."""
    drawn = []
    for _ in range(batches):
        x, y = sampler.next()
        assert torch.equal(x[:, 1:], y[:, :-1])  # y is x shifted by one token
        drawn += (x[:, 0] // T).tolist()
    return drawn


def test_shards_are_disjoint_and_together_cover_every_window() -> None:
    tokens = torch.arange(T * 60 + 1)
    samplers = [ShardedSampler(tokens, 3, T, seed=5, shard=k, shards=3) for k in range(3)]
    seen = [windows_of(s, 6) for s in samplers]  # 6 batches of 3: 18 of each shard's 20
    assert all(len(set(w)) == len(w) for w in seen)  # no window twice within an epoch
    assert not set(seen[0]) & set(seen[1]) and not set(seen[1]) & set(seen[2])
    full = [set(windows_of(ShardedSampler(tokens, 4, T, 5, k, 3), 5)) for k in range(3)]
    assert set().union(*full) == set(range(60))  # an epoch of each shard: all 60 windows


def test_each_epoch_visits_the_shard_once_in_a_new_order() -> None:
    sampler = ShardedSampler(torch.arange(T * 12 + 1), 4, T, seed=1)
    first, second = windows_of(sampler, 3), windows_of(sampler, 3)
    assert sorted(first) == sorted(second) == list(range(12))
    assert first != second


def test_a_restored_position_continues_the_same_sequence() -> None:
    tokens = torch.arange(T * 50 + 1)
    original = ShardedSampler(tokens, 4, T, seed=9, shard=1, shards=2)
    windows_of(original, 7)  # crosses an epoch boundary (25 windows in this shard)
    state = original.state_dict()
    assert state["position"] == 28
    restored = ShardedSampler(tokens, 4, T, seed=9, shard=1, shards=2)
    cold = ShardedSampler(tokens, 4, T, seed=9, shard=1, shards=2)
    restored.load_state_dict(state)
    assert windows_of(cold, 1) != windows_of(restored, 1) == windows_of(original, 1)
    for _ in range(10):
        assert torch.equal(original.next()[0], restored.next()[0])


def test_a_position_from_another_sharding_is_refused() -> None:
    tokens = torch.arange(T * 50 + 1)
    state = ShardedSampler(tokens, 4, T, seed=0, shard=0, shards=2).state_dict()
    with pytest.raises(ValueError, match="shards=2, this run has 3"):
        ShardedSampler(tokens, 4, T, seed=0, shard=0, shards=3).load_state_dict(state)


def test_different_seeds_draw_different_orders_and_the_same_seed_the_same() -> None:
    tokens = torch.arange(T * 40 + 1)
    a, b, c = (ShardedSampler(tokens, 4, T, seed) for seed in (1, 1, 2))
    assert windows_of(a, 3) == windows_of(b, 3) != windows_of(c, 3)


def test_a_nanogpt_token_file_is_read_as_uint16(tmp_path: Path) -> None:
    ids = (np.arange(5000) * 7 % 50257).astype(np.uint16)  # ids above 255 must survive
    path = tmp_path / "data.bin"
    ids.tofile(path)
    train, val = load_corpus(str(path), max_bytes=1 << 20)
    assert len(train) == 4500 and len(val) == 500
    assert int(val[-1]) == int(ids[-1]) and int(np.asarray(train[:3])[2]) == int(ids[2])
    x, _ = ShardedSampler(train, 2, T, seed=0, vocab_size=50257).next()
    assert x.dtype == torch.int64 and int(x.max()) > 255
    with pytest.raises(ValueError, match="vocab_size 256"):
        ShardedSampler(train, 64, T, seed=0, vocab_size=256).next()


def test_a_train_bin_uses_the_val_bin_beside_it(tmp_path: Path) -> None:
    np.arange(3000, dtype=np.uint16).tofile(tmp_path / "train.bin")
    np.arange(100, 400, dtype=np.uint16).tofile(tmp_path / "val.bin")
    train, val = load_corpus(str(tmp_path / "train.bin"), max_bytes=1 << 20)
    assert len(train) == 3000 and val.tolist() == list(range(100, 400))


def test_a_broken_token_file_gives_one_clear_error(tmp_path: Path) -> None:
    (tmp_path / "odd.bin").write_bytes(b"\x00" * 11)
    with pytest.raises(ValueError, match="is not a uint16 token file"):
        load_corpus(str(tmp_path / "odd.bin"), 1 << 20)
    with pytest.raises(ValueError, match="does not exist"):
        load_corpus(str(tmp_path / "missing.bin"), 1 << 20)


def test_a_folder_of_text_files_is_split_by_file(tmp_path: Path) -> None:
    for i in range(60):
        (tmp_path / f"doc{i}.txt").write_text(f"document {i} " * 20)
    (tmp_path / "image.png").write_bytes(b"\x89PNG" * 100)  # not text: ignored
    train, val = load_corpus(str(tmp_path), max_bytes=1 << 20)
    text_bytes = sum(len(f"document {i} " * 20) for i in range(60))
    assert len(train) + len(val) == text_bytes and len(val) > 0
    assert b"PNG" not in bytes(train.to(torch.uint8).tolist())


def test_a_folder_without_text_gives_one_clear_error(tmp_path: Path) -> None:
    (tmp_path / "one.txt").write_text("x")
    with pytest.raises(ValueError, match="holds too little text"):
        load_corpus(str(tmp_path), 1 << 20)


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"data_shards": 2, "data_shard": 2}, "data_shard must be in [0, data_shards=2)"),
        ({"data_shard": 1}, "data_shard needs data_shards"),
        ({"data_shards": -1}, "data_shards must be >= 0"),
    ],
)
def test_bad_data_settings_name_the_field(settings: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        build_config(LearnerConfig, {"learner_id": "a", **settings})


def test_text_files_skip_top_level_folders_as_a_full_walk_would(tmp_path) -> None:
    """The same files, in the same order, as walking everything and dropping what lies
    under a skipped top-level folder (learner/data.py's text_files)."""
    for rel in ["a.py", "b/c.txt", "b/d/e.md", "b/x.bin", "skip/f.py", "skip/g/h.txt"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(rel)
    (tmp_path / "linked").symlink_to(tmp_path / "b")  # not followed, as rglob does not
    (tmp_path / "link.py").symlink_to(tmp_path / "a.py")  # a linked file is a file
    walked = sorted(
        p
        for p in tmp_path.rglob("*")
        if p.suffix in TEXT_SUFFIXES
        and p.is_file()
        and p.relative_to(tmp_path).parts[0] not in ("skip",)
    )
    assert text_files(tmp_path, ("skip",)) == walked
    assert [p.relative_to(tmp_path).as_posix() for p in walked] == [
        "a.py",
        "b/c.txt",
        "b/d/e.md",
        "link.py",
    ]
