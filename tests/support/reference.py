"""Plain DiLoCo in a few lines of torch: the independent reference the golden run is held to.

    params = reference_diloco(config, ["golden-a", "golden-b"], outer_steps=4)

Each learner starts from the model its config's seed makes, draws its own batches (the
learner's data shards, seeded by its id, as the daemon does), and trains H inner steps with
AdamW between syncs; the global parameters then take one torch.optim.SGD(nesterov=True)
step along the mean of the learners' pseudo-gradients, and every learner starts its next H
steps from them. This is what the whole system (learner processes, gRPC, codec, server
rounds, outer step, pulls) must compute for one fragment, no overlap, merge α = 0, fp32 both
ways and the outer momentum warm-up off: none of that machinery is used here. The model and
the data pipeline are the learner's own (they are not what the golden run checks).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch

from learner.config import LearnerConfig
from learner.data import ShardedSampler, load_corpus
from learner.model import GPT


def reference_diloco(
    config: LearnerConfig, learner_ids: Sequence[str], outer_steps: int, outer_lr: float = 0.7
) -> list[torch.Tensor]:
    """The global parameters after `outer_steps` syncs of plain DiLoCo (see the module
    docstring), in the model's parameter order."""
    model_cfg, data, training = config.model, config.data, config.training
    h = config.sync.sync_every_steps
    train, _ = load_corpus(data.corpus, data.corpus_max_bytes)
    models, optimizers, samplers = [], [], []
    for learner_id in learner_ids:
        torch.manual_seed(training.seed)  # as each learner process seeds its model
        model = GPT(model_cfg)
        models.append(model)
        optimizers.append(
            torch.optim.AdamW(
                model.parameters(), lr=training.inner_lr, weight_decay=training.weight_decay
            )
        )
        seed = training.seed * 1_000_003 + zlib.crc32(learner_id.encode())
        samplers.append(
            ShardedSampler(
                train,
                data.batch_size,
                model_cfg.block_size,
                seed,
                shard=data.data_shard,
                shards=max(1, data.data_shards),
                vocab_size=model_cfg.vocab_size,
            )
        )
    # The first learner's initial parameters are the run's (all are equal: one seed).
    global_params = [p.detach().clone() for p in models[0].parameters()]
    outer = torch.optim.SGD(global_params, lr=outer_lr, momentum=0.9, nesterov=True)
    for _ in range(outer_steps):
        deltas = []
        for model, optimizer, sampler in zip(models, optimizers, samplers, strict=True):
            with torch.no_grad():
                for p, g in zip(model.parameters(), global_params, strict=True):
                    p.copy_(g)
            model.train()
            for _ in range(h):
                x, y = sampler.next()
                _, loss = model(x, y)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
            deltas.append(
                [g - p.detach() for p, g in zip(model.parameters(), global_params, strict=True)]
            )
        outer.zero_grad()
        for i, g in enumerate(global_params):
            g.grad = sum(d[i] for d in deltas) / len(deltas)
        outer.step()
    return [g.detach() for g in global_params]
