"""The learner's settings: one dataclass, validated on construction (one sentence per error).

    config = LearnerConfig(server="127.0.0.1:50051", learner_id="a", device="auto")

Every field is also a `--flag`, a TOML key and a `DILOCO_*` variable (common/config.py).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch

from common.codec import CODECS
from common.metrics_http import check_listen
from learner.model import GPTConfig


@dataclass(kw_only=True)
class LearnerConfig(GPTConfig):
    server: str = "127.0.0.1:50051"
    """host:port of the aggregator."""
    learner_id: str = ""
    """Unique name of this learner (default: hostname-pid)."""
    sync_every_steps: int = 50
    """H: inner steps between two pushes of the same fragment."""
    overlap_steps: int = 1
    """τ: inner steps a fragment's sync may travel before it is merged (0: wait at once)."""
    merge_alpha: float = 0.5
    """α in θ ← α·θ_local + (1−α)·θ_global at the merge (0: take the global value)."""
    dynamic_local_updates: bool = False
    """quorum/async: a learner k times slower than the live learners' median step time
    advances its schedule k steps per inner step, so it syncs after k times fewer steps of
    its own and its pushes arrive in the same rounds as everyone else's."""
    align_schedule: bool = True
    """quorum/async: steer this learner's schedule step, one step at a time, towards the
    live learners' median (from heartbeats), so the pushes of a fragment arrive in the same
    rounds instead of drifting apart; a learner behind pushes a step sooner, one ahead
    trains a step more first. Nobody waits either way."""
    batch_size: int = 16
    """Sequences per inner step."""
    inner_lr: float = 1e-3
    """AdamW learning rate."""
    weight_decay: float = 0.1
    """AdamW weight decay."""
    push_codec: str = "fp4_e2m1"
    """Codec of the pushed pseudo-gradients: fp4_e2m1, fp4_e3m0, bf16 or fp32."""
    max_outer_steps: int = 0
    """Stop after this many outer steps (0: no limit)."""
    duration_s: float = 0.0
    """Stop at the first outer step after this many seconds (0: no limit)."""
    corpus: str = "stdlib"
    """`stdlib` (this Python's library sources), a folder of text files (.py, .txt, .md), or a
    nanoGPT-style uint16 token file (.bin; a val.bin beside a train.bin is its validation
    split; set vocab_size to the tokenizer's)."""
    corpus_max_bytes: int = 4 << 20
    """Read at most this many bytes of text per split."""
    data_shards: int = 0
    """Split the training windows into this many disjoint shards, one per learner (0: every
    learner draws from all of them, in an order seeded by its id). The ranks of an island
    split their learner's shard further."""
    data_shard: int = 0
    """Which of the data_shards this learner trains on, in [0, data_shards)."""
    checkpoint_dir: str = ""
    """Folder of this learner's checkpoint (checkpoint.pt): written periodically, and resumed
    from at start if present (empty: no checkpoint)."""
    checkpoint_every_steps: int = 0
    """Write the checkpoint every this many inner steps (0: by time only)."""
    checkpoint_every_s: float = 60.0
    """Write the checkpoint at least this often, at an inner step (0: by steps only)."""
    eval_batches: int = 8
    """Validation batches evaluated after every outer step."""
    seed: int = 0
    """Seed of the model initialisation; the data order also mixes in the learner id."""
    device: str = "auto"
    """Where the model trains: `auto` (CUDA if available, else CPU), `cpu`, `cuda` or `cuda:N`.
    Replicas of the global fragments stay on the CPU either way."""
    torch_threads: int = 0
    """Threads for torch (0: the CPU count divided by --learners-per-host)."""
    slowdown: float = 1.0
    """Simulate a slower island: each inner step takes this many times as long (>= 1)."""
    learners_per_host: int = 1
    """How many learners share this host, to size the default thread count."""
    tls_ca: str = ""
    """PEM CA to verify the server's certificate (default: the system's roots)."""
    tls_cert: str = ""
    """PEM client certificate for servers that require mutual TLS (with tls_key)."""
    tls_key: str = ""
    """PEM private key of tls_cert."""
    insecure: bool = False
    """Connect in plaintext, without TLS (to a server started with insecure)."""
    auth_token_file: str = ""
    """File holding this learner's token, for a server with auth_token_file."""
    status_every_s: float = 10.0
    """Log a status line (steps, tokens/s, losses, versions, last sync) at most this often,
    at an outer step; 0: after every outer step."""
    connect_timeout_s: float = 30.0
    """Give up if the server cannot be reached for this long at start."""
    metrics_listen: str = ""
    """host:port for the Prometheus endpoint (/metrics), e.g. 0.0.0.0:9101; empty: off."""
    metrics_port_file: str = ""
    """If set, write the bound metrics port to this file (for launchers using port 0)."""
    summary_file: str = ""
    """If set, write the final summary as JSON here."""
    save_params: str = ""
    """If set, save the final model parameters here (torch.save of a name -> tensor dict)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.push_codec not in CODECS:
            raise ValueError(
                f"push_codec must be one of {', '.join(CODECS)}, got {self.push_codec!r}"
            )
        positive = ("sync_every_steps", "batch_size", "eval_batches", "learners_per_host")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in (
            "max_outer_steps",
            "duration_s",
            "torch_threads",
            "corpus_max_bytes",
            "status_every_s",
            "data_shards",
            "checkpoint_every_steps",
            "checkpoint_every_s",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.data_shards and not 0 <= self.data_shard < self.data_shards:
            raise ValueError(
                f"data_shard must be in [0, data_shards={self.data_shards}), got {self.data_shard}"
            )
        if not self.data_shards and self.data_shard:
            raise ValueError("data_shard needs data_shards (the number of shards) to be set")
        if not self.slowdown >= 1:
            raise ValueError(f"slowdown must be >= 1, got {self.slowdown}")
        if not 0 <= self.merge_alpha <= 1:
            raise ValueError(f"merge_alpha must be in [0, 1], got {self.merge_alpha}")
        if not 0 <= self.overlap_steps < self.sync_every_steps:
            raise ValueError(
                f"overlap_steps must be in [0, sync_every_steps), got {self.overlap_steps}"
            )
        if not self.inner_lr > 0:
            raise ValueError(f"inner_lr must be > 0, got {self.inner_lr}")
        if ":" not in self.server:
            raise ValueError(f"server must be host:port, got {self.server!r}")
        if not self.learner_id:
            self.learner_id = f"{os.uname().nodename}-{os.getpid()}"
        resolve_device(self.device)  # fails here, in one sentence, for a bad or absent device
        check_listen("metrics_listen", self.metrics_listen)
        if self.insecure and (self.tls_ca or self.tls_cert or self.tls_key):
            raise ValueError("insecure and tls_* settings exclude each other: choose one")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key must be given together")

    def model_config(self) -> GPTConfig:
        return GPTConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(GPTConfig)})


def resolve_device(name: str) -> torch.device:
    """The torch device for a --device value; raises ValueError for one this host lacks."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {name!r}") from err
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {name!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r} requested but this host has no usable CUDA GPU")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(
                f"device {name!r} requested but this host has {torch.cuda.device_count()} GPU(s)"
            )
    return device
