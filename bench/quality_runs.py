"""The quality benchmarks' rows: a codec name, a top-k fraction and H make a training run.

Every DiLoCo row is Streaming DiLoCo with the daemons' best recipe (P = 4 strided fragments,
τ = 1, merge α = 0.05, the outer Nesterov at lr 0.7 and momentum 0.9 warmed up from 0.5 over
20 rounds; sparse codecs: server/config.py's SPARSE_OUTER step instead, pulls that keep
twice the push's top-k fraction unless a row sets its own, and the learners' decayed
error-feedback residual, apart from their local models unless a row keeps it there); rows
differ only in the codec both ways, its top-k fractions (sparse codecs), H, the inner
learning rate, the outer step's lr and momentum, the residual's decay and the merge α
(sweeps), the step count and the seed. Runs
are deterministic (the same row gives the same numbers on the same machine), so finished
runs are kept in a cache file keyed by the full setup and variant and reused by
bench/quality.py and bench/quality_sweep.py.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from bench.simulate import Result, Setup, Variant, run_variant
from common.codec.sparse import DEFAULT_FEEDBACK_IN_MODEL, SPARSE_CHUNK, topk_k
from common.codec.tensor import is_sparse
from server.config import SPARSE_OUTER, SPARSE_PULL_TOPK_FRACTION

# The wire codec names the rows use, and the common/codec/ codecs they send each way.
WIRE = {
    "fp32": "fp32",
    "fp4": "fp4_e2m1",
    "sparse-2bit": "sparse_2bit",
}
WARMUP_ROUNDS = 20  # outer momentum warm-up (docs/RESULTS.md, "The outer momentum warm-up")
MERGE_ALPHA = 0.05  # Streaming's merge weight of the local fragment (docs/RESULTS.md)
FRAGMENTS = 4


@dataclass(frozen=True)
class Row:
    """One training run. codec "dp" is data-parallel (lr is then its learning rate)."""

    codec: str
    h: int = 0
    topk: float = 0.0  # sparse codecs: the fraction of each chunk's values pushed
    pull_topk: float | None = None  # sparse codecs: the fraction pulled; None: twice topk
    lr: float = 1e-3  # the inner learning rate (data-parallel: its learning rate)
    steps: int = 1000
    seed: int = 0
    outer_lr: float | None = None  # None: the recipe's (sweeps only)
    outer_momentum: float | None = None  # the outer Nesterov's momentum; None: the recipe's
    feedback_decay: float | None = None  # sparse pushes' residual decay; None: the default
    feedback_in_model: bool = DEFAULT_FEEDBACK_IN_MODEL  # residual kept in the local model too
    merge_alpha: float | None = None  # the local fragment's merge weight; None: MERGE_ALPHA
    state_dtype: str = "float32"  # the server's outer_state_dtype
    sparse_mean: str = "learners"  # the server's sparse_mean (server/sparse_mean.py)
    untrusted: bool = False  # the server's untrusted_learners (K learners a round)

    def __post_init__(self) -> None:
        # A run's cache key is its settings' JSON, where 3 and 3.0 differ: store every setting
        # typed float as a float so that Row(outer_lr=3) finds the run Row(outer_lr=3.0) made.
        for spec in fields(self):
            value = getattr(self, spec.name)
            if "float" in str(spec.type) and value is not None:
                object.__setattr__(self, spec.name, float(value))

    @property
    def method(self) -> str:
        """The row without its seed: what the seeds of one table row share."""
        if self.codec == "dp":
            return f"data-parallel lr {self.lr:g}"
        k = f" top-k 1/{1 / self.topk:g}" if self.topk else ""
        pull = "" if self.pull_topk is None else f" pull {fraction_text(self.pull_topk)}"
        outer = "" if self.outer_lr is None else f" outer lr {self.outer_lr:g}"
        if self.outer_momentum is not None:
            outer += f" momentum {self.outer_momentum:g}"
        decay = "" if self.feedback_decay is None else f" decay {self.feedback_decay:g}"
        alpha = "" if self.merge_alpha is None else f" alpha {self.merge_alpha:g}"
        state = "" if self.state_dtype == "float32" else f" {self.state_dtype} state"
        if self.sparse_mean != "learners":
            state += f" {self.sparse_mean} mean"
        if self.untrusted:
            state += " untrusted learners"
        sparse = is_sparse(WIRE.get(self.codec, ""))
        kept = " residual in model" if self.feedback_in_model and sparse else ""
        return f"{self.codec}{k}{pull} H={self.h} lr {self.lr:g}{outer}{decay}{alpha}{kept}{state}"

    def setup(self, quick: bool = False, **kw) -> Setup:
        """The run's Setup; `kw` sets more of its fields (n_embd, device, lr_schedule)."""
        common = {"inner_lr": self.lr, "seed": self.seed, **kw}
        if quick:
            return Setup(steps=self.steps, eval_every=50, eval_batches=8, **common)
        return Setup(steps=self.steps, **common)

    def variant(self) -> Variant:
        if self.codec == "dp":
            return Variant(name=self.method, kind="dp")
        if self.codec not in WIRE:
            raise ValueError(f"unknown codec {self.codec!r}; choose one of {', '.join(WIRE)}")
        variant = Variant(
            name=self.method,
            sync_every_steps=self.h,
            fragments=FRAGMENTS,
            overlap_steps=1,
            merge_alpha=MERGE_ALPHA,
            push_codec=WIRE[self.codec],
            pull_codec=WIRE[self.codec],
            outer_momentum_warmup_rounds=WARMUP_ROUNDS,
            topk_fraction=self.topk,
        )
        if is_sparse(WIRE[self.codec]):
            # The daemons' defaults for sparse codecs: the outer step and, unless the row
            # sets one, a pull that keeps twice the push's fraction (server/config.py: 1/32
            # for 1/64); Variant's residual decay is the learner's default already.
            pull = self.pull_topk
            if pull is None:
                pull = min(1.0, 2 * self.topk) if self.topk else SPARSE_PULL_TOPK_FRACTION
            variant = replace(
                variant,
                **SPARSE_OUTER,
                server={"pull_topk_fraction": pull},
            )
        # The row's own settings where it sets them; the recipe's (above) where it leaves None.
        own = {
            "outer_lr": self.outer_lr,
            "outer_momentum": self.outer_momentum,
            "push_feedback_decay": self.feedback_decay,
            "merge_alpha": self.merge_alpha,
        }
        variant = replace(
            variant,
            push_feedback_in_model=self.feedback_in_model,
            **{name: value for name, value in own.items() if value is not None},
        )
        # Server settings a row changes from the harness's, only where it does: every run
        # cached before a setting existed keeps its key.
        server = {}
        if self.state_dtype != "float32":
            server["outer_state_dtype"] = self.state_dtype
        if self.sparse_mean != "learners":
            server["sparse_mean"] = self.sparse_mean
        if self.untrusted:  # every round waits for all K learners in sync mode anyway
            server |= {"untrusted_learners": True, "min_contributors": Setup.learners}
        if server:
            variant = replace(variant, server={**variant.server, **server})
        return variant


