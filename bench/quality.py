"""How close to a tuned data-parallel run does each codec train, and at how many fewer bytes?

    python bench/quality.py            # full run: 9 runs, an estimated 26 min on 2 idle cores
    python bench/quality.py --quick    # shortened (<= 5 min): quality_quick.json, no plots
    python bench/quality.py --n-embd 128 --seeds 0 --dp-lr 1e-3 --inner-lr 1e-3 \
        --out bench/results/quality_0.9M   # the 0.9 M model at its own sweep's best lrs
    python bench/quality.py --device cuda --tf32 --n-layer 8 --n-embd 512 --n-head 8 \
        --corpus-mb 16 --dp-lr 2.5e-4 --inner-lr 2.5e-4 --codec-lr fp4=1.25e-4 \
        --workers 4 --threads 3 --out bench/results/quality_25M   # 25.4 M, on a GPU

Same model, data, K = 4 learners and total tokens for data-parallel (gradients averaged every
step, counted as a ring all-reduce of fp32 gradients) at its best learning rate and for
Streaming DiLoCo (bench/quality_runs.py's recipe) with each codec both ways, over seeds, at
the learning rates bench/quality_sweep.py found best. Each row: eval loss and gap vs the
same seed's data-parallel run (mean ± std over seeds), bits per parameter per sync each
way, bytes ratio vs data-parallel. Writes bench/results/quality.json, quality.png (eval
loss vs tokens, first seed) and quality_tradeoff.png (gap vs bytes ratio). Bytes are payload
bytes sent plus received by one learner, excluding the one-time initial parameter download
that every method needs. Prints PASS/FAIL for each target (`checks` in the JSON); never hides
a FAIL. Finished runs are reused from quality_runs.json in --out (--fresh: retrain).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.plotting import pyplot  # noqa: E402
from bench.quality_runs import WIRE, Row, add_setup_args, run_rows, setup_kw  # noqa: E402
from common.codec.tensor import is_sparse

RESULTS = Path(__file__).resolve().parent / "results"
# The best learning rates of bench/quality_sweep.py lr (docs/RESULTS.md, "Tuned baselines").
DP_LR = 2e-3
INNER_LR = 2e-3
# The headline rows (main sets their lr, steps and seed): fp4 against the sparse codec at one
# H; more with --rows (each row adds 3 runs of ~5.5 CPU-minutes: the full benchmark stays
# within 30 minutes on 2 cores).
SPARSE_TOPK = 1 / 64  # SparseLoCo's 64 of every 4096 values
HEADLINE = [Row("fp4", h=20), Row("sparse-2bit", h=20, topk=SPARSE_TOPK)]
QUICK = [Row("fp4", h=10), Row("sparse-2bit", h=10, topk=SPARSE_TOPK)]


ROW_FORMAT = "codec:H[:topk[/pull_topk][:outer_lr[/momentum][:options]]]"
# A row's options: the residual kept in the model, each value's mean over its senders.
OPTIONS = {"inmodel", "senders", "untrusted"}


def parse_row(text: str) -> Row:
    """A --rows entry, ROW_FORMAT (fp4:50, sparse-2bit:20:0.015625, fp4:5:0:0.35,
    sparse-2bit:5:0.015625::inmodel); without an outer lr, the codec's recipe's;
    topk as push/pull (0.015625/0.046875) sets the pull's fraction too (else twice the
    push's), the outer lr as lr/momentum (2.25/0.5) the outer Nesterov's momentum (else the
    recipe's); `inmodel`: sparse pushes keep their residual in the
    local model too (the learner's --push-feedback-in-model); `senders`: the server's
    --sparse-mean senders; `untrusted`: the server's --untrusted-learners."""
    parts = text.split(":")
    options = parts[4].split(",") if len(parts) == 5 else []
    try:
        # Each option at most once, in any order.
        known = set(options) <= OPTIONS and len(options) == len(set(options))
        if not 2 <= len(parts) <= 5 or not known:
            raise ValueError(f"expected {ROW_FORMAT}")
        codec, h = parts[0], int(parts[1])
        push, slash, pull = (parts[2] if len(parts) > 2 else "0").partition("/")
        topk = float(push)
        pull_topk = float(pull) if slash else None
        lr, slash, momentum = (parts[3] if len(parts) > 3 else "").partition("/")
        outer_lr = float(lr) if lr else None
        outer_momentum = float(momentum) if slash else None
        if h < 1 or not 0 <= topk <= 1 or not (outer_lr is None or outer_lr > 0):
            raise ValueError("H must be >= 1, topk in [0, 1] and the outer lr > 0")
        if outer_momentum is not None and not (outer_lr and 0 <= outer_momentum < 1):
            raise ValueError("an outer momentum needs an outer lr and must be in [0, 1)")
        if pull_topk is not None and not (0 < pull_topk <= 1 and topk > 0):
            raise ValueError("a pull fraction needs a push fraction and must be in (0, 1]")
        row = Row(codec, h=h, topk=topk, pull_topk=pull_topk, outer_lr=outer_lr,
                  outer_momentum=outer_momentum,
                  feedback_in_model="inmodel" in options,
                  sparse_mean="senders" if "senders" in options else "learners",
                  untrusted="untrusted" in options)  # fmt: skip
        row.variant()  # an unknown codec raises here
        if pull_topk is not None and not is_sparse(WIRE[codec]):
            raise ValueError(f"a pull fraction is for sparse codecs; {codec} pulls dense")
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"bad row {text!r}: {err}") from None
    return row


def parse_codec_lr(text: str) -> tuple[str, float]:
    """A --codec-lr entry: codec=lr (fp4=1.25e-4)."""
    codec, _, value = text.partition("=")
    try:
        lr = float(value)
    except ValueError:
        lr = 0.0
    if codec not in WIRE or not lr > 0:  # `not >`: NaN is refused too
        raise argparse.ArgumentTypeError(
            f"bad --codec-lr {text!r}: expected codec=lr, lr > 0, codec one of {', '.join(WIRE)}"
        )
    return codec, lr


def mean_std(values: list[float]) -> tuple[float, float | None]:
    """Mean and sample standard deviation; None for the deviation of a single value."""
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else None


def pm(value: float, std: float | None, scale: float = 1.0, digits: int = 4) -> str:
    spread = "n/a" if std is None else f"{scale * std:.{digits}f}"
    return f"{scale * value:+.{digits}f}±{spread}" if scale != 1 else f"{value:.{digits}f}±{spread}"


def summarize(results: dict[Row, object], rows: list[Row]) -> list[dict]:
    """One entry per method: its seeds' figures, each gap against the same seed's DP run."""
    dp = {row.seed: results[row] for row in rows if row.codec == "dp"}
    methods: dict[str, list[Row]] = {}
    for row in rows:
        methods.setdefault(row.method, []).append(row)
    out = []
    for method, seeds in methods.items():
        first = seeds[0]
        runs = [results[r] for r in seeds]
        losses = [r.eval_loss for r in runs]
        gaps = [r.eval_loss / dp[s.seed].eval_loss - 1 for s, r in zip(seeds, runs, strict=True)]
        loss, loss_std = mean_std(losses)
        gap, gap_std = mean_std(gaps)
        run = runs[0]
        per_sync = run.numel * run.syncs  # parameters sent (or received) in full syncs
        out.append(
            {
                "name": method,
                "codec": first.codec,
                "h": first.h,
                "topk": first.topk,
                "outer_lr": first.outer_lr,  # None: the codec's recipe
                "lr": first.lr,
                "dp_lr": next(r.lr for r in rows if r.codec == "dp"),
                "seeds": [s.seed for s in seeds],
                "eval_loss": loss,
                "eval_loss_std": loss_std,
                "eval_losses": losses,
                "gap_vs_dp": gap,
                "gap_std": gap_std,
                "bits_per_param_push": 8 * run.push_bytes / per_sync,
                "bits_per_param_pull": 8 * run.pull_bytes / per_sync,
                "bytes_per_learner": run.bytes_per_learner,
                "bytes_ratio_vs_dp": dp[first.seed].bytes_per_learner / run.bytes_per_learner,
                "peak_sync_bytes": run.peak_sync_bytes,
                "curve": run.curve,
                "wall_s": sum(r.wall_s for r in runs),
                "cpu_s": sum(r.cpu_s for r in runs),
            }
        )
    return out


def print_table(entries: list[dict]) -> None:
    print(
        f"\n{'row':<26} {'seeds':>5} {'eval loss':>15} {'gap vs DP':>16} "
        f"{'bits/param push':>15} {'pull':>6} {'x fewer B':>9}"
    )
    for e in entries:
        print(
            f"{e['name']:<26} {len(e['seeds']):>5} {pm(e['eval_loss'], e['eval_loss_std']):>15} "
            f"{pm(e['gap_vs_dp'], e['gap_std'], 100, 2) + '%':>16} "
            f"{e['bits_per_param_push']:>15.3f} {e['bits_per_param_pull']:>6.3f} "
            f"{e['bytes_ratio_vs_dp']:>9.1f}"
        )


def best_ratio(entries: list[dict], max_gap: float) -> dict | None:
    within = [e for e in entries if e["codec"] != "dp" and e["gap_vs_dp"] <= max_gap]
    return max(within, key=lambda e: e["bytes_ratio_vs_dp"], default=None)


def best_ratio_text(entries: list[dict], max_gap: float) -> str:
    """best_ratio as printed: "1120x (its row)", or "none"."""
    best = best_ratio(entries, max_gap)
    return "none" if best is None else f"{best['bytes_ratio_vs_dp']:.0f}x ({best['name']})"


def check(entries: list[dict]) -> list[str]:
    lines = []

    def verdict(ok: bool, text: str) -> None:
        lines.append(f"{'PASS' if ok else 'FAIL'}  {text}")

    for limit in (0.01, 0.03):
        text = best_ratio_text(entries, limit)
        lines.append(f"INFO  best bytes ratio vs tuned DP at mean gap <= {limit:.0%}: {text}")
    best = best_ratio(entries, 0.01)
    verdict(
        best is not None and best["bytes_ratio_vs_dp"] >= 1000,
        ">= 1000x fewer bytes than tuned DP at mean gap <= 1%",
    )
    fp4: dict[int, dict] = {}  # per H, the fp4 row at its best (rows may differ in outer lr)
    for e in entries:
        if e["codec"] == "fp4" and (e["h"] not in fp4 or e["gap_vs_dp"] < fp4[e["h"]]["gap_vs_dp"]):
            fp4[e["h"]] = e
    for e in entries:
        if not e["codec"].startswith("sparse") or e["h"] not in fp4:
            continue
        base = fp4[e["h"]]
        fewer = base["bytes_per_learner"] / e["bytes_per_learner"]
        worse = 100 * (e["gap_vs_dp"] - base["gap_vs_dp"])
        verdict(
            fewer >= 8 and worse <= 0.5,
            f"{e['name']}: {fewer:.1f}x fewer bytes than {base['name']} (>= 8x), mean gap "
            f"{worse:+.2f} pp vs its (<= +0.5 pp)",
        )
    return lines


def plot(entries: list[dict], out_dir: Path) -> None:
    plt = pyplot()
    if plt is None:
        return

    fig, ax = plt.subplots(figsize=(9, 6))
    for e in entries:
        tokens, losses = zip(*e["curve"], strict=True)
        ax.plot(tokens, losses, label=e["name"], linewidth=2.5 if e["codec"] == "dp" else 1)
    ax.set(xlabel="tokens (all learners)", ylabel="eval loss", title="Eval loss vs tokens")
    ax.set_ylim(top=3.5)  # the first evaluations (~5.5) would flatten the interesting part
    ax.legend(fontsize=7)
    fig.savefig(out_dir / "quality.png", dpi=120, bbox_inches="tight")
    fig, ax = plt.subplots(figsize=(7, 5))
    for e in entries:
        if e["codec"] != "dp":
            x, y = e["bytes_ratio_vs_dp"], 100 * e["gap_vs_dp"]
            ax.errorbar(x, y, yerr=100 * (e["gap_std"] or 0), fmt="o", capsize=3)
            ax.annotate(e["name"], (x, y), fontsize=6)
    ax.axhline(1, color="grey", linewidth=0.5)
    ax.set(
        xscale="log",
        xlabel="bytes ratio vs tuned data-parallel (x fewer)",
        ylabel="eval loss gap vs tuned data-parallel (%, mean ± std over seeds)",
        title="Quality vs communication",
    )
    fig.savefig(out_dir / "quality_tradeoff.png", dpi=120, bbox_inches="tight")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shortened run, <= 5 minutes")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--rows",
        nargs="+",
        type=parse_row,
        help=f"DiLoCo rows as {ROW_FORMAT} (codecs: fp32, fp4, "
        "sparse-2bit; options: inmodel, senders or inmodel,senders; untrusted); "
        "default: fp4:20 sparse-2bit:20:0.015625 (--quick: H 10)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--fresh", action="store_true", help="retrain every run (no cache)")
    parser.add_argument(
        "--dp-lr", type=float, default=DP_LR, help="data-parallel's lr (its sweep's best)"
    )
    parser.add_argument(
        "--inner-lr", type=float, default=INNER_LR, help="the learners' lr (its sweep's best)"
    )
    parser.add_argument(
        "--codec-lr",
        nargs="+",
        type=parse_codec_lr,
        default=[],
        metavar="CODEC=LR",
        help="a codec's own inner lr where its sweep's best differs from --inner-lr",
    )
    add_setup_args(parser)
    args = parser.parse_args()
    steps = 150 if args.quick else 1000
    codec_lr = dict(args.codec_lr)
    rows = [
        replace(
            row,
            lr=args.dp_lr if row.codec == "dp" else codec_lr.get(row.codec, args.inner_lr),
            steps=steps,
            seed=seed,
        )
        for seed in args.seeds
        for row in [Row("dp")] + (args.rows or (QUICK if args.quick else HEADLINE))
    ]
    print(f"{len(rows)} runs of {steps} steps, seeds {args.seeds}", flush=True)
    started = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    cache = None if args.fresh else args.out / "quality_runs.json"
    kw = setup_kw(args)
    results = run_rows(rows, cache, args.workers, args.quick, args.threads, **kw)
    entries = summarize(results, rows)
    print_table(entries)
    verdicts = check(entries)
    print("\n" + "\n".join(verdicts))
    report = {
        "setup": {**vars(rows[0].setup(args.quick, **kw)), "inner_lr": args.inner_lr},
        "codec_lr": codec_lr,
        "dp_lr": args.dp_lr,
        "quick": args.quick,
        "variants": entries,
        "checks": verdicts,
        "train_cpu_s": sum(e["cpu_s"] for e in entries),
        "wall_s": time.perf_counter() - started,
    }
    name = "quality_quick.json" if args.quick else "quality.json"
    (args.out / name).write_text(json.dumps(report, indent=1))
    if not args.quick:
        plot(entries, args.out)
    print(f"\nwrote {args.out / name} in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
