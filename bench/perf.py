"""The performance suite: each hot path as a ratio against its ceiling, measured in one run.

    python -m bench.perf            # make bench: the four figures + short quality/decoupled
    python -m bench.perf --quick    # make bench-quick: the four figures alone, <= 3 minutes

Figures (each with its target), written to bench/results/perf.json and plotted:
- codec_vs_memcpy: fp4_e2m1 quantize + dequantize of a 64 MiB float32 tensor, one thread,
  as a fraction of clone() of the same tensor (target >= 1/3). The pure-torch path is
  measured in the same run as the baseline the C kernel replaces.
- ingest_vs_grpc: fp4 pushes through the real server (receive, validate, decode, accumulate)
  as a fraction of a bare gRPC bytes stream with the same chunks (target >= 0.8),
  bench/ingest.py.
- learner_step_overhead: inner step with the DiLoCo machinery on vs the plain loop, minus 1
  (target <= 0.02), bench/learner_overhead.py; also the longest GIL stall of the training
  thread while a large fragment is encoded and pushed.
- server_rss_vs_model: the model-sized copies the server holds: its peak RSS above idle
  grows by this many fp32 model sizes per model size, between 4 and 32 MiB models at 8
  learners (target <= 4, independent of the learner count), bench/load.py --slopes. The
  learner count's own part is load.server_rss_mb_per_learner (4 MiB, 8 vs --learners), and
  load.server_rss_vs_model the single 4 MiB run's peak above idle in model sizes (mostly
  that per-learner part at this size).
Printed beside them, without a target: sparse_encode_vs_memcpy, the top-k sparse encoder
(sparse_2bit, 64 of every 4096, common/codec/sparse.py) on a 64 MiB float32 tensor, one thread,
as a fraction of clone() of the same tensor, and its decode likewise (sparse_decode_vs_memcpy).
With a CUDA GPU, the codec and a training step on it (bench/cuda_check.py) are added.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.plotting import pyplot

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
TARGETS = {  # figure -> (target, "min" if higher is better else "max")
    "codec_vs_memcpy": (1 / 3, "min"),
    "ingest_vs_grpc": (0.8, "min"),
    "learner_step_overhead": (0.02, "max"),
    "server_rss_vs_model": (4.0, "max"),
}


def codec(size_mib: int, repeats: int) -> dict:
    """The CPU codec figure, single thread, with the C kernel and with the torch path."""
    from bench.cuda_check import time_codec
    from common.codec import native

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    saved = os.environ.get("DILOCO_FP4_KERNEL")
    try:
        os.environ["DILOCO_FP4_KERNEL"] = "native"
        if native.load() is None:
            raise RuntimeError("the FP4 C kernel did not build; see the log above")
        native = time_codec(torch.device("cpu"), size_mib, repeats)
        os.environ["DILOCO_FP4_KERNEL"] = "torch"
        reference = time_codec(torch.device("cpu"), size_mib, max(2, repeats // 3))
    finally:
        torch.set_num_threads(threads)
        if saved is None:
            os.environ.pop("DILOCO_FP4_KERNEL", None)
        else:
            os.environ["DILOCO_FP4_KERNEL"] = saved
    return {"native": native, "torch_path": reference}


def sparse_codec(size_mib: int, repeats: int) -> dict:
    """The sparse encoder and decoder against clone() of the same tensor, one thread."""
    from bench.cuda_check import median_s
    from common.codec.sparse import encode_sparse, sparse_entries
    from common.generated.diloco.v1 import aggregator_pb2 as pb

    threads, cpu = torch.get_num_threads(), torch.device("cpu")
    torch.set_num_threads(1)
    try:
        x = torch.randn(size_mib * (1 << 20) // 4, generator=torch.Generator().manual_seed(0))
        codec, k = pb.CODEC_SPARSE_2BIT, 64
        enc = encode_sparse(x, codec, k)
        payload, scales = enc.payload().numpy().tobytes(), enc.scales.numpy().tobytes()
        clone_s = median_s(lambda: x.clone(), cpu, repeats)
        encode_s = median_s(lambda: encode_sparse(x, codec, k), cpu, repeats)
        decode_s = median_s(
            lambda: sparse_entries(codec, payload, scales, x.numel(), k), cpu, repeats
        )
    finally:
        torch.set_num_threads(threads)
    return {
        "size_mib": size_mib,
        "clone_s": clone_s,
        "encode_s": encode_s,
        "decode_s": decode_s,
        "bits_per_param": 8 * (len(payload) + len(scales)) / x.numel(),
        "sparse_encode_vs_memcpy": clone_s / encode_s,
        "sparse_decode_vs_memcpy": clone_s / decode_s,
    }


def server_rss(learners: int, duration_s: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="perf-load-") as tmp:
        out = Path(tmp) / "load.json"
        subprocess.run(
            [sys.executable, "bench/load.py", "--learners", str(learners), "--slopes",
             "--duration-s", str(duration_s), "--out", str(out)],
            cwd=ROOT, check=True, timeout=3 * duration_s + 600,
        )  # fmt: skip
        return json.loads(out.read_text())


def short_benchmarks() -> dict:
    """The quality and decoupled benchmarks' quick versions (their own output folders)."""
    figures = {}
    with tempfile.TemporaryDirectory(prefix="perf-bench-") as tmp:
        subprocess.run(
            [sys.executable, "bench/quality.py", "--quick", "--out", tmp], cwd=ROOT, check=True
        )
        quality = json.loads(Path(tmp, "quality_quick.json").read_text())
        subprocess.run(
            [sys.executable, "bench/decoupled.py", "--quick", "--out", f"{tmp}/decoupled.json"],
            cwd=ROOT,
            check=True,
        )
        decoupled = json.loads(Path(tmp, "decoupled.json").read_text())
    figures["quality_quick"] = quality
    figures["decoupled_quick"] = {
        k: decoupled[k] for k in ("speedup_quorum_vs_sync", "goodput_quorum", "goodput_sync")
    }
    return figures


