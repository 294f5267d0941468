"""Why does DiLoCo trail data-parallel here? A sweep of the outer optimizer at H = 10.

    python bench/outer_sweep.py              # 300 steps, 5 variants, ~4 minutes
    python bench/outer_sweep.py --steps 1000

Same setup as bench/quality.py (K = 4, the same model and data), plain DiLoCo (one
fragment, fp32 wire) at H = 10 with several (outer lr, outer momentum) pairs, against
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
    args = parser.parse_args()
    setup = Setup(steps=args.steps, eval_every=100, eval_batches=16)
    h = args.sync_every_steps
    todo = [Variant(name="data-parallel", kind="dp")] + [
        Variant(
            name=f"DiLoCo H={h} outer lr {lr} momentum {m}",
            sync_every_steps=h,
            outer_lr=lr,
            outer_momentum=m,
        )
        for lr, m in PAIRS
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
    (args.out / "outer_sweep.json").write_text(
        json.dumps({"setup": asdict(setup), "variants": rows}, indent=1)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
