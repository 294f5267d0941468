"""What the trainer callbacks share: join when training starts, one DilocoSync step after
each optimizer step, leave when it ends, on any of the ways a trainer spreads a model.

    driver = TrainingSync(tokens_per_step=B * T, server=..., learner_id="a")
    driver.open(model)          # training starts
    driver.step(loss)           # after each optimizer step
    driver.close()              # training ends: the model holds the global parameters

One process: a DilocoSync of the model. A sharded model (fully_shard: FSDP2, HSDP): every
rank holds one, for its slice (learner/sliced.py). Data-parallel ranks that each hold the
whole model (DDP): they are one learner, rank 0 syncs for all (with every rank's tokens), and
the others take its parameters after each merge, as the built-in learner's island does
(learner/island.py).
"""

from __future__ import annotations

import math
from typing import Any

import torch.distributed as dist
from torch import nn

from learner.api import DilocoSync
from learner.island import Island
from learner.sliced import is_sharded


class TrainingSync:
    """A DilocoSync driven by a trainer's events."""

    def __init__(self, *, tokens_per_step: int = 1, **settings: Any) -> None:
        self.tokens_per_step, self.settings = tokens_per_step, settings
        self.sync: DilocoSync | None = None
        self._island = Island()  # a single process until open() finds the trainer's ranks
        self._params: list[nn.Parameter] = []

    def open(self, model: nn.Module) -> None:
        self._params = list(model.parameters())
        sharded = is_sharded(self._params)
        if dist.is_available() and dist.is_initialized() and not sharded:
            self._island = Island(dist.get_rank(), dist.get_world_size())
            self._island.device = self._params[0].device
        island = self._island
        if island.is_leader or sharded:
            # DDP's leader claims every rank's tokens; a sharded rank claims its own.
            tokens = self.tokens_per_step * (1 if sharded else island.world_size)
            self.sync = DilocoSync(model, tokens_per_step=tokens, **self.settings)
            self.sync.open()
        island.broadcast_params(self._params)

    def step(self, loss: float = math.nan) -> None:
        changed = self.sync.step(loss=loss) if self.sync is not None else False
        if self._island.agree([int(changed)])[0]:
            self._island.broadcast_params(self._params)

    def close(self) -> None:
        if self.sync is not None:
            self.sync.close()
        self._island.broadcast_params(self._params)
