"""A sharded island's outer sync at R = 1, 2 and 4 ranks: per-rank memory, wire bytes and
time (bench/island_worker.py on each rank: FSDP2 over gloo, or one process at R = 1),
against one in-process aggregator, all in one run.

    python -m bench.islands            # 12.8 M params, H = 20: about 6 minutes here
    python -m bench.islands --quick    # 3.2 M params: about 2 minutes

Targets (docs/islands.md), each against R = 1 measured in the same run:
- the outer state per rank at most 1.1 x (1/R) of one rank's, plus one slice (the largest
  fragment's slice at R), and the same for the push path's peak;
- the island's wire bytes (every rank's pushes) equal to one process's (framing aside);
- the outer sync adds at most 1% to the inner compute at H >= 20 (the slowest rank's
  seconds in step() over its seconds in forward, backward and optimizer).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from common.config import build_config
from server.config import ServerConfig
from server.main import AggregatorService

RESULTS = Path(__file__).parent / "results"
ENV = os.environ | {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}  # loopback only


def run_island(
    ranks: int, worker_flags: list[str], fragments: int, out: Path, env: dict[str, str]
) -> list[dict]:
    """Every rank's result for an island of `ranks` against a fresh aggregator."""
    settings = {"listen": "127.0.0.1:0", "insecure": True, "fragments": fragments}
    service = AggregatorService(build_config(ServerConfig, settings | {"min_contributors": 1}))
    service.start()
    try:
        launch = [sys.executable]
        if ranks > 1:
            launch += [
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                str(ranks),
            ]
        argv = [*launch, "-m", "bench.island_worker", "--server", f"127.0.0.1:{service.port}"]
        subprocess.run([*argv, "--out", str(out), *worker_flags], env=env, check=True, timeout=1800)
    finally:
        service.stop(grace_s=0)
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(ranks)]


def figures(runs: dict[int, list[dict]], memory: dict[int, list[dict]]) -> list[dict]:
    """Per R, the measured figures and their ratios to R = 1's (`memory`: the pass whose
    allocator maps every large block fresh, for the push path's peak)."""
    (one,), (one_memory,) = runs[1], memory[1]
    rows = []
    for ranks, results in sorted(runs.items()):
        slice_bytes = max(one["fragment_bytes"]) / ranks
        state = max(r["outer_state_bytes"] for r in results)
        push_mb = max(r["push_peak_mb"] for r in memory[ranks])
        rows.append(
            {
                "ranks": ranks,
                "params": one["params"],
                "outer_state_mb": state / 1e6,
                "outer_state_target_mb": (1.1 * one["outer_state_bytes"] / ranks + slice_bytes)
                / 1e6,
                "outer_state_rss_mb": max(r["outer_state_rss_mb"] for r in memory[ranks]),
                "push_peak_mb": push_mb,
                "push_peak_target_mb": 1.1 * one_memory["push_peak_mb"] / ranks + slice_bytes / 1e6,
                "wire_ratio": sum(r["bytes_sent"] for r in results) / one["bytes_sent"],
                "sync_over_compute": max(r["sync_s"] / r["compute_s"] for r in results),
                "blocked_over_compute": max(r["blocked_s"] / r["compute_s"] for r in results),
                "compute_s_per_step": max(r["compute_s"] / r["inner_steps"] for r in results),
            }
        )
    return rows


def report(rows: list[dict]) -> str:
    lines = [
        "| ranks | outer state / rank (MB) | target (MB) | push peak / rank (MB) | target (MB) "
        "| wire bytes vs 1 | sync / compute | of which waiting | compute / step (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['ranks']} | {r['outer_state_mb']:.2f} | {r['outer_state_target_mb']:.2f} "
            f"| {r['push_peak_mb']:.1f} | {r['push_peak_target_mb']:.1f} | {r['wire_ratio']:.4f} "
            f"| {100 * r['sync_over_compute']:.2f}% | {100 * r['blocked_over_compute']:.2f}% "
            f"| {r['compute_s_per_step']:.3f} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3.2 M params: about 2 minutes")
    parser.add_argument("--ranks", default="1,2,4", help="island sizes; 1 is always run")
    parser.add_argument("--fragments", type=int, default=4)
    parser.add_argument("--sync-every-steps", type=int, default=20, help="H")
    parser.add_argument("--outer-steps", type=int, default=2)
    parser.add_argument("--overlap-steps", type=int, default=1, help="tau")
    parser.add_argument("--block-size", type=int, default=64, help="tokens a sequence (x 8 a step)")
    parser.add_argument(
        "--out", type=Path, help="default: islands.json, --quick islands_quick.json"
    )
    args = parser.parse_args()
    width = "256" if args.quick else "512"
    worker_flags = ["--n-embd", width, "--sync-every-steps", str(args.sync_every_steps)]
    worker_flags += ["--outer-steps", str(args.outer_steps)]
    worker_flags += [
        "--overlap-steps",
        str(args.overlap_steps),
        "--block-size",
        str(args.block_size),
    ]
    sizes = sorted({1, *(int(r) for r in args.ranks.split(","))})
    fresh_maps = ENV | {"MALLOC_MMAP_THRESHOLD_": str(64 << 10)}
    with tempfile.TemporaryDirectory() as tmp:
        runs = {
            r: run_island(r, worker_flags, args.fragments, Path(tmp) / f"t{r}", ENV) for r in sizes
        }
        memory = {
            r: run_island(r, worker_flags, args.fragments, Path(tmp) / f"m{r}", fresh_maps)
            for r in sizes
        }
    rows = figures(runs, memory)
    print(report(rows))
    out = args.out or RESULTS / ("islands_quick.json" if args.quick else "islands.json")
    out.write_text(
        json.dumps(
            {"args": vars(args) | {"out": str(out)}, "rows": rows, "runs": runs, "memory": memory},
            indent=1,
        )
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
