"""Streaming DiLoCo in a Hugging Face Trainer: one callback.

    from learner.adapters.huggingface import DilocoCallback

    sync = DilocoCallback(server="10.0.0.5:50051", learner_id="a", insecure=True,
                          sync_every_steps=50, tokens_per_step=batch_size * seq_len)
    Trainer(model=model, args=args, train_dataset=data, callbacks=[sync]).train()

The callback joins the run when training begins (the model's parameters become the run's
global ones), calls DilocoSync.step() after every optimizer step (so gradient accumulation
counts as one inner step) and leaves when training ends, with the model holding the global
parameters. The Trainer's optimizer, scheduler, mixed precision and logging stay its own.
Under Accelerate's FSDP2 (fully_shard), each rank syncs its own slice of the model
(learner/sliced.py); under DDP the ranks are one learner, rank 0 syncing for all
(learner/adapters/driver.py). `callback.sync` is the DilocoSync, for its progress, versions
and metrics registry. Needs: pip install 'decoupled-diloco[hf]'.
"""

from __future__ import annotations

import math
from typing import Any

from transformers import TrainerCallback

from learner.adapters.driver import TrainingSync
from learner.api import DilocoSync


class DilocoCallback(TrainerCallback):
    """Keeps a Trainer's model in sync with a DiLoCo run, one optimizer step at a time."""

    def __init__(self, *, tokens_per_step: int = 1, **settings: Any) -> None:
        """`settings`: DilocoSync's (server, learner_id, TLS, sync_every_steps, ...);
        `tokens_per_step`: the tokens one optimizer step trains on (on this rank)."""
        self.driver = TrainingSync(tokens_per_step=tokens_per_step, **settings)
        self._last_loss = math.nan

    @property
    def sync(self) -> DilocoSync | None:
        """The DilocoSync (None before training starts, and on DDP ranks but rank 0)."""
        return self.driver.sync

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is None:
            raise ValueError("DilocoCallback needs the Trainer's model")
        self.driver.open(model)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self._last_loss = float(logs["loss"])

    def on_step_end(self, args, state, control, **kwargs):
        self.driver.step(self._last_loss)

    def on_train_end(self, args, state, control, **kwargs):
        self.driver.close()