def cuda() -> dict:
    from bench.cuda_check import time_codec, time_training
    from learner.model import GPTConfig

    device = torch.device("cuda")
    config = GPTConfig(n_layer=8, n_embd=512, n_head=8, block_size=256)
    return {
        "device": torch.cuda.get_device_name(device),
        "codec": time_codec(device, 64, 20),
        "train": time_training(device, config, 32, 100, 4),
    }


def verdict(name: str, value: float) -> str:
    target, kind = TARGETS[name]
    ok = value >= target if kind == "min" else value <= target
    return f"{'ok' if ok else 'MISSED'} ({'>=' if kind == 'min' else '<='} {target:.3g})"


def plot(report: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return

    names = list(TARGETS)
    fig, ax = plt.subplots(figsize=(7, 3.5))
    # Each figure as a fraction of its target: >= 1 is good for "min", <= 1 for "max".
    scores = [report[n] / TARGETS[n][0] for n in names]
    colors = [
        "tab:green" if (s >= 1 if TARGETS[n][1] == "min" else s <= 1) else "tab:red"
        for n, s in zip(names, scores, strict=True)
    ]
    ax.barh(names, scores, color=colors)
    ax.axvline(1.0, color="black", linestyle="--", linewidth=1)
    ax.set_xlabel("measured / target (codec, ingest: >= 1 is met; overhead, RSS: <= 1)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the four figures, <= 3 minutes")
    parser.add_argument("--learners", type=int, default=64, help="for the RSS figure")
    parser.add_argument("--out", type=Path, default=RESULTS / "perf.json")
    args = parser.parse_args()
    from bench import ingest, learner_overhead

    started = time.monotonic()
    report: dict = {"quick": args.quick, "torch": torch.__version__, "cpus": os.cpu_count()}
    report["codec"] = codec(64, 3 if args.quick else 7)
    report["codec_vs_memcpy"] = report["codec"]["native"]["codec_vs_memcpy"]
    report["sparse"] = sparse_codec(64, 3 if args.quick else 7)
    report["sparse_encode_vs_memcpy"] = report["sparse"]["sparse_encode_vs_memcpy"]
    report["ingest"] = ingest.measure(quick=args.quick)
    report["ingest_vs_grpc"] = report["ingest"]["ingest_vs_grpc"]
    report["learner"] = learner_overhead.measure(quick=args.quick)
    report["learner_step_overhead"] = report["learner"]["learner_step_overhead"]
    report["load"] = server_rss(args.learners, 20.0 if args.quick else 60.0)
    report["server_rss_vs_model"] = report["load"]["server_rss_model_copies"]
    if torch.cuda.is_available():
        report["cuda"] = cuda()
    if not args.quick:
        report.update(short_benchmarks())
    report["wall_s"] = time.monotonic() - started
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    plot(report, args.out.with_suffix(".png"))
    print(f"\n{'figure':<24} {'measured':>10}  target")
    for name in TARGETS:
        print(f"{name:<24} {report[name]:>10.3f}  {verdict(name, report[name])}")
    load = report["load"]
    print(
        f"server RSS per learner {load['server_rss_mb_per_learner']:.2f} MB; one "
        f"{load['learners']}-learner run at {load['model_mib']} MiB: "
        f"{load['server_rss_vs_model']:.1f} model sizes above idle"
    )
    baseline = report["codec"]["torch_path"]["codec_vs_memcpy"]
    print(f"codec_vs_memcpy of the pure-torch path (the baseline) {baseline:.3f}")
    sparse = report["sparse"]
    print(
        f"sparse_encode_vs_memcpy {sparse['sparse_encode_vs_memcpy']:.3f} (sparse_2bit, 64 of "
        f"4096, {sparse['bits_per_param']:.3f} bits/param); decode "
        f"{sparse['sparse_decode_vs_memcpy']:.3f}"
    )
    gil = report["learner"]["gil"]
    print(
        f"longest training-thread stall while pushing {gil['fragment_mib']} MiB: "
        f"{gil['max_stall_busy_ms']:.1f} ms (idle {gil['max_stall_idle_ms']:.1f} ms)"
    )
    if "cuda" in report:
        print(f"CUDA codec_vs_memcpy {report['cuda']['codec']['codec_vs_memcpy']:.3f}")
    print(f"wrote {args.out} in {report['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
