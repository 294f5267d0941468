"""The trainer callbacks (learner/adapters): a Hugging Face Trainer and a Lightning Trainer,
each with a tiny model built from code (nothing downloaded), sync through their callback and
end holding the server's parameters bit for bit; the core install imports neither library."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from learner.adapters.huggingface import DilocoCallback as HfCallback
from learner.adapters.lightning import DilocoCallback as LightningCallback

H = 4
REPO = str(Path(__file__).resolve().parents[2])


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


def test_the_core_install_imports_no_trainer_library() -> None:
    code = (
        "import sys, learner.api, learner.main, server.main\n"
        "loaded = {'transformers', 'lightning', 'accelerate', 'torchtitan'} & set(sys.modules)\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


DDP_SCRIPT = """
import json, sys, torch, torch.distributed as dist
from learner.adapters.driver import TrainingSync
from learner.island import exit_without_teardown
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
ddp = torch.nn.parallel.DistributedDataParallel(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
driver = TrainingSync(tokens_per_step=8, server=sys.argv[1], learner_id="ddp", insecure=True,
                      sync_every_steps=4)
driver.open(model)
for step in range(8):
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(100 * rank + step))
    loss = torch.nn.functional.mse_loss(ddp(x).squeeze(1), x.sum(1))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    driver.step(loss.item())
driver.close()
torch.save([p.detach() for p in model.parameters()], f"{sys.argv[2]}.{rank}")
json.dump({"synced": driver.sync is not None}, open(f"{sys.argv[2]}.{rank}.json", "w"))
dist.barrier()
dist.destroy_process_group()
exit_without_teardown()
"""


def test_ddp_ranks_under_a_trainer_are_one_learner(start_service, tmp_path) -> None:
    service = start_service(fragments=2, min_contributors=1, layout="balanced")
    script = tmp_path / "ddp.py"
    script.write_text(DDP_SCRIPT)
    out = tmp_path / "params"
    env = os.environ | {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
    launch = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
    ]
    subprocess.run([*launch, str(script), f"127.0.0.1:{service.port}", str(out)], env=env,
                   check=True, timeout=240)  # fmt: skip
    assert [json.loads(Path(f"{out}.{r}.json").read_text())["synced"] for r in (0, 1)] == [
        True,
        False,
    ]  # rank 0 syncs for the island
    assert service.aggregator.live_learners() == []  # it left
    assert [v for _, _, v in service.aggregator.layout()] == [2, 2]
    ranks = [torch.load(f"{out}.{r}") for r in (0, 1)]
    for fid, indices, _ in service.aggregator.layout():
        for i, want in zip(indices, service.aggregator.params(fid), strict=True):
            assert torch.equal(ranks[0][i], want) and torch.equal(ranks[1][i], want)
