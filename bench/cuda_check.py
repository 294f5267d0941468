"""The CUDA path, checked and timed on a GPU: codec bytes, codec throughput, training steps.

    python -m bench.cuda_check --out bench/results/cuda.json          # needs a CUDA GPU
    python -m bench.cuda_check --device cpu --size-mib 8 --quick      # the same checks on CPU

1. Bit-identity: every codec encodes a tensor on the device to exactly the bytes it gives on
   the CPU, and decodes on the device to exactly the CPU's values (edge values included).
2. Codec throughput: fp4_e2m1 quantize + dequantize of a `--size-mib` float32 tensor on the
   device, as a ratio against a plain `clone()` of the same tensor in the same run (the
   device's memcpy ceiling). Also the whole `encode()` (packed bytes copied to the host).
3. Training: one inner step (forward, backward, AdamW) of a GPT on the device, then the same
   loop with the Streaming DiLoCo machinery on (learner/streaming.py over the real in-process
   aggregator, fp4 both ways; sync work runs inline here, so this is its full cost, an upper
   bound on what the overlapped learner pays).
Timings are medians of CUDA-synchronised wall-clock repeats.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from bench.simulate import InProcessTransport
from common.codec.fp4 import dequantize_fp4, quantize_fp4
from common.codec.tensor import CODECS, decode, encode
from learner.model import GPT, GPTConfig
from learner.streaming import FragmentReplica, PullReply, Schedule, StreamingSync
from server.aggregator import Aggregator
from server.config import aggregator_config
from server.state.params import ParamSpec


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_s(fn, device: torch.device, repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        synchronize(device)
        started = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def check_bit_identity(device: torch.device) -> dict:
    torch.manual_seed(0)
    values = torch.randn(1 << 20) * torch.logspace(-40, 38, 1 << 20).clamp(max=1e37)
    values[:8] = torch.tensor([0.0, -0.0, 3.4e38, -3.4e38, 1e-44, -6.0, 6.0, 0.25])
    results = {}
    for name in CODECS:
        reference = encode(values, name)
        same_bytes = encode(values.to(device), name) == reference
        same_values = torch.equal(decode(reference, device=device).cpu(), decode(reference))
        results[name] = same_bytes and same_values
    gen_cpu = torch.Generator().manual_seed(7)
    gen_dev = torch.Generator().manual_seed(7)
    stochastic = encode(values, "fp4_e2m1", "stochastic", gen_cpu) == encode(
        values.to(device), "fp4_e2m1", "stochastic", gen_dev
    )
    results["fp4_e2m1_stochastic_cpu_generator"] = stochastic
    return results


def time_codec(device: torch.device, size_mib: int, repeats: int) -> dict:
    numel = size_mib * (1 << 20) // 4
    x = torch.randn(numel, device=device)
    packed, scales = quantize_fp4(x)
    clone_s = median_s(lambda: x.clone(), device, repeats)
    quantize_s = median_s(lambda: quantize_fp4(x), device, repeats)
    dequantize_s = median_s(lambda: dequantize_fp4(packed, scales, numel), device, repeats)
    encode_s = median_s(lambda: encode(x, "fp4_e2m1"), device, max(3, repeats // 3))
    return {
        "size_mib": size_mib,
        "clone_s": clone_s,
        "clone_gb_per_s": 2 * 4 * numel / clone_s / 1e9,  # bytes read + written
        "quantize_s": quantize_s,
        "dequantize_s": dequantize_s,
        "encode_to_host_bytes_s": encode_s,
        "codec_vs_memcpy": clone_s / (quantize_s + dequantize_s),
    }


def train_setup(device: torch.device, config: GPTConfig, batch_size: int):
    torch.manual_seed(0)
    model = GPT(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    x = torch.randint(0, 256, (batch_size, config.block_size), device=device)
    y = torch.roll(x, -1, dims=1)

    def step() -> None:
        _, loss = model(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return model, step


def time_training(
    device: torch.device, config: GPTConfig, batch_size: int, steps: int, fragments: int
) -> dict:
    model, step = train_setup(device, config, batch_size)
    numel = sum(p.numel() for p in model.parameters())
    plain_s = median_s(step, device, repeats=steps, warmup=5)

    # The same loop with Streaming DiLoCo: P fragments, H = 20, τ = 1, fp4 pushes and pulls.
    params = [p for _, p in model.named_parameters()]
    specs = [ParamSpec(n, tuple(p.shape), "float32") for n, p in model.named_parameters()]
    aggregator = Aggregator(aggregator_config(lease_s=1e9, fragments=fragments))
    session = aggregator.join("cuda-check", specs).session_id
    replicas = []
    for fid, indices, _ in aggregator.layout():
        aggregator.initialize(session, fid, [params[i].detach().cpu() for i in indices])
        replica = FragmentReplica(fid, indices, [tuple(params[i].shape) for i in indices])
        r = aggregator.pull(session, fid, -1)
        replica.apply(PullReply(r.kind, r.version, r.payload, r.params_crc32))
        replicas.append(replica)
    schedule = Schedule(sync_every_steps=20, fragments=fragments, overlap_steps=1)
    sync = StreamingSync(
        params, replicas, schedule, InProcessTransport(aggregator, session), "fp4_e2m1", 0.5
    )
    sync.load_globals()
    synchronize(device)
    started = time.perf_counter()
    for t in range(1, steps + 1):
        step()
        sync.push_phase(t)
        sync.merge_phase(t)
    synchronize(device)
    with_sync_s = (time.perf_counter() - started) / steps
    sync.merge_phase(steps + 1)  # the syncs still in flight
    tokens = batch_size * config.block_size
    return {
        "params": numel,
        "fragments": fragments,
        "batch_tokens": tokens,
        "plain_step_s": plain_s,
        "plain_tokens_per_s": tokens / plain_s,
        "streaming_step_s": with_sync_s,
        "streaming_syncs": sync.stats.syncs,
        "streaming_overhead_inline": with_sync_s / plain_s - 1,
        "replicas_match_server": all(
            torch.equal(
                torch.cat([p.flatten() for p in rep.params]),
                torch.cat([p.flatten() for p in aggregator.params(rep.fragment_id)]),
            )
            for rep in replicas
        ),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--size-mib", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="small model, few repeats")
    parser.add_argument("--out", default="", help="write the figures as JSON here")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA GPU here; run with --device cpu to check the same path on CPU")
    repeats = 5 if args.quick else 20
    report: dict = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "codec_bit_identical": check_bit_identity(device),
        "codec": time_codec(device, args.size_mib, repeats),
    }
    if device.type == "cuda":
        report["codec_cpu_same_size"] = time_codec(torch.device("cpu"), args.size_mib, 3)
    small = GPTConfig(n_layer=2, n_embd=128, n_head=4, block_size=128)
    large = GPTConfig(n_layer=8, n_embd=512, n_head=8, block_size=256)
    report["train_small"] = time_training(device, small, 16, 40 if args.quick else 100, 2)
    if not args.quick:
        report["train_large"] = time_training(device, large, 32, 100, 4)
    print(json.dumps(report, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    ok = all(report["codec_bit_identical"].values()) and all(
        v["replicas_match_server"] for k, v in report.items() if k.startswith("train_")
    )
    print("OK" if ok else "FAILED: a device result differs from the CPU's")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