def fraction_text(fraction: float) -> str:
    """A kept fraction as 1/n when it is one, else as values kept of each chunk (3/64: 192/4096)."""
    n = 1 / fraction
    return f"1/{round(n)}" if abs(n - round(n)) < 1e-9 else f"{topk_k(fraction)}/{SPARSE_CHUNK}"


def cache_key(setup: Setup, variant: Variant) -> str:
    """The run's identity: every setting but the name (a dense row's unset top-k and
    residual settings left out, so that its key does not depend on settings it never uses;
    a residual kept apart from the model is the key without push_feedback_in_model)."""
    fields = {**asdict(variant), "name": ""}
    setup_fields = asdict(setup)
    if not setup.tf32:  # runs made before the setting existed keep their keys
        del setup_fields["tf32"]
    if not variant.topk_fraction:
        del fields["topk_fraction"]
    if not is_sparse(variant.push_codec):
        del fields["push_feedback_decay"]
    if not (is_sparse(variant.push_codec) and variant.push_feedback_in_model):
        del fields["push_feedback_in_model"]
    return json.dumps({"setup": setup_fields, "variant": fields}, sort_keys=True)


def positive_int(text: str) -> int:
    """An option's value that must be a whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def add_setup_args(parser: argparse.ArgumentParser) -> None:
    """The model, data, device and parallelism options that bench/quality.py and
    quality_sweep.py share."""
    parser.add_argument("--device", default="cpu", help="where the models train (cpu, cuda)")
    parser.add_argument(
        "--n-embd", type=int, default=64, help="model width: 64 = 0.22 M params, 128 = 0.9 M"
    )
    parser.add_argument("--n-layer", type=int, default=4, help="transformer blocks")
    parser.add_argument("--n-head", type=int, default=4, help="attention heads per block")
    parser.add_argument(
        "--corpus-mb", type=int, default=4, help="MiB of the built-in corpus per split"
    )
    parser.add_argument("--tf32", action="store_true", help="CUDA: float32 matrix products in TF32")
    parser.add_argument("--workers", type=positive_int, default=2, help="runs trained in parallel")
    parser.add_argument(
        "--threads",
        type=positive_int,
        default=1,
        help="torch CPU threads per run (on a GPU, more speed up the codecs and the outer step)",
    )
    parser.add_argument(
        "--lr-schedule",
        choices=["cosine", "constant"],
        default="constant",
        help="inner learning rate over the run, the same for every row: constant, or "
        "cosine (5%% linear warm-up, cosine decay to 10%%)",
    )


def setup_kw(args: argparse.Namespace) -> dict:
    """Setup fields from add_setup_args' options (for Row.setup and run_rows)."""
    return {
        "device": args.device,
        "n_embd": args.n_embd,
        "n_layer": args.n_layer,
        "n_head": args.n_head,
        "corpus_max_bytes": args.corpus_mb << 20,
        "tf32": args.tf32,
        "lr_schedule": args.lr_schedule,
    }


