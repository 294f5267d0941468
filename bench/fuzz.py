"""Long fuzz run of the servicer and the decoders; prints and saves the tally.

    python -m bench.fuzz --cases 10000                     # servicer (direct), decoders, threads
    python -m bench.fuzz --cases 2000 --transport grpc     # through a loopback gRPC server
    python -m bench.fuzz --cases 12000 --decoder-cases 83000 --concurrent-cases 5000 --workers 2 \
        --seed 11 --out bench/results/fuzz_100k.json         # 100,000 cases, about 40 min

Each servicer case is a fresh aggregator and 1-4 hostile calls (tests/support/fuzz/cases.py);
each decoder case one hostile input to decode_fragment, decode or apply_updates; each concurrent
case 4 threads of hostile calls and the good learner's push at once. Cases are drawn by
hypothesis (generation only: no shrinking, nothing stored), in batches of at most BATCH with
seeds seed, seed+1, ... until the asked number have run; after each batch a line on stderr
shows progress and each fuzzer's tally so far is saved in a temporary folder (named at start),
so a run stopped early keeps what it checked. With --workers 2 or more the three fuzzers run
in that many processes at once (the cases drawn are the same). Writes bench/results/fuzz.json;
exits 1 on any violation.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import multiprocessing
import shutil
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir

from tests.support.fuzz.cases import CaseReport, Tally, run_concurrent_case, run_servicer_case
from tests.support.fuzz.decoders import run_decoder_case
from tests.support.fuzz.grpc_caller import GrpcCaller
from tests.support.fuzz.world import pull_wait_capped

RESULTS = Path(__file__).parent / "results" / "fuzz.json"


BATCH = 5000  # cases per hypothesis run: a progress line after each
FUZZERS = ("servicer", "decoder", "concurrent")


def run(cases: int, run_case, first_seed: int, name: str = "", save=None) -> Tally:
    """Run `run_case(draw)` on at least `cases` generated inputs, in batches of at most BATCH
    (fewer only if hypothesis stops early on 20 batches more than the cases need); after each
    batch, `save(tally, elapsed_s)` when given."""
    tally = Tally()
    started = time.perf_counter()
    for batch in range(-(-cases // BATCH) + 20):
        remaining = cases - tally.cases
        if remaining <= 0:
            break

        @seed(first_seed + batch)
        @settings(
            max_examples=min(remaining, BATCH),
            database=None,
            deadline=None,
            phases=[Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(st.data())
        def one(data: st.DataObject) -> None:
            try:
                report = run_case(data.draw)
            except Exception as err:  # noqa: BLE001 - a harness failure is counted, not fatal
                report = CaseReport(violations=[f"harness_error: {type(err).__name__}: {err}"])
            tally.add(report)

        one()
        elapsed = time.perf_counter() - started
        print(f"{name}: {tally.cases}/{cases} cases in {elapsed:.0f} s", file=sys.stderr)
        if save:
            save(tally, elapsed)
    return tally


def run_fuzzer(name: str, cases: int, first_seed: int, transport: str, partial: Path) -> dict:
    """One fuzzer's summary with its wall time (run in this process or in a worker); after
    each batch the summary so far goes to partial/NAME.json, so a run stopped early keeps
    what it has checked."""

    def save(tally: Tally, elapsed_s: float) -> None:
        summary = {**tally.summary(), "wall_s": elapsed_s, "complete": tally.cases >= cases}
        (partial / f"{name}.json").write_text(json.dumps(summary, indent=1) + "\n")

    logging.disable(logging.WARNING)  # every refusal logs a warning: millions of lines
    torch.set_num_threads(1)
    set_hypothesis_home_dir(Path(tempfile.gettempdir()) / "diloco-hypothesis")  # not the repo
    with pull_wait_capped(), contextlib.ExitStack() as stack:
        caller = stack.enter_context(GrpcCaller()) if transport == "grpc" else None
        run_case = {
            "servicer": (
                (lambda draw: run_servicer_case(draw, caller)) if caller else run_servicer_case
            ),
            "decoder": run_decoder_case,
            "concurrent": run_concurrent_case,
        }[name]
        started = time.perf_counter()
        tally = run(cases, run_case, first_seed, name, save)
        return {**tally.summary(), "wall_s": time.perf_counter() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=10_000, help="servicer cases")
    parser.add_argument("--decoder-cases", type=int, default=None, help="default: --cases")
    parser.add_argument("--concurrent-cases", type=int, default=1000)
    parser.add_argument("--transport", choices=["direct", "grpc"], default="direct")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--workers", type=int, default=1, help="processes running the three fuzzers (1-3)"
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if min(args.cases, args.decoder_cases or 0, args.concurrent_cases) < 0:
        parser.error("--cases, --decoder-cases and --concurrent-cases must be >= 0")
    if not 1 <= args.workers <= len(FUZZERS):
        parser.error(f"--workers must be between 1 and {len(FUZZERS)}")
    decoder_cases = args.cases if args.decoder_cases is None else args.decoder_cases
    counts = {"servicer": args.cases, "decoder": decoder_cases, "concurrent": args.concurrent_cases}
    results = {"transport": args.transport, "seed": args.seed, "workers": args.workers}
    partial = Path(tempfile.mkdtemp(prefix="diloco-fuzz-"))
    print(f"each fuzzer's tally so far, after every batch: {partial}", file=sys.stderr)
    started = time.perf_counter()
    if args.workers == 1:
        for name in FUZZERS:
            results[name] = run_fuzzer(name, counts[name], args.seed, args.transport, partial)
    else:
        spawn = multiprocessing.get_context("spawn")  # no forked torch or gRPC state
        with ProcessPoolExecutor(args.workers, mp_context=spawn) as pool:
            futures = {
                name: pool.submit(
                    run_fuzzer, name, counts[name], args.seed, args.transport, partial
                )
                for name in FUZZERS
            }
            for name in FUZZERS:
                results[name] = futures[name].result()
    results["total_cases"] = sum(results[name]["cases"] for name in FUZZERS)
    results["wall_s"] = time.perf_counter() - started
    failed = False
    for name in FUZZERS:
        r = results[name]
        bad = r["crashes"] + r["hangs"] + r["state_changes"] + r["wrong_statuses"]
        bad += r["nonfinite_states"] + r["good_learner_failures"] + r["other_violations"]
        failed = failed or bad > 0
        print(
            f"{name}: {r['cases']} cases, {r['calls']} calls in {r['wall_s']:.0f} s: "
            f"{r['crashes']} crashes, {r['hangs']} hangs, {r['state_changes']} state changes, "
            f"{r['wrong_statuses']} wrong statuses, {r['nonfinite_states']} non-finite states, "
            f"{r['good_learner_failures']} good-learner failures, {r['other_violations']} other; "
            f"slowest call {r['max_call_s']:.3f} s; outcomes {r['outcomes']}"
        )
        for example in r["examples"]:
            print(f"  {example[:2000]}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    shutil.rmtree(partial)
    print(f"{results['total_cases']} cases in {results['wall_s']:.0f} s; wrote {args.out}")
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
