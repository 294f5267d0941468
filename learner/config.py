"""The learner's settings: small section dataclasses, each validated on construction.

    config = build_config(LearnerConfig, {"server": "127.0.0.1:50051", "learner_id": "a"})
    config.connection.server, config.sync.sync_every_steps, config.model.n_layer

`LearnerConfig` (the daemon, learner/trainer.py) is made of every section below;
`DilocoSyncConfig` (the library, learner/api.py) of the two a user's own loop needs, the
connection and the sync schedule. Every setting keeps one flat name, which is its `--flag`,
its `DILOCO_*` variable and its TOML key, at the top of the file or in its section's table
(`[sync]` then `sync_every_steps = 50`; common/config.py). A bad value ends in one
ValueError naming the setting to fix.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from common.codec.sparse import (
    DEFAULT_FEEDBACK_DECAY,
    DEFAULT_FEEDBACK_IN_MODEL,
    DEFAULT_TOPK_FRACTION,
)
from common.codec.tensor import CODECS
from common.config import address_list
from common.lr_schedule import LrSchedule
from common.metrics_http import check_listen
from learner.model import GPTConfig


@dataclass(kw_only=True)
class ConnectionConfig:
    """Where the aggregator is and how this learner proves who it is."""

    server: str = "127.0.0.1:50051"
    """host:port of the aggregator; for a sharded one, every shard's, comma-separated in
    index order, or one shard's (the others are then discovered: learner/shards.py)."""
    learner_id: str = ""
    """Unique name of this learner (default: hostname-pid); its token, lease, rate limit and
    checkpoint belong to this name."""
    tls_ca: str = ""
    """PEM CA to verify the server's certificate (default: the system's roots)."""
    tls_cert: str = ""
    """PEM client certificate for servers that require mutual TLS (with tls_key)."""
    tls_key: str = ""
    """PEM private key of tls_cert."""
    insecure: bool = False
    """Connect in plaintext, without TLS (to a server started with insecure): only on a
    trusted network, since the token and the parameters then travel in the clear."""
    auth_token_file: str = ""
    """File holding this learner's token, for a server with auth_token_file."""
    connect_timeout_s: float = 30.0
    """Give up if the server cannot be reached for this long at start."""

    def __post_init__(self) -> None:
        if not self.addresses():
            raise ValueError("server must name at least one host:port")
        if not self.learner_id:
            self.learner_id = f"{os.uname().nodename}-{os.getpid()}"
        if self.insecure and (self.tls_ca or self.tls_cert or self.tls_key):
            raise ValueError("insecure and tls_* settings exclude each other: choose one")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key must be given together")

    def addresses(self) -> list[str]:
        """The shard addresses `server` lists, in index order."""
        return address_list(self.server, "server")


RECIPES = ("best", "paper")


def sync_recipe(values: Mapping[str, Any]) -> dict[str, Any]:
    """The sync settings of the recipe named in `values` (the dataclass defaults are best)."""
    if values.get("recipe") == "paper":
        return {"sync_every_steps": 100, "merge_alpha": 0.5, "push_codec": "fp4_e3m0"}
    return {}


@dataclass(kw_only=True)
class SyncConfig:
    """The Streaming DiLoCo schedule: when each fragment syncs and how it is merged."""

    recipe: str = "best"
    """best: the defaults below, the best measured training from scratch (docs/RESULTS.md);
    paper: the Streaming DiLoCo paper's H = 100, α = 0.5 and fp4_e3m0 pushes for the
    settings not given (pair it with the server's --recipe paper)."""
    sync_every_steps: int = 50
    """H: inner steps between two pushes of the same fragment."""
    overlap_steps: int = 1
    """τ: inner steps a fragment's sync may travel before it is merged (0: wait at once)."""
    merge_alpha: float = 0.05
    """α in θ ← α·θ_local + (1−α)·θ_global at the merge (0: take the global value)."""
    push_codec: str = "fp4_e2m1"
    """Codec of the pushed pseudo-gradients: fp4_e2m1, fp4_e3m0, bf16, fp32, or the top-k
    sparse sparse_2bit (with error feedback; common/codec/sparse.py)."""
    push_topk_fraction: float = DEFAULT_TOPK_FRACTION
    """Sparse push codecs: the fraction of values kept in every chunk of 4096 (1/64: 64)."""
    push_feedback_decay: float = DEFAULT_FEEDBACK_DECAY
    """Sparse push codecs: β in e ← β·e + Δ, the error-feedback residual's decay before each
    push adds its pseudo-gradient (SparseLoCo's momentum-like accumulator; 1: no decay).
    Pair it with the server's outer step for sparse pulls (docs/RESULTS.md, sparse)."""
    push_feedback_in_model: bool = DEFAULT_FEEDBACK_IN_MODEL
    """Sparse push codecs: keep the unsent residual in the local model (the merge takes the
    global value less β·e, and the learner trains on from there), not only in the error
    feedback. The same bytes; a lower loss from a few hundred steps to ~1,600-1,800, then a
    higher one at H = 20 (docs/RESULTS.md). Off: SparseLoCo's rule, the residual apart."""
    dynamic_local_updates: bool = False
    """quorum/async: a learner k times slower than the live learners' median step time
    advances its schedule k steps per inner step, so it syncs after k times fewer steps of
    its own and its pushes arrive in the same rounds as everyone else's."""

    def __post_init__(self) -> None:
        if self.recipe not in RECIPES:
            raise ValueError(f"recipe must be one of {', '.join(RECIPES)}, got {self.recipe!r}")
        if self.push_codec not in CODECS:
            raise ValueError(
                f"push_codec must be one of {', '.join(CODECS)}, got {self.push_codec!r}"
            )
        if not 0 < self.push_topk_fraction <= 1:
            raise ValueError(f"push_topk_fraction must be in (0, 1], got {self.push_topk_fraction}")
        if not 0 <= self.push_feedback_decay <= 1:
            raise ValueError(
                f"push_feedback_decay must be in [0, 1], got {self.push_feedback_decay}"
            )
        if self.sync_every_steps < 1:
            raise ValueError(f"sync_every_steps must be >= 1, got {self.sync_every_steps}")
        if not 0 <= self.merge_alpha <= 1:
            raise ValueError(f"merge_alpha must be in [0, 1], got {self.merge_alpha}")
        if not 0 <= self.overlap_steps < self.sync_every_steps:
            raise ValueError(
                f"overlap_steps must be in [0, sync_every_steps), got {self.overlap_steps}"
            )


