"""The quality goal's terms over seeds at chosen step counts, read from runs already trained.

    python bench/quality_goal.py --rows fp4:100 --seeds 0 1 2 --at 1000 3000 5000

For each row (bench/quality.py's codec:H[:topk[/pull_topk][:outer_lr[:inmodel]]]), each seed
and each step count in --at: the eval loss at that step, from the shortest run in
bench/results/quality_runs.json that reaches it (the run's own evaluation there: with a
constant learning rate a longer run's first S steps are an S-step run, except that a DiLoCo
run's final figure also merges the syncs still in flight), against the best data-parallel
run of the same seed over --dp-lr at the same step. Prints each row's gap (mean ± std over
the seeds), its bytes ratio vs that data-parallel run, and per step count the best bytes
ratio at a mean gap <= 1% and <= 3% (the goal: >= 1,000x at <= 1%). Trains nothing: a run
missing from the cache is named, with the exit status 1. Writes the table into
bench/results/quality_sweep.json under `goal` (`goal_cosine` for --lr-schedule cosine).

With --lr-schedule cosine the runs are those trained with the inner cosine schedule, and a
step count is read from the run of exactly that length, or from the run of --run-steps steps
(then a mid-schedule point, not what a run of that length reaches): the first S steps of a
longer cosine run are not an S-step run.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.quality import ROW_FORMAT, best_ratio_text, mean_std, parse_row, pm  # noqa: E402
from bench.quality_runs import Row, cache_key  # noqa: E402
from common.lr_schedule import LR_SCHEDULES  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def run_lengths(stored: dict) -> list[int]:
    """The step counts of the cached runs, shortest first."""
    return sorted({json.loads(key)["setup"]["steps"] for key in stored})


def shortest_run(
    stored: dict, lengths: list[int], row: Row, at: int, **setup_kw
) -> tuple[Row, dict] | None:
    """The cached run with `row`'s settings and the fewest steps >= `at` (of `lengths`)."""
    for steps in (s for s in lengths if s >= at):
        run = replace(row, steps=steps)
        hit = stored.get(cache_key(run.setup(**setup_kw), run.variant()))
        if hit is not None:
            return run, hit
    return None


def loss_at(run: Row, result: dict, at: int) -> float:
    """The run's eval loss after `at` steps (its curve holds (total tokens, loss) pairs)."""
    setup = run.setup()
    tokens = at * setup.batch_size * setup.learners * setup.block_size
    for seen, loss in result["curve"]:
        if seen == tokens:
            return loss
    raise ValueError(f"{run.method} seed {run.seed} ({run.steps} steps) has no eval at {at}")


def bytes_per_step(run: Row, result: dict) -> float:
    return result["bytes_per_learner"] / run.steps


