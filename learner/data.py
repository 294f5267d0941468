"""Training data: the built-in corpus, a folder of text files or a nanoGPT token file, sharded.

    train, val = load_corpus("stdlib", max_bytes=4 << 20)     # or a folder, or train.bin
    sampler = ShardedSampler(train, batch_size=16, seq_len=128, seed=7, shard=0, shards=2)
    x, y = sampler.next()                                      # (B, T) int64 each
    state = sampler.state_dict()                               # the data position; restorable

The built-in corpus is this Python's standard-library sources: every machine that runs the
learner already has it, so nothing is downloaded. Files are assigned to validation by a hash
of their relative path (stable across machines and runs), so no file's text appears in both
splits. A nanoGPT-style token file is raw `uint16` token ids (what nanoGPT's prepare.py
writes); it is memory-mapped, so its size is not bounded by RAM.
"""

from __future__ import annotations

import sysconfig
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch

VALIDATION_PERCENT = 10
TEXT_SUFFIXES = (".py", ".txt", ".md")
STDLIB_SKIP = ("site-packages", "test")  # third-party code and the huge test suite


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def load_corpus(corpus: str, max_bytes: int) -> tuple[Any, torch.Tensor]:
    """(train, validation) tokens for a --corpus value: `stdlib`, a folder, or a `.bin` file.

    The train split is a torch tensor, or a read-only numpy memmap for a token file.
    """
    if corpus == "stdlib":
        return load_text_corpus(stdlib_dir(), max_bytes, skip_top=STDLIB_SKIP)
    path = Path(corpus)
    if path.suffix == ".bin":
        return load_token_file(path)
    return load_text_corpus(path, max_bytes)


