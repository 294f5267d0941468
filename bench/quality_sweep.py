"""The learning-rate sweeps and the step-count trend behind bench/quality.py's settings.

    python bench/quality_sweep.py lr       # data-parallel's lr and the learners' inner lr
    python bench/quality_sweep.py trend --codecs fp4 sparse-2bit:0.015625  # 1,000, 3,000 steps
    python bench/quality_sweep.py lr --dp-lrs --codec sparse-2bit --topk 0.015625 \
        --inner-lrs 2e-3 --outer-lrs 1 2 4 --feedback-decays 0.9 0.95 0.98   # sparse's outer step

`lr`: data-parallel at each of --dp-lrs and Streaming DiLoCo (bench/quality_runs.py's
recipe, --codec at H = --h) at each of --inner-lrs, seed 0; prints each run's eval loss and
the best lr of each, which bench/quality.py's DP_LR and INNER_LR hold. `trend`: data-parallel
and the given codec rows at --steps-list, to show whether the gap at fixed H shrinks as outer
steps accumulate. Both share bench/results/quality_runs.json (finished runs are reused) and
write bench/results/quality_sweep.json. `--n-embd 128 --out bench/results/quality_0.9M`
sweeps the 0.9 M-parameter model beside `bench/quality.py --n-embd 128`'s runs there; the
model, corpus and device options (--n-layer, --n-head, --corpus-mb, --device cuda, --tf32)
are bench/quality.py's, and `trend --dp-lr` with no value trains no data-parallel rows.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.quality_runs import Row, add_setup_args, run_rows, setup_kw  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def lr_rows(args: argparse.Namespace) -> list[Row]:
    return [Row("dp", lr=lr, seed=s) for lr in args.dp_lrs for s in args.seeds] + [
        Row(
            args.codec,
            h=h,
            topk=args.topk,
            lr=lr,
            seed=s,
            outer_lr=o,
            feedback_decay=d,
            feedback_in_model=args.residual_in_model,
            state_dtype=args.state_dtype,
        )  # fmt: skip
        for h in args.h
        for lr in args.inner_lrs
        for o in args.outer_lrs or [None]
        for d in args.feedback_decays or [None]
        for s in args.seeds
    ]


def trend_rows(args: argparse.Namespace) -> list[Row]:
    rows = []
    for seed in args.seeds:
        for steps in args.steps_list:
            rows.extend(Row("dp", lr=lr, steps=steps, seed=seed) for lr in args.dp_lr)
            for codec in args.codecs:
                name, _, fraction = codec.partition(":")
                topk = float(fraction or 0)
                rows.extend(
                    Row(name, h=h, topk=topk, lr=args.inner_lr, steps=steps, seed=seed,
                        feedback_in_model=args.residual_in_model)
                    for h in args.h
                )  # fmt: skip
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["lr", "trend"])
    parser.add_argument("--dp-lrs", type=float, nargs="*", default=[1e-3, 2e-3, 4e-3])
    parser.add_argument("--inner-lrs", type=float, nargs="*", default=[1e-3, 2e-3, 4e-3])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="seeds of each row")
    parser.add_argument("--codec", default="fp4", help="lr: the DiLoCo row's codec")
    parser.add_argument("--topk", type=float, default=0.0, help="lr: its top-k fraction")
    parser.add_argument("--h", type=int, nargs="+", default=[20], help="H of the DiLoCo rows")
    parser.add_argument(
        "--outer-lrs", type=float, nargs="*", default=[], help="lr: outer lrs (the recipe's)"
    )
    parser.add_argument(
        "--feedback-decays", type=float, nargs="*", default=[],
        help="lr: sparse pushes' residual decays (the learner's default)",
    )  # fmt: skip
    parser.add_argument(
        "--residual-in-model", action="store_true",
        help="sparse pushes keep their residual in the local model too (not SparseLoCo's rule)",
    )  # fmt: skip
    parser.add_argument(
        "--state-dtype", default="float32", help="lr: the server's outer_state_dtype"
    )
    parser.add_argument("--steps-list", type=int, nargs="+", default=[1000, 3000])
    parser.add_argument(
        "--codecs", nargs="+", default=["fp4"], help="trend: codec or codec:topk rows"
    )
    parser.add_argument(
        "--dp-lr",
        type=float,
        nargs="*",
        default=[2e-3],
        help="trend: data-parallel's lrs (each row's gap is against the best at its length; "
        "none: no data-parallel runs)",
    )
    parser.add_argument("--inner-lr", type=float, default=2e-3, help="trend: the learners' lr")
    add_setup_args(parser)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--cache", default="quality_runs.json", help="file of runs, in --out")
    args = parser.parse_args()
    rows = lr_rows(args) if args.what == "lr" else trend_rows(args)
    started = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    results = run_rows(
        rows, args.out / args.cache, args.workers, threads=args.threads, **setup_kw(args)
    )
    table = []
    for row in rows:
        r = results[row]
        dp = min(
            (
                results[d]
                for d in rows
                if d.codec == "dp" and (d.steps, d.seed) == (row.steps, row.seed)
            ),
            key=lambda d: d.eval_loss,
            default=None,
        )  # the best data-parallel run of the same seed and step count (if any)
        table.append(
            {
                "name": row.method,
                "seed": row.seed,
                "steps": row.steps,
                "eval_loss": r.eval_loss,
                "gap_vs_dp": r.eval_loss / dp.eval_loss - 1 if dp else None,
                "bytes_ratio_vs_dp": dp.bytes_per_learner / r.bytes_per_learner if dp else None,
                "wall_s": r.wall_s,
                "cpu_s": r.cpu_s,
            }
        )
        print(f"{row.method:<34} {row.steps:>5} steps  {r.eval_loss:.4f}", flush=True)
    if args.what == "lr":
        for kind in ("dp", args.codec):
            tried = [r for r in rows if r.codec == kind]
            if not tried:
                continue
            best = min(tried, key=lambda r: results[r].eval_loss)
            print(f"best {kind}: {best.method} (eval loss {results[best].eval_loss:.4f})")
    path = args.out / "quality_sweep.json"
    report = json.loads(path.read_text()) if path.exists() else {}
    # Sweeps of other rows add to the table: a row is its name, seed and step count.
    kept = {
        (r["name"], r["seed"], r["steps"]): r for r in report.get(args.what, {}).get("rows", [])
    }
    kept.update({(r["name"], r["seed"], r["steps"]): r for r in table})
    report[args.what] = {"rows": list(kept.values())}
    path.write_text(json.dumps(report, indent=1))
    print(f"wrote {path} in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