@dataclass(kw_only=True)
class DataConfig:
    """What the built-in job trains on, and which part of it this learner reads."""

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
    batch_size: int = 16
    """Sequences per inner step."""

    def __post_init__(self) -> None:
        _at_least(self, 1, "batch_size")
        _at_least(self, 0, "corpus_max_bytes", "data_shards")
        if self.data_shards and not 0 <= self.data_shard < self.data_shards:
            raise ValueError(
                f"data_shard must be in [0, data_shards={self.data_shards}), got {self.data_shard}"
            )
        if not self.data_shards and self.data_shard:
            raise ValueError("data_shard needs data_shards (the number of shards) to be set")


ISLAND_SHARDINGS = ("ddp", "fsdp", "hsdp")


@dataclass(kw_only=True)
class TrainingConfig:
    """The inner optimizer, where it runs, and when the run ends."""

    inner_lr: float = 1e-3
    """AdamW learning rate."""
    weight_decay: float = 0.1
    """AdamW weight decay."""
    seed: int = 0
    """Seed of the model initialisation; the data order also mixes in the learner id."""
    device: str = "auto"
    """Where the model trains: `auto` (CUDA if available, else CPU), `cpu`, `cuda` or `cuda:N`.
    Replicas of the global fragments stay on the CPU either way."""
    torch_threads: int = 0
    """Threads for torch (0: the CPUs this process may use, a container's CPU limit
    included, divided by --learners-per-host)."""
    learners_per_host: int = 1
    """How many learners share this host, to size the default thread count."""
    island_sharding: str = "ddp"
    """How an island's ranks (torchrun) hold the model: `ddp` (each rank all of it; rank 0
    syncs for the island), `fsdp` (FSDP2: each rank a slice of every parameter, which it
    syncs itself) or `hsdp` (hsdp_replicas copies of an FSDP2 group; replica 0's ranks sync).
    One process: the setting does nothing."""
    hsdp_replicas: int = 2
    """With island_sharding hsdp: the replicas, which must divide the island's ranks."""
    max_outer_steps: int = 0
    """Stop after this many outer steps (0: no limit)."""
    duration_s: float = 0.0
    """Stop at the first outer step after this many seconds (0: no limit)."""
    eval_batches: int = 8
    """Validation batches evaluated after every outer step."""
    lr_schedule: str = "constant"
    """The inner learning rate over the run: `constant`, or `cosine`: a linear warm-up over
    lr_warmup_fraction of lr_schedule_steps, then a cosine decay to lr_min_ratio of inner_lr
    at lr_schedule_steps, held there after."""
    lr_schedule_steps: int = 0
    """Inner steps of this learner that a cosine schedule spans, e.g. about its planned
    max_outer_steps times sync_every_steps (its first outer step may be shorter: it joins at
    the server's phase). Counted per learner from its own first step, across restarts from
    its checkpoint: a learner that joins late, or without its checkpoint, starts the schedule
    again at its warm-up."""
    lr_warmup_fraction: float = 0.05
    """Of lr_schedule_steps, the fraction spent warming up (cosine only)."""
    lr_min_ratio: float = 0.1
    """Where the cosine ends, as a fraction of inner_lr."""

    def __post_init__(self) -> None:
        _at_least(self, 1, "eval_batches", "learners_per_host", "hsdp_replicas")
        if self.island_sharding not in ISLAND_SHARDINGS:
            raise ValueError(
                f"island_sharding must be one of {', '.join(ISLAND_SHARDINGS)}, "
                f"got {self.island_sharding!r}"
            )
        _at_least(self, 0, "max_outer_steps", "duration_s", "torch_threads", "lr_schedule_steps")
        if not self.inner_lr > 0:
            raise ValueError(f"inner_lr must be > 0, got {self.inner_lr}")
        self.inner_lr_schedule()  # fails here for a bad schedule
        resolve_device(self.device)  # fails here, in one sentence, for a bad or absent device

    def inner_lr_schedule(self) -> LrSchedule:
        """The factor on inner_lr per inner step, from the lr_* settings."""
        return LrSchedule(
            self.lr_schedule,
            steps=self.lr_schedule_steps,
            warmup_fraction=self.lr_warmup_fraction,
            min_lr_ratio=self.lr_min_ratio,
        )


