"""A model sharded with FSDP2 across the ranks of one island, trained with Streaming DiLoCo
through the library API: every rank syncs its own slice, the island is one learner.

    diloco-server --insecure --listen 127.0.0.1:50051 &
    torchrun --standalone --nproc-per-node 2 -m learner.examples.fsdp_island \\
        --server 127.0.0.1:50051 --learner-id island-a --insecure

`--replicas 2` with 4 ranks trains as HSDP instead (2 replicas x 2 shards). On the CPU the
ranks talk over gloo; on GPUs over nccl, one GPU per rank. The built-in GPT on the built-in
corpus; `--summary-file` writes what each rank ended with (for tests).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import zlib
from pathlib import Path

import torch

from common.codec.fragment import params_crc32
from learner.api import DilocoSync
from learner.data import ShardedSampler, load_corpus
from learner.island import Island, exit_without_teardown
from learner.model import GPT, GPTConfig
from learner.sliced import local, shard_model


def main() -> None:
    parser = argparse.ArgumentParser(prog="fsdp_island", description=__doc__.splitlines()[0])
    parser.add_argument("--server", default="127.0.0.1:50051", help="host:port[,host:port...]")
    parser.add_argument("--learner-id", default="fsdp-island", help="the island's unique name")
    parser.add_argument("--insecure", action="store_true", help="plaintext, no TLS")
    parser.add_argument("--outer-steps", type=int, default=3, help="outer steps to train")
    parser.add_argument("--sync-every-steps", type=int, default=8, help="H, inner steps")
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per rank and step")
    parser.add_argument("--n-embd", type=int, default=64, help="the model's width")
    parser.add_argument(
        "--parallel",
        choices=("fsdp", "hsdp", "ddp", "none"),
        default="fsdp",
        help="how the island's ranks split the model (none: one process, no torchrun)",
    )
    parser.add_argument("--replicas", type=int, default=2, help="HSDP's replicas")
    parser.add_argument("--seed", type=int, default=0, help="model initialisation seed")
    parser.add_argument("--summary-file", default="", help="write each rank's result here")
    parser.add_argument("--save-params", default="", help="rank 0 saves the full parameters")
    parser.add_argument(
        "--state-dir", default="", help="resume each rank from here if it holds its state; save it"
    )
    args = parser.parse_args()
    logging.basicConfig(level="INFO", format="%(asctime)s %(name)s %(message)s")
    island = Island.from_env(os.environ)
    device = island.start(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(args.seed)  # the same initial model on every rank before sharding
    config = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=args.n_embd)
    model = GPT(config).to(device)
    train_model = model
    if args.parallel in ("fsdp", "hsdp"):
        replicas = args.replicas if args.parallel == "hsdp" else 1
        shard_model(model, list(model.blocks), replicas, device)
    elif args.parallel == "ddp":
        train_model = island.wrap(model)  # rank 0 syncs; the others take its parameters
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    train, _ = load_corpus("stdlib", max_bytes=1 << 20)
    seed = zlib.crc32(args.learner_id.encode())
    batches = ShardedSampler(
        train, args.batch_size, config.block_size, seed, island.rank, island.world_size
    )
    sync = None
    if args.parallel != "ddp" or island.is_leader:
        sync = DilocoSync(
            model,
            server=args.server,
            learner_id=args.learner_id,
            insecure=args.insecure,
            sync_every_steps=args.sync_every_steps,
            # DDP: the leader speaks for every rank's tokens; sharded: each rank for its own.
            tokens_per_step=args.batch_size
            * config.block_size
            * (island.world_size if args.parallel == "ddp" else 1),
        )
        state = Path(args.state_dir) / f"rank-{island.rank}.pt" if args.state_dir else None
        if state is not None and state.exists():  # this rank's slices and sync state
            saved = torch.load(state, weights_only=True)
            with torch.no_grad():
                for p, values in zip(model.parameters(), saved["params"], strict=True):
                    local(p).copy_(values)
            sync.load_state_dict(saved["sync"])
        sync.open()
    params = list(model.parameters())
    if args.parallel == "ddp":
        island.broadcast_params(params)  # every rank starts from the global values
    while not island.agree([sync.outer_steps >= args.outer_steps if sync else 0])[0]:
        x, y = batches.next()
        _, loss = train_model(x.to(device), y.to(device))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        changed = sync.step(loss=loss.item()) if sync else False
        if args.parallel == "ddp" and island.agree([int(changed)])[0]:
            island.broadcast_params(params)
    if sync is not None:
        sync.drain()  # every rank: the global parameters, still in the run
        if args.state_dir:
            Path(args.state_dir).mkdir(parents=True, exist_ok=True)
            saved = {"params": [local(p).clone() for p in model.parameters()]}
            torch.save(saved | {"sync": sync.state_dict()}, state)
        sync.close()
    if args.parallel == "ddp":
        island.broadcast_params(params)
    summary(args, island, sync, model, loss.item())
    island.close()
    if island.distributed:
        exit_without_teardown()  # gloo's threads may abort a finished rank's teardown


def summary(args, island: Island, sync: DilocoSync | None, model: GPT, loss: float) -> None:
    """Print (and with --summary-file, write) what this rank ended with."""
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    result = {
        "rank": island.rank,
        "slice_of": list(sync.island.slice_of) if sync and sync.island else [0, 1],
        "local_crc32": params_crc32([p.detach().cpu() for p in local]),
        "loss": loss,
    }
    if sync is not None:
        p = sync.progress
        result |= {
            "versions": p.versions,
            "params_crc32": p.params_crc32,  # of the replicas: the global fragments (slices)
            "bytes_sent": p.bytes_sent,
            "bytes_received": p.bytes_received,
            "tokens": p.tokens,
        }
    print(f"fsdp_island: {json.dumps(result)}", flush=True)
    if args.summary_file:
        with open(f"{args.summary_file}.{island.rank}", "w") as out:
            json.dump(result, out)
    if args.save_params:
        full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
        if island.is_leader:
            torch.save([p.detach().cpu() for p in full], args.save_params)


if __name__ == "__main__":
    main()
