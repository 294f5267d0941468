"""One rank of bench/islands.py: trains the built-in GPT with Streaming DiLoCo (a sharded
island under torchrun, or one process) and writes what this rank's outer sync cost it.

    python -m bench.island_worker --server HOST:PORT --out DIR [--n-embd 512 ...]
    torchrun --nproc-per-node 2 -m bench.island_worker --server HOST:PORT --out DIR

Measured on this rank (DIR/rank-R.json):
- outer_state_bytes: the bytes the sync holds between syncs: the replicas of the global
  fragments (the anchor of each pseudo-gradient; slices on a sharded island) and any
  error-feedback residuals; counted from the tensors themselves.
- outer_state_rss_mb: the resident memory that joining (pulling the replicas) added.
- push_peak_mb: the most resident memory rose during a step() that pushed (its deltas and
  encoding), read as the peak since a reset (/proc/self/clear_refs) minus the memory before.
  Run with MALLOC_MMAP_THRESHOLD_=65536 (bench/islands.py does, in a pass of its own): every
  allocation above 64 KiB is then mapped fresh and unmapped when freed, so resident memory
  follows the live tensors instead of glibc's reuse of freed blocks.
- compute_s, sync_s, blocked_s: seconds in the inner steps (forward, backward, optimizer),
  in step() (encode, collectives, merges) and, of those, waiting at merges for a round.
- bytes_sent, bytes_received: this rank's traffic with the aggregator.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import zlib
from pathlib import Path

import torch

from bench.procfs import field_kib
from learner.api import DilocoSync
from learner.data import ShardedSampler, load_corpus
from learner.island import Island, exit_without_teardown
from learner.model import GPT, GPTConfig
from learner.sliced import shard_model


def reset_peak_rss() -> bool:
    """Reset this process's VmHWM to its VmRSS (Linux >= 4.0); False where refused."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def rss_mb() -> float:
    return field_kib("/proc/self/status", "VmRSS") / 1024


def peak_mb() -> float:
    return field_kib("/proc/self/status", "VmHWM") / 1024


def outer_state_bytes(sync: DilocoSync) -> int:
    """Bytes of the replicas and residuals the sync holds."""
    held = sync.session.sync
    assert held is not None
    tensors = [p for r in held.replicas for p in r.params]
    tensors += [e for residuals in held.push_residuals.values() for e in residuals]
    return sum(t.numel() * t.element_size() for t in tensors)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--n-embd", type=int, default=512)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per rank and step")
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--sync-every-steps", type=int, default=20, help="H")
    parser.add_argument("--outer-steps", type=int, default=2, help="measured outer steps")
    parser.add_argument("--overlap-steps", type=int, default=1, help="tau")
    parser.add_argument("--push-codec", default="fp4_e2m1")
    args = parser.parse_args()
    island = Island.from_env(os.environ)
    device = island.start(torch.device("cpu"))
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = GPTConfig(
        vocab_size=256, block_size=args.block_size, n_layer=args.n_layer, n_head=8,
        n_embd=args.n_embd,
    )  # fmt: skip
    model = GPT(config)
    if island.distributed:
        shard_model(model, list(model.blocks), 1, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train, _ = load_corpus("stdlib", max_bytes=4 << 20)
    batches = ShardedSampler(
        train, args.batch_size, args.block_size, zlib.crc32(b"bench"), island.rank,
        island.world_size,
    )  # fmt: skip

    def inner_step() -> float:
        started = time.perf_counter()
        x, y = batches.next()
        _, loss = model(x, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return time.perf_counter() - started

    inner_step()  # the optimizer's state exists before anything is measured
    sync = DilocoSync(
        model, server=args.server, learner_id="bench-island", insecure=True,
        sync_every_steps=args.sync_every_steps, push_codec=args.push_codec,
        overlap_steps=args.overlap_steps,
        tokens_per_step=args.batch_size * args.block_size,
    )  # fmt: skip
    before = rss_mb()
    sync.open()
    joined = {"outer_state_bytes": outer_state_bytes(sync), "outer_state_rss_mb": rss_mb() - before}
    compute_s = sync_s = push_peak = 0.0
    schedule = sync.session.sync.schedule  # type: ignore[union-attr]
    while sync.outer_steps < args.outer_steps:
        step_s = inner_step()
        compute_s += step_s
        pushes = bool(schedule.pushes_at(sync.schedule_step + 1))
        base = rss_mb()
        if pushes:
            reset_peak_rss()
        started = time.perf_counter()
        sync.step(compute_s=step_s)
        sync_s += time.perf_counter() - started
        if pushes:
            push_peak = max(push_peak, peak_mb() - base)
    blocked_s = sync.stats.blocked_s if sync.stats else 0.0  # of the steps timed (not close's)
    progress = sync.close()
    result = {
        "rank": island.rank,
        "ranks": island.world_size,
        "slice_of": list(sync.island.slice_of) if sync.island else [0, 1],
        "params": sum(p.numel() for p in model.parameters()),
        **joined,
        "outer_state_bytes_end": outer_state_bytes(sync),
        "push_peak_mb": push_peak,
        "compute_s": compute_s,
        "sync_s": sync_s,
        "blocked_s": blocked_s,
        "inner_steps": progress.inner_steps,
        "bytes_sent": progress.bytes_sent,
        "bytes_received": progress.bytes_received,
        "fragments": len(progress.versions),
        # Each fragment's replica on this rank: the slice a push of it encodes.
        "fragment_bytes": [
            sum(p.numel() * p.element_size() for p in r.params)
            for r in sync.session.sync.replicas  # type: ignore[union-attr]
        ],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank-{island.rank}.json").write_text(json.dumps(result))
    island.close()
    if island.distributed:
        exit_without_teardown()  # gloo's threads may abort a finished rank's teardown


if __name__ == "__main__":
    main()
