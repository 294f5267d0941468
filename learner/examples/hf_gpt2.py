"""A Hugging Face GPT-2, built from a small config (random init, nothing downloaded), trained
with Streaming DiLoCo through the library API (learner/api.py) in a plain training loop.

    diloco-server --insecure --listen 127.0.0.1:50051 &
    python -m learner.examples.hf_gpt2 --server 127.0.0.1:50051 --learner-id hf-a --insecure

Byte-level (vocab 256) on the built-in corpus, so no tokenizer is downloaded either. Needs
the optional extra: pip install 'decoupled-diloco[hf]'.
"""

from __future__ import annotations

import argparse
import logging
import sys
import zlib

import torch

from learner.api import DilocoSync
from learner.data import ShardedSampler, load_corpus


def main() -> None:
    parser = argparse.ArgumentParser(prog="hf_gpt2", description=__doc__.splitlines()[0])
    parser.add_argument("--server", default="127.0.0.1:50051", help="the aggregator, host:port")
    parser.add_argument("--learner-id", default="hf-gpt2", help="this learner's unique name")
    parser.add_argument("--outer-steps", type=int, default=5, help="outer steps to train")
    parser.add_argument("--sync-every-steps", type=int, default=10, help="H, inner steps")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per inner step")
    parser.add_argument("--block-size", type=int, default=64, help="context length in bytes")
    parser.add_argument("--insecure", action="store_true", help="plaintext, no TLS")
    args = parser.parse_args()
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        sys.exit("hf_gpt2: needs Hugging Face transformers: pip install 'decoupled-diloco[hf]'")
    logging.basicConfig(level="INFO", format="%(asctime)s %(name)s %(message)s")
    torch.manual_seed(0)
    # Bytes as tokens; byte 0 stands in for GPT-2's end-of-text id (50256 is out of range).
    config = GPT2Config(
        vocab_size=256,
        n_positions=args.block_size,
        n_embd=64,
        n_layer=2,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config)  # random weights from the config: no download
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train, _ = load_corpus("stdlib", max_bytes=1 << 20)
    seed = zlib.crc32(args.learner_id.encode())  # each learner its own order
    batches = ShardedSampler(train, args.batch_size, args.block_size, seed)
    sync = DilocoSync(
        model,
        server=args.server,
        learner_id=args.learner_id,
        insecure=args.insecure,
        sync_every_steps=args.sync_every_steps,
        tokens_per_step=args.batch_size * args.block_size,
    )
    first_loss = None
    with sync:
        while sync.outer_steps < args.outer_steps:
            x, _ = batches.next()
            loss = model(input_ids=x, labels=x).loss  # the model shifts the labels itself
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            sync.step(loss=loss.item())
            first_loss = first_loss or loss.item()
    print(
        f"hf_gpt2: learner={args.learner_id} outer_steps={sync.outer_steps} "
        f"versions={sync.progress.versions} train_loss={first_loss:.3f}->{loss.item():.3f}"
    )


if __name__ == "__main__":
    main()
