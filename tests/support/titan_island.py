"""A tiny torchtitan llama trained by DilocoTrainer on the CPU, one rank per process:

    python -m torch.distributed.run --standalone --nproc-per-node 2 \
        -m tests.support.titan_island --dump-folder DIR --training.steps 12 \
        --diloco.connection.server 127.0.0.1:PORT --diloco.connection.learner-id titan \
        --diloco.connection.insecure --diloco.sync.sync-every-steps 4

torchtitan's own command line parses the flags (torchtitan.config.ConfigManager), so the
`diloco` section is set as a user would set it. torchtitan trains on accelerators only; four
stand-ins here make its Trainer run on the CPU with gloo, none of them part of the recipe:
its device (it picks cuda when it finds none) is the CPU; attention is SDPA (FlexAttention
has no backward on the CPU; with one document per sequence, causal SDPA applies the same
mask); FSDP reduces gradients by SUM then divides (gloo has no PREMUL_SUM); the data are
random tokens with their positions, and the tokenizer is bytes. When training ends, rank 0
writes the model's full parameters to DIR/params.pt and every rank its progress to
DIR/rank.N.json.
"""

from __future__ import annotations

import json
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist


def _point_torchtitan_at_the_cpu() -> None:
    """torchtitan's modules copy its device type and module when imported: set them first."""
    import torchtitan.tools.utils as titan_utils

    titan_utils.device_type = "cpu"
    titan_utils.device_module = types.SimpleNamespace(
        set_device=lambda device: None,
        current_device=lambda: 0,
        device_count=lambda: 1,
        get_device_name=lambda device=None: "cpu",
        get_device_properties=lambda device=None: types.SimpleNamespace(
            name="cpu", total_memory=1 << 33
        ),
        memory_stats=lambda device=None: {},
        reset_peak_memory_stats=lambda device=None: None,
        empty_cache=lambda: None,
        synchronize=torch.cpu.synchronize,
    )


_point_torchtitan_at_the_cpu()

# torchtitan's modules, imported once its device is the CPU.
from torchtitan.components.checkpoint import CheckpointManager  # noqa: E402
from torchtitan.components.dataloader import BaseDataLoader  # noqa: E402
from torchtitan.components.loss import CrossEntropyLoss  # noqa: E402
from torchtitan.components.metrics import MetricsProcessor  # noqa: E402
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw  # noqa: E402
from torchtitan.components.tokenizer import BaseTokenizer  # noqa: E402
from torchtitan.config import ConfigManager, ParallelismConfig, TrainingConfig  # noqa: E402
from torchtitan.models.common.attention import ScaledDotProductAttention  # noqa: E402
from torchtitan.models.llama3 import model_registry  # noqa: E402
from torchtitan.tools.logging import init_logger  # noqa: E402

from learner.adapters.torchtitan import DilocoTrainer  # noqa: E402
from learner.island import exit_without_teardown  # noqa: E402

MODULE = "tests.support.titan_island"
VOCAB = 2048  # the llama3 debug model's


class ByteTokenizer(BaseTokenizer):
    """Bytes as tokens: torchtitan builds a tokenizer even when the data come tokenized."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        pass

    def __init__(self, config: Config | None = None, *, tokenizer_path: str = "") -> None:
        super().__init__()
        self.eos_id = 0

    def encode(self, text: str, **kwargs) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int], **kwargs) -> str:
        return bytes(ids).decode(errors="replace")

    def get_vocab_size(self) -> int:
        return 256


class RandomTokens(BaseDataLoader):
    """Each rank's own random sequences, one document each: (B, T) inputs, positions, labels."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        pass

    def __init__(
        self, config: Config, *, dp_rank: int, seq_len: int, local_batch_size: int, **kwargs
    ) -> None:
        self.rank, self.seq_len, self.batch_size = dp_rank, seq_len, local_batch_size
        self.batches = 0

    def __iter__(self):
        while True:
            seed = 1000 * self.rank + self.batches
            self.batches += 1
            g = torch.Generator().manual_seed(seed)
            ids = torch.randint(0, VOCAB, (self.batch_size, self.seq_len + 1), generator=g)
            positions = torch.arange(self.seq_len).expand(self.batch_size, -1).contiguous()
            yield {"input": ids[:, :-1], "positions": positions}, ids[:, 1:]

    def state_dict(self) -> dict:
        return {"batches": self.batches}

    def load_state_dict(self, state: dict) -> None:
        self.batches = state["batches"]


def sum_then_divide(optimizers, model_parts, parallel_dims) -> None:
    """Gloo reduces by SUM, AVG or MAX, not PREMUL_SUM: FSDP sums and divides after."""
    from torch.distributed.fsdp import FSDPModule

    for part in model_parts:
        for module in part.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)


def tiny_llama() -> DilocoTrainer.Config:
    """torchtitan's llama3 debug model (6 layers, dim 256, 6.2 M parameters), FSDP2."""
    spec = model_registry("debugmodel")
    for layer in spec.model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    spec.post_optimizer_build_fn = sum_then_divide
    return DilocoTrainer.Config(
        model_spec=spec,
        tokenizer=ByteTokenizer.Config(),
        dataloader=RandomTokens.Config(),
        loss=CrossEntropyLoss.Config(global_vocab_size=VOCAB),
        optimizer=default_adamw(lr=1e-3),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=1),
        parallelism=ParallelismConfig(spmd_backend="partial_dtensor"),
        training=TrainingConfig(
            local_batch_size=2, seq_len=32, steps=12, disable_cuda_graphs=True, gc_freq=1000
        ),
        metrics=MetricsProcessor.Config(log_freq=1),
        checkpoint=CheckpointManager.Config(enable=False),
    )


def report(trainer: DilocoTrainer, folder: Path) -> None:
    """Rank 0: the model's full parameters; every rank: its progress and slice."""
    full = [p.full_tensor().detach() for p in trainer.model_parts[0].parameters()]
    rank = dist.get_rank()
    if rank == 0:
        torch.save(full, folder / "params.pt")
    p, island = trainer.diloco.progress, trainer.diloco.island
    progress = {
        "inner_steps": p.inner_steps,
        "outer_steps": p.outer_steps,
        "tokens": p.tokens,
        "versions": p.versions,
        "slice_of": list(island.slice_of) if island else None,
    }
    (folder / f"rank.{rank}.json").write_text(json.dumps(progress))


def main() -> None:
    sys.modules.setdefault(MODULE, sys.modules[__name__])  # ConfigManager imports it by name
    init_logger()
    args = ["--module", MODULE, "--config", "tiny_llama", *sys.argv[1:]]
    config = ConfigManager().parse_args(args)
    trainer = config.build()
    try:
        trainer.train()
        report(trainer, Path(config.dump_folder))
    finally:
        trainer.close()
    dist.barrier()
    dist.destroy_process_group()
    exit_without_teardown()


if __name__ == "__main__":
    main()
