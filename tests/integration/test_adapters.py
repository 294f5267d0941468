"""The trainer callbacks (learner/adapters): a Hugging Face Trainer and a Lightning Trainer,
each with a tiny model built from code (nothing downloaded), sync through their callback and
end holding the server's parameters bit for bit; the core install imports neither library."""

from __future__ import annotations

import subprocess
import sys

import torch

from learner.adapters.huggingface import DilocoCallback as HfCallback
from learner.adapters.lightning import DilocoCallback as LightningCallback

H = 4


def assert_holds_the_servers_parameters(service, model: torch.nn.Module) -> None:
    params = [p.detach() for _, p in model.named_parameters()]
    for fid, indices, _ in service.aggregator.layout():
        for i, want in zip(indices, service.aggregator.params(fid), strict=True):
            assert torch.equal(params[i].cpu(), want)


def test_a_hugging_face_trainer_syncs_through_its_callback(start_service, tmp_path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    service = start_service(fragments=2, min_contributors=1)
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=256,
        n_positions=32,
        n_embd=32,
        n_layer=2,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config)  # from the config: random weights, no download
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 256, (64, 32))]
    callback = HfCallback(
        server=f"127.0.0.1:{service.port}",
        learner_id="hf",
        insecure=True,
        sync_every_steps=H,
        tokens_per_step=4 * 32,
    )
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=3 * H,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        learning_rate=1e-3,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        logging_steps=1,
        disable_tqdm=True,
    )
    Trainer(model=model, args=args, train_dataset=data, callbacks=[callback]).train()
    progress = callback.sync.progress
    # An optimizer step (two accumulated batches) is one inner step.
    assert (progress.inner_steps, progress.outer_steps) == (3 * H, 3)
    assert [v for _, _, v in service.aggregator.layout()] == [3, 3]
    assert progress.tokens == 3 * H * 4 * 32
    assert_holds_the_servers_parameters(service, model)


def test_a_lightning_trainer_syncs_through_its_callback(start_service, tmp_path) -> None:
    import lightning.pytorch as pl

    class Regression(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
            )

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    service = start_service(fragments=2, min_contributors=1, layout="balanced")
    torch.manual_seed(0)
    x = torch.randn(256, 8)
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=8
    )
    module = Regression()
    callback = LightningCallback(
        server=f"127.0.0.1:{service.port}",
        learner_id="pl",
        insecure=True,
        sync_every_steps=H,
        tokens_per_step=8,
    )
    trainer = pl.Trainer(
        max_steps=2 * H,
        accelerator="cpu",
        accumulate_grad_batches=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
        default_root_dir=str(tmp_path),
    )
    trainer.fit(module, data)
    progress = callback.sync.progress
    assert (progress.inner_steps, progress.outer_steps) == (2 * H, 2)
    assert [v for _, _, v in service.aggregator.layout()] == [2, 2]
    assert_holds_the_servers_parameters(service, module)


def test_the_core_install_imports_neither_trainer_library() -> None:
    code = (
        "import sys, learner.api, learner.main, server.main\n"
        "loaded = {'transformers', 'lightning', 'accelerate'} & set(sys.modules)\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
