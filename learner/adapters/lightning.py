"""Streaming DiLoCo in a PyTorch Lightning Trainer: one callback.

    from learner.adapters.lightning import DilocoCallback

    sync = DilocoCallback(server="10.0.0.5:50051", learner_id="a", insecure=True,
                          sync_every_steps=50, tokens_per_step=batch_size * seq_len)
    lightning.Trainer(max_steps=10_000, callbacks=[sync]).fit(module, data)

The callback joins the run when fitting starts (the module's parameters become the run's
global ones), calls DilocoSync.step() after every optimizer step (a batch that only
accumulates gradients is not one) and leaves when fitting ends, with the module holding the
global parameters. Under a strategy that shards the module with fully_shard (Lightning's
ModelParallelStrategy), each rank syncs its own slice (learner/sliced.py); under DDP the
ranks are one learner, rank 0 syncing for all (learner/adapters/driver.py). `callback.sync`
is the DilocoSync. Needs: pip install 'decoupled-diloco[lightning]'.
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl

from learner.adapters.driver import TrainingSync
from learner.api import DilocoSync


class DilocoCallback(pl.Callback):
    """Keeps a LightningModule in sync with a DiLoCo run, one optimizer step at a time."""

    def __init__(self, *, tokens_per_step: int = 1, **settings: Any) -> None:
        """`settings`: DilocoSync's (server, learner_id, TLS, sync_every_steps, ...);
        `tokens_per_step`: the tokens one optimizer step trains on (on this rank)."""
        super().__init__()
        self.driver = TrainingSync(tokens_per_step=tokens_per_step, **settings)
        self._global_step = 0

    @property
    def sync(self) -> DilocoSync | None:
        """The DilocoSync (None before fitting starts, and on DDP ranks but rank 0)."""
        return self.driver.sync

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.driver.open(pl_module)
        self._global_step = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self._global_step:
            return  # no optimizer step this batch (gradient accumulation)
        self._global_step = trainer.global_step
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        self.driver.step(float(loss) if loss is not None else math.nan)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.driver.close()