@dataclass(kw_only=True)
class CheckpointConfig:
    """Where a learner starts: its periodic checkpoint (learner/checkpoint.py), resumed from
    at start, or else a parameters file."""

    checkpoint_dir: str = ""
    """Folder of this learner's checkpoint (checkpoint.pt): written periodically, and resumed
    from at start if present (empty: no checkpoint)."""
    checkpoint_every_steps: int = 0
    """Write the checkpoint every this many inner steps (0: by time only)."""
    checkpoint_every_s: float = 60.0
    """Write the checkpoint at least this often, at an inner step (0: by steps only)."""
    init_params: str = ""
    """Start from the parameters in this file (diloco-export's .safetensors or .pt, or
    --save-params' output) instead of a fresh model; the first learner to join gives them to
    the server. When checkpoint_dir holds a checkpoint, the learner resumes from it and does
    not read this file (empty: a fresh model)."""

    def __post_init__(self) -> None:
        _at_least(self, 0, "checkpoint_every_steps", "checkpoint_every_s")


@dataclass(kw_only=True)
class ObservabilityConfig:
    """Status lines, the Prometheus endpoint, and what the learner writes when it ends."""

    status_every_s: float = 10.0
    """Log a status line (steps, tokens/s, losses, versions, last sync) at most this often,
    at an outer step; 0: after every outer step."""
    metrics_listen: str = ""
    """host:port for the Prometheus endpoint (/metrics), e.g. 0.0.0.0:9101; empty: off."""
    metrics_port_file: str = ""
    """If set, write the bound metrics port to this file (for launchers using port 0)."""
    summary_file: str = ""
    """If set, write the final summary as JSON here."""
    save_params: str = ""
    """If set, save the final model parameters here (torch.save of a name -> tensor dict)."""

    def __post_init__(self) -> None:
        _at_least(self, 0, "status_every_s")
        check_listen("metrics_listen", self.metrics_listen)


@dataclass(kw_only=True)
class SimulationConfig:
    """For simulations only (benchmarks, demos, tests): make a learner behave like slower
    hardware. Leave it at its default in a real run."""

    slowdown: float = 1.0
    """Simulations only: make each inner step take this many times as long (>= 1), as on a
    slower island; a pause such as SIGSTOP is not stretched."""
    step_period_s: float = 0.0
    """Simulations only: end each inner step on a clock that ticks every this many seconds,
    as on hardware whose step takes that long whatever else runs on this machine (as long
    as a step's own work fits); 0: off. Not together with slowdown."""

    def __post_init__(self) -> None:
        if not self.slowdown >= 1:
            raise ValueError(f"slowdown must be >= 1, got {self.slowdown}")
        if not 0 <= self.step_period_s < math.inf:
            raise ValueError(f"step_period_s must be >= 0 and finite, got {self.step_period_s}")
        if self.slowdown > 1 and self.step_period_s > 0:
            raise ValueError("set slowdown or step_period_s, not both")


@dataclass(kw_only=True)
class DilocoSyncConfig:
    """What the library (learner/api.py) needs when the model, data and loop are yours."""

    connection: ConnectionConfig = dataclasses.field(default_factory=ConnectionConfig)
    sync: SyncConfig = dataclasses.field(default_factory=SyncConfig)
    recipe_values = staticmethod(sync_recipe)


@dataclass(kw_only=True)
class LearnerConfig:
    """The daemon's settings (diloco-learner): the library's sections and the built-in job's.

    Each section checks its own fields; none of today's rules spans two sections, so there is
    nothing left to check here."""

    connection: ConnectionConfig = dataclasses.field(default_factory=ConnectionConfig)
    sync: SyncConfig = dataclasses.field(default_factory=SyncConfig)
    recipe_values = staticmethod(sync_recipe)
    model: GPTConfig = dataclasses.field(default_factory=GPTConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    training: TrainingConfig = dataclasses.field(default_factory=TrainingConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    observability: ObservabilityConfig = dataclasses.field(default_factory=ObservabilityConfig)
    simulation: SimulationConfig = dataclasses.field(default_factory=SimulationConfig)

    def library(self) -> DilocoSyncConfig:
        """The sections the DilocoSync that this daemon drives takes (the same objects)."""
        return DilocoSyncConfig(connection=self.connection, sync=self.sync)


def _at_least(section: object, bound: int, *names: str) -> None:
    for name in names:
        value = getattr(section, name)
        if value < bound:
            raise ValueError(f"{name} must be >= {bound}, got {value}")


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
