"""The built-in corpus: this Python's standard-library sources, split by file.

Every machine that runs the learner already has it, so nothing is downloaded. Files are
assigned to validation by a hash of their relative path (stable across machines and runs),
so no file's text appears in both splits. Other corpora: a folder of text files, or a
nanoGPT-style file of uint8 or uint16 tokens (`.bin`).
"""

from __future__ import annotations

import sysconfig
import zlib
from pathlib import Path

import torch

VALIDATION_PERCENT = 10


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def load_text_corpus(root: Path, max_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, validation) byte tensors from the files under `root` (`.py`, `.txt`, `.md`)."""
    if not root.is_dir():
        raise ValueError(f"corpus folder {root} does not exist")
    train, val = bytearray(), bytearray()
    files = sorted(p for p in root.rglob("*") if p.suffix in (".py", ".txt", ".md") and p.is_file())
    for path in files:
        rel = path.relative_to(root).as_posix()
        if rel.split("/")[0] in ("site-packages", "test"):
            continue  # third-party code and the huge test suite are not the corpus
        split = val if zlib.crc32(rel.encode()) % 100 < VALIDATION_PERCENT else train
        if len(split) >= max_bytes:
            continue
        try:
            split += path.read_bytes()
        except OSError:
            continue
    if len(train) < 2 or len(val) < 2:
        raise ValueError(f"corpus folder {root} holds too little text to train on")
    return _as_tensor(train[:max_bytes]), _as_tensor(val[:max_bytes])


def load_token_file(path: Path, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A nanoGPT-style token file; the last 10% of tokens are the validation split."""
    import numpy as np

    dtype = np.uint8 if vocab_size <= 256 else np.uint16
    tokens = torch.from_numpy(np.fromfile(path, dtype=dtype).astype(np.int64))
    cut = len(tokens) * (100 - VALIDATION_PERCENT) // 100
    return tokens[:cut], tokens[cut:]


def _as_tensor(data: bytearray) -> torch.Tensor:
    return torch.frombuffer(data, dtype=torch.uint8).long()


class BatchSampler:
    """Random (B, T) windows of a token tensor, from a seeded generator of its own."""

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
