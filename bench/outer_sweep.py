"""Why does DiLoCo trail data-parallel here? A sweep of the outer optimizer at H = 10.

    python bench/outer_sweep.py              # 300 steps, 5 variants, ~4 minutes
    python bench/outer_sweep.py --steps 1000
    python bench/outer_sweep.py --method streaming --pairs 0.7,0.9 1.0,0.8 --steps 1000
    python bench/outer_sweep.py --method streaming --pairs 0.7,0.9 --merge-alphas 0 0.25
    python bench/outer_sweep.py --method streaming --pairs 0.7,0.9 --warmup-rounds 20

Same setup as bench/quality.py (K = 4, the same model and data), plain DiLoCo (one
fragment, fp32 wire) or Streaming DiLoCo (quality.py's variant (d): P = 4, τ = 1, α = 0.5,
fp4 both ways) at H = 10 with several (outer lr, outer momentum) pairs, against
data-parallel. Prints each variant's eval loss and gap, writes bench/results/outer_sweep.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.simulate import Setup, Variant, run_variant  # noqa: E402

PAIRS = [(0.7, 0.9), (1.0, 0.0), (0.7, 0.5), (0.35, 0.9)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--sync-every-steps", type=int, default=10)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--method", choices=["diloco", "streaming"], default="diloco")
    parser.add_argument(
        "--pairs",
        nargs="+",
        default=[f"{lr},{m}" for lr, m in PAIRS],
        help="outer lr,momentum pairs",
    )
    parser.add_argument("--eval-batches", type=int, default=16)
    parser.add_argument(
        "--merge-alphas",
        nargs="+",
        type=float,
        default=[0.5],
        help="streaming only: merge alpha values, each run with every pair",
    )
    parser.add_argument(
        "--warmup-rounds",
        type=int,
        default=0,
        help="outer momentum warm-up: rise from 0.5 to the momentum over this many rounds",
    )
    parser.add_argument("--seed", type=int, default=0, help="model init and data order")
    args = parser.parse_args()
    setup = Setup(steps=args.steps, eval_every=100, eval_batches=args.eval_batches, seed=args.seed)
    h = args.sync_every_steps
    pairs = [tuple(float(x) for x in pair.split(",")) for pair in args.pairs]
    streaming = {
        "fragments": 4,
        "overlap_steps": 1,
        "merge_alpha": 0.5,
        "push_codec": "fp4_e2m1",
        "pull_codec": "fp4_e2m1",
    }
    label = "Streaming fp4+overlap" if args.method == "streaming" else "DiLoCo"
    alphas = args.merge_alphas if args.method == "streaming" else [0.0]
    todo = [Variant(name="data-parallel", kind="dp")] + [
        Variant(
            name=f"{label} H={h} outer lr {lr} momentum {m}"
            + (f" alpha {alpha}" if args.method == "streaming" else ""),
            sync_every_steps=h,
            outer_lr=lr,
            outer_momentum=m,
            outer_momentum_warmup_rounds=args.warmup_rounds,
            **({**streaming, "merge_alpha": alpha} if args.method == "streaming" else {}),
        )
        for lr, m in pairs
        for alpha in alphas
    ]
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=2, mp_context=ctx) as pool:
        results = [f.result() for f in [pool.submit(run_variant, setup, v, 1) for v in todo]]
    dp = results[0].eval_loss
    rows = []
    for v, r in zip(todo, results, strict=True):
        rows.append(
            {
                "name": v.name,
                "eval_loss": r.eval_loss,
                "gap_vs_dp": r.eval_loss / dp - 1,
                "curve": r.curve,
            }
        )
        print(f"{v.name:<45} {r.eval_loss:.4f} {100 * (r.eval_loss / dp - 1):+6.2f}%")
    args.out.mkdir(parents=True, exist_ok=True)
    name = "outer_sweep.json" if args.method == "diloco" else "outer_sweep_streaming.json"
    (args.out / name).write_text(json.dumps({"setup": asdict(setup), "variants": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