def judge(
    stored: dict,
    rows: list[Row],
    dp_lrs: list[float],
    seeds: list[int],
    at: int,
    lr_schedule: str = "constant",
    run_steps: int | None = None,
) -> tuple[list[dict], list[str]]:
    """Each row's entry at step `at` over `seeds`, and the runs the cache lacks. Read from
    the shortest run reaching `at`, or only from runs of `run_steps` steps when given (and,
    with a cosine schedule, only from runs of `at` steps when not)."""
    if lr_schedule != "constant" and run_steps is None:
        run_steps = at
    if run_steps is not None and run_steps < at:
        raise ValueError(f"a run of {run_steps} steps has no eval at {at}")
    missing: list[str] = []
    lengths = run_lengths(stored) if run_steps is None else [run_steps]
    reach = f">= {at}" if run_steps is None else f"{run_steps}"

    def find(row: Row) -> tuple[Row, dict] | None:
        found = shortest_run(stored, lengths, row, at, lr_schedule=lr_schedule)
        if found is None:
            missing.append(f"{row.method} seed {row.seed}, {reach} steps, {lr_schedule} lr")
        return found

    best_dp: dict[int, tuple[float, Row, dict]] = {}
    for seed in seeds:
        for lr in dp_lrs:
            found = find(Row("dp", lr=lr, seed=seed))
            if found is not None:
                loss = loss_at(*found, at)
                if seed not in best_dp or loss < best_dp[seed][0]:
                    best_dp[seed] = (loss, *found)
    entries = []
    for template in rows:
        losses, gaps, ratios, dp_used = [], [], [], []
        for seed in seeds:
            found = find(replace(template, seed=seed))
            if found is None or seed not in best_dp:
                continue
            dp_loss, dp_run, dp_result = best_dp[seed]
            loss = loss_at(*found, at)
            losses.append(loss)
            gaps.append(loss / dp_loss - 1)
            ratios.append(bytes_per_step(dp_run, dp_result) / bytes_per_step(*found))
            dp_used.append(dp_run.lr)
        if len(losses) < len(seeds):
            continue
        loss, loss_std = mean_std(losses)
        gap, gap_std = mean_std(gaps)
        entries.append(
            {
                "name": template.method,
                "codec": template.codec,
                "h": template.h,
                "steps": at,
                "seeds": seeds,
                "eval_losses": losses,
                "eval_loss": loss,
                "eval_loss_std": loss_std,
                "gaps": gaps,
                "gap_vs_dp": gap,
                "gap_std": gap_std,
                "dp_lr": dp_used,
                "bytes_ratio_vs_dp": min(ratios),
            }
        )
    return entries, missing


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rows", nargs="+", type=parse_row, required=True,
        help=f"DiLoCo rows as {ROW_FORMAT}",
    )  # fmt: skip
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--at", type=int, nargs="+", required=True, help="step counts to judge")
    parser.add_argument(
        "--dp-lr", type=float, nargs="+", default=[2e-3],
        help="data-parallel's lrs (each seed's best at each step count is the baseline)",
    )  # fmt: skip
    parser.add_argument("--inner-lr", type=float, default=2e-3, help="the learners' lr")
    parser.add_argument(
        "--lr-schedule", choices=LR_SCHEDULES, default="constant",
        help="judge the runs trained with this inner schedule (bench/quality_runs.py's option)",
    )  # fmt: skip
    parser.add_argument(
        "--run-steps", type=int,
        help="read every --at from runs of this many steps (default: constant lr, the "
        "shortest run that reaches it; cosine, the run of exactly that many steps)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--cache", default="quality_runs.json", help="file of runs, in --out")
    args = parser.parse_args()
    if args.run_steps is not None and args.run_steps < max(args.at):
        parser.error(f"--run-steps {args.run_steps} is shorter than --at {max(args.at)}")
    stored = json.loads((args.out / args.cache).read_text())
    rows = [replace(row, lr=args.inner_lr) for row in args.rows]
    table, checks, missing = [], [], []
    for at in args.at:
        entries, lacking = judge(
            stored, rows, args.dp_lr, args.seeds, at, args.lr_schedule, args.run_steps
        )
        missing += lacking
        table += entries
        for e in entries:
            print(
                f"{at:>6} steps  {e['name']:<40} {pm(e['eval_loss'], e['eval_loss_std'])} "
                f"gap {pm(e['gap_vs_dp'], e['gap_std'], 100, 2)}%  "
                f"{e['bytes_ratio_vs_dp']:.0f}x fewer bytes",
                flush=True,
            )
        for limit in (0.01, 0.03):
            text = best_ratio_text(entries, limit)
            checks.append(f"{at} steps: best bytes ratio at mean gap <= {limit:.0%}: {text}")
    print("\n".join(checks))
    if missing:
        print("not in the cache (train them first):\n  " + "\n  ".join(missing))
        return 1
    path = args.out / "quality_sweep.json"
    report = json.loads(path.read_text()) if path.exists() else {}
    key = "goal" if args.lr_schedule == "constant" else f"goal_{args.lr_schedule}"
    report[key] = {
        "seeds": args.seeds,
        "dp_lrs": args.dp_lr,
        "lr_schedule": args.lr_schedule,
        "run_steps": args.run_steps,
        "rows": table,
        "checks": checks,
    }
    path.write_text(json.dumps(report, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