def load_text_corpus(
    root: Path, max_bytes: int, skip_top: tuple[str, ...] = ()
) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, validation) byte tensors from the text files under `root` (.py, .txt, .md)."""
    if not root.is_dir():
        raise ValueError(f"corpus folder {root} does not exist")
    train, val = bytearray(), bytearray()
    for path in text_files(root, skip_top):
        rel = path.relative_to(root).as_posix()
        split = val if zlib.crc32(rel.encode()) % 100 < VALIDATION_PERCENT else train
        if len(split) >= max_bytes:
            continue
        try:
            split += path.read_bytes()
        except OSError:
            continue
    if len(train) < 2 or len(val) < 2:
        raise ValueError(
            f"corpus folder {root} holds too little text to train on (it needs .py, .txt or "
            f".md files, about {VALIDATION_PERCENT}% of which, by a hash of their path, are "
            "kept for validation)"
        )
    return _as_tensor(train[:max_bytes]), _as_tensor(val[:max_bytes])


def text_files(root: Path, skip_top: tuple[str, ...] = ()) -> list[Path]:
    """The .py, .txt and .md files under `root`, sorted, leaving out the top-level entries
    named in `skip_top` without walking them (the stdlib's site-packages and test suite hold
    most of its files: walking them took a good part of a learner's start). Symlinked folders
    are not followed, as Path.rglob does not."""
    top = [p for p in root.iterdir() if p.name not in skip_top]
    found = [*top]
    for folder in top:
        if folder.is_dir() and not folder.is_symlink():
            found += folder.rglob("*")
    return sorted(p for p in found if p.suffix in TEXT_SUFFIXES and p.is_file())


def load_token_file(path: Path) -> tuple[np.ndarray, torch.Tensor]:
    """A nanoGPT-style `uint16` token file: (train memmap, validation tensor).

    A `train.bin` with a `val.bin` beside it (nanoGPT's layout) uses that for validation;
    any other file keeps its last 10% of tokens for validation.
    """
    train = _token_memmap(path)
    sibling = path.with_name("val.bin")
    if path.name == "train.bin" and sibling.is_file():
        return train, torch.from_numpy(_token_memmap(sibling).astype(np.int64))
    cut = len(train) * (100 - VALIDATION_PERCENT) // 100
    return train[:cut], torch.from_numpy(train[cut:].astype(np.int64))


def _token_memmap(path: Path) -> np.ndarray:
    if not path.is_file():
        raise ValueError(f"token file {path} does not exist")
    size = path.stat().st_size
    if size < 4 or size % 2:
        raise ValueError(f"token file {path} is not a uint16 token file ({size} bytes)")
    return np.memmap(path, dtype=np.uint16, mode="r")


def _as_tensor(data: bytearray) -> torch.Tensor:
    return torch.frombuffer(data, dtype=torch.uint8).long()


class BatchSampler:
    """Random (B, T) windows of a token tensor, from a seeded generator of its own (eval)."""

    def __init__(self, tokens: torch.Tensor, batch_size: int, seq_len: int, seed: int) -> None:
        if len(tokens) <= seq_len + 1:
            raise ValueError(f"corpus of {len(tokens)} tokens is shorter than seq_len {seq_len}")
        self.tokens, self.batch_size, self.seq_len = tokens, batch_size, seq_len
        self.generator = torch.Generator().manual_seed(seed)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(
            len(self.tokens) - self.seq_len - 1, (self.batch_size,), generator=self.generator
        )
        rows = torch.stack([self.tokens[s : s + self.seq_len + 1] for s in starts.tolist()])
        return rows[:, :-1], rows[:, 1:]


class ShardedSampler:
    """(B, T) batches of disjoint windows: shard `shard` of `shards`, each epoch reshuffled.

    The tokens are cut into non-overlapping windows of T+1 tokens (stride T). Shard k of n
    owns windows k, k+n, k+2n, …, so learners (and the ranks of an island) holding different
    shards never train on the same window. Epoch e visits each of the shard's windows once,
    in the order of a permutation seeded by (seed, e). The position (windows drawn so far) is
    the sampler's whole state: restoring it continues the exact same sequence.
    """

    def __init__(
        self,
        tokens: Any,
        batch_size: int,
        seq_len: int,
        seed: int,
        shard: int = 0,
        shards: int = 1,
        vocab_size: int = 0,
    ) -> None:
        """`tokens`: a 1-D torch tensor or numpy array (a memmap is read window by window).
        `vocab_size` > 0 checks every batch's ids against it (a token file for another
        tokenizer fails in one sentence instead of inside the embedding)."""
        if not 0 <= shard < shards:
            raise ValueError(f"data shard must be in [0, {shards}), got {shard}")
        self.tokens, self.batch_size, self.seq_len = tokens, batch_size, seq_len
        self.seed, self.shard, self.shards, self.vocab_size = seed, shard, shards, vocab_size
        self.windows = max(0, (len(tokens) - 1) // seq_len)
        self.shard_windows = len(range(shard, self.windows, shards))
        if self.shard_windows < 1:
            raise ValueError(
                f"corpus of {len(tokens)} tokens has too few windows of {seq_len + 1} tokens "
                f"for {shards} data shards"
            )
        self.position = 0
        self._epoch = -1
        self._order = torch.empty(0, dtype=torch.long)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.stack([self._window(self._take()) for _ in range(self.batch_size)])
        if self.vocab_size and int(rows.max()) >= self.vocab_size:
            raise ValueError(
                f"the corpus holds token id {int(rows.max())} >= vocab_size {self.vocab_size}: "
                "set --vocab-size to the tokenizer's (GPT-2: 50257)"
            )
        return rows[:, :-1], rows[:, 1:]

    def state_dict(self) -> dict[str, int]:
        return {
            "position": self.position,
            "shards": self.shards,
            "windows": self.windows,
            "seq_len": self.seq_len,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume at a saved position; the corpus and the sharding must be the same."""
        mine = self.state_dict()
        for key in ("shards", "windows", "seq_len"):
            if state.get(key) != mine[key]:
                raise ValueError(
                    f"saved data position is for {key}={state.get(key)}, this run has "
                    f"{mine[key]}: use the same corpus, block size and sharding (data_shards, "
                    "island size), or a new checkpoint_dir"
                )
        self.position = int(state["position"])

    def _take(self) -> int:
        """The window index at the current position; advances the position by one."""
        epoch, offset = divmod(self.position, self.shard_windows)
        if epoch != self._epoch:
            generator = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) % (1 << 63))
            self._order = torch.randperm(self.shard_windows, generator=generator)
            self._epoch = epoch
        self.position += 1
        return self.shard + self.shards * int(self._order[offset])

    def _window(self, index: int) -> torch.Tensor:
        start = index * self.seq_len
        piece = self.tokens[start : start + self.seq_len + 1]
        if isinstance(piece, torch.Tensor):
            return piece.long()
        return torch.from_numpy(np.asarray(piece, dtype=np.int64))
