"""Streaming DiLoCo in torchtitan: a Trainer whose config has a `diloco` section.

    # my_configs.py: a torchtitan config registry (your model, data, parallelism)
    from learner.adapters.torchtitan import DilocoTrainer, sync_settings

    def llama3_8b_diloco() -> DilocoTrainer.Config:
        return DilocoTrainer.Config(
            model_spec=model_registry("8B"), ...,      # what torchtitan's Trainer.Config takes
            parallelism=ParallelismConfig(spmd_backend="partial_dtensor"),
            diloco=sync_settings(server="10.0.0.5:50051", insecure=True, sync_every_steps=100),
        )

    torchrun --nproc-per-node 8 -m torchtitan.train --module my_configs \
        --config llama3_8b_diloco --diloco.connection.learner-id island-a

Each torchrun job is one learner of the run (an island): torchtitan builds and shards the
model with fully_shard (FSDP2, or HSDP with data_parallel_replicate_degree > 1) and runs its
own loop; after every optimizer step each rank calls DilocoSync.step() for its slice
(learner/sliced.py), which pushes a fragment's pseudo-gradient on schedule and merges the
global value back in place. The island joins at its first step (after a checkpoint is
loaded) and leaves when training ends, holding the global parameters. A job restarted from a
torchtitan checkpoint joins again and takes the run's global parameters. Tensor, context,
pipeline and expert parallelism are refused, naming the setting to change.
Needs: pip install 'decoupled-diloco[torchtitan]' (torchtitan 0.3.0, which imports triton).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torchtitan.config import ParallelismConfig
from torchtitan.trainer import Trainer

from common.config import build_config
from learner.api import DilocoSync
from learner.config import DilocoSyncConfig

__all__ = ["DilocoTrainer", "sync_settings"]


def sync_settings(**settings: Any) -> DilocoSyncConfig:
    """DilocoSync's settings by their flat names (those of `diloco-learner --help`: server,
    learner_id, sync_every_steps, ...), the sync recipe's preset filled in under them; for
    DilocoTrainer.Config's `diloco` field. Raises ValueError naming an unknown setting."""
    return build_config(DilocoSyncConfig, settings)


class DilocoTrainer(Trainer):
    """torchtitan's Trainer, one DilocoSync step after each of its optimizer steps."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        diloco: DilocoSyncConfig = field(default_factory=sync_settings)
        """The run to join and its sync schedule (learner/config.py's connection and sync
        sections): e.g. --diloco.connection.server, --diloco.sync.sync-every-steps."""

    diloco: DilocoSync

    def __init__(self, config: Config) -> None:
        _check_parallelism(config.parallelism)
        _provide_set_timeout()
        super().__init__(config)
        training = config.training
        # What one optimizer step trains on, on this rank: the island's is its ranks' sum.
        tokens = training.local_batch_size * training.seq_len * self.gradient_accumulation_steps
        self.diloco = DilocoSync(self.model_parts[0], tokens_per_step=tokens, config=config.diloco)
        self._joined = False

    def train_step(self, data_iterator: Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]):
        if not self._joined:
            # Here rather than in __init__: train() has loaded any checkpoint by now, so the
            # first learner of a run offers the parameters it trains from.
            self.diloco.open()
            self._joined = True
        super().train_step(data_iterator)
        # torchtitan's metrics log the loss; reading it here would cost a device sync.
        self.diloco.step(loss=math.nan)

    def train(self) -> None:
        super().train()
        self.diloco.close()  # merges the syncs in flight: the model holds the global params

    def close(self) -> None:
        if hasattr(self, "diloco"):
            self.diloco.close(drain=False)  # a no-op after train(); after an error, just leave
        super().close()


def _check_parallelism(parallelism: ParallelismConfig) -> None:
    """An island syncs slices of a model sharded by data parallelism (FSDP2, HSDP) alone."""
    if parallelism.spmd_backend != "partial_dtensor":
        raise ValueError(
            f"parallelism.spmd_backend is {parallelism.spmd_backend!r}: DilocoTrainer syncs "
            "FSDP2 and HSDP models, set it to 'partial_dtensor'"
        )
    for name in ("tensor", "context", "pipeline", "expert"):
        degree = getattr(parallelism, f"{name}_parallel_degree")
        if degree != 1:
            raise ValueError(
                f"parallelism.{name}_parallel_degree is {degree}: DilocoTrainer syncs FSDP2 "
                "and HSDP models, set it to 1"
            )


def _provide_set_timeout() -> None:
    """torchtitan 0.3.0 shortens its process groups' timeouts after the first step with
    torch.distributed.set_timeout, which PyTorch 2.13 lacks; ProcessGroup.set_timeout is
    the same operation, one group at a time."""
    if hasattr(dist, "set_timeout"):
        return

    def set_timeout(timeout: timedelta, group: dist.ProcessGroup | None = None) -> None:
        (group if group is not None else dist.group.WORLD).set_timeout(timeout)

    dist.set_timeout = set_timeout