def run_rows(
    rows: list[Row],
    cache: Path | None,
    workers: int = 2,
    quick: bool = False,
    threads: int = 1,
    **setup_kw,
) -> dict[Row, Result]:
    """Each row's result: from `cache` when it holds the same run, else trained (in parallel
    over `workers` processes of `threads` torch CPU threads each, in the rows' order, the
    cache rewritten after each run)."""
    stored = json.loads(cache.read_text()) if cache and cache.exists() else {}
    jobs = {row: (row.setup(quick, **setup_kw), row.variant()) for row in rows}
    out = {}
    todo = []
    for row, (setup, variant) in jobs.items():
        hit = stored.get(cache_key(setup, variant))
        if hit is not None:
            out[row] = Result(**{**hit, "variant": asdict(variant)})
        else:
            todo.append(row)
    print(f"{len(rows)} runs: {len(rows) - len(todo)} cached, {len(todo)} to train", flush=True)

    failed = []

    def finish(row: Row, train) -> None:
        """Keep `train()`'s run (cache file rewritten), or report its failure and go on."""
        try:
            result = train()
        except Exception as exc:  # noqa: BLE001 - reported here, raised after the last run
            print(f"  FAILED: {row.method} seed {row.seed}: {exc!r}", flush=True)
            failed.append(f"{row.method} seed {row.seed}")
            return
        out[row] = result
        print(
            f"  done: {row.method} seed {row.seed} steps {row.steps}: "
            f"eval_loss={result.eval_loss:.4f} ({result.wall_s:.0f} s, CPU {result.cpu_s:.0f} s)",
            flush=True,
        )
        if cache:
            save(cache, cache_key(*jobs[row]), asdict(result))

    # One torch thread per run by default: on the CPU the thread count can move a matrix
    # product's last bits. Runs on a GPU spend their CPU time in the codecs and the outer
    # step, element-wise work that more threads speed up.
    if workers <= 1:  # one at a time, in this process
        for row in todo:
            finish(row, lambda row=row: run_variant(*jobs[row], threads))
    else:
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
            futures = {pool.submit(run_variant, *jobs[row], threads): row for row in todo}
            # Each run is kept as soon as it ends: a failed run, or a kill later, loses only
            # itself and the runs still going, not the finished ones queued behind it.
            for future in as_completed(futures):
                finish(futures[future], future.result)
    if failed:
        raise RuntimeError(f"{len(failed)} run(s) failed: {'; '.join(failed)}")
    return out


def save(cache: Path, key: str, result: dict) -> None:
    """Add one run to the cache file, keeping what other processes wrote meanwhile."""
    stored = json.loads(cache.read_text()) if cache.exists() else {}
    stored[key] = result
    partial = cache.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(json.dumps(stored, indent=0))
    partial.replace(cache)
