"""One adversarial learner among eight: how far does it move the model, defenses on and off?

    python -m bench.adversary            # full run (~13 min on 2 busy cores)
    python -m bench.adversary --quick    # shortened (~2 min), same outputs

Eight learners train the built-in GPT on the stdlib corpus against the real Aggregator in
quorum mode (bench/simulate.py: the learners' own sync code, lockstep, in one process),
Streaming DiLoCo with 2 fragments and 4 bits both ways. The adversary (the eighth learner)
sends −10 times its pseudo-gradient and declares at Join and claims 100 times its tokens, so
the token-claim check passes it; the norm guard is set to 20x so that every one of its pushes
gets in (the worst case for the merge). Variants: no adversary (undefended settings, and each
defense alone: what a defense costs an honest run), and with the adversary: no defense, the
weight cap alone (max_weight_ratio 4), the cap with the trimmed mean (untrusted_learners'
merge). Writes bench/results/adversary.json: each variant's final eval loss of the global model
and its ratio to the clean run's.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, replace
from pathlib import Path

from bench.simulate import Setup, Variant, run_variant

RESULTS = Path(__file__).resolve().parent / "results"
QUORUM = {"mode": "quorum", "min_contributors": 8, "max_norm_ratio": 20.0}
OFF = {"max_weight_ratio": 0.0, "robust_merge": "none"}
CAP = {"max_weight_ratio": 4.0}
# (name, adversaries, server settings beyond QUORUM)
VARIANTS = [
    ("clean", 0, OFF),
    ("clean, cap + trimmed mean", 0, {**CAP, "robust_merge": "trimmed-mean"}),
    ("adversary, no defense", 1, OFF),
    ("adversary, cap", 1, {**CAP, "robust_merge": "none"}),
    ("adversary, cap + trimmed mean", 1, {**CAP, "robust_merge": "trimmed-mean"}),
]


def run_one(setup: Setup, name: str, adversaries: int, server: dict) -> dict:
    variant = Variant(
        name=name,
        sync_every_steps=10,
        fragments=2,
        push_codec="fp4_e2m1",
        pull_codec="fp4_e2m1",
        outer_momentum_warmup_rounds=20,
        server={**QUORUM, **server},
        adversaries=adversaries,
    )
    result = run_variant(setup, variant)
    return {
        "name": name,
        "adversaries": adversaries,
        "server": variant.server,
        "eval_loss": result.eval_loss,
        "curve": result.curve,
        "wall_s": result.wall_s,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shortened run")
    parser.add_argument("--workers", type=int, default=2, help="variants run in parallel")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    setup = Setup(
        n_layer=2,
        n_embd=64,
        n_head=4,
        block_size=64,
        batch_size=8,
        learners=8,
        steps=300,
        eval_every=50,
        eval_batches=16,
    )
    if args.quick:
        setup = replace(
            setup,
            n_embd=32,
            n_head=2,
            block_size=32,
            batch_size=4,
            steps=100,
            eval_batches=4,
            corpus_max_bytes=300_000,
        )
    started = time.perf_counter()
    with ProcessPoolExecutor(args.workers) as pool:
        jobs = [pool.submit(run_one, setup, *v) for v in VARIANTS]
        rows = [job.result() for job in jobs]
    clean = rows[0]["eval_loss"]
    for row in rows:
        row["vs_clean"] = row["eval_loss"] / clean if math.isfinite(row["eval_loss"]) else None
        ratio = f"{row['vs_clean']:.4f}" if row["vs_clean"] is not None else "diverged"
        print(f"{row['name']:34s} eval loss {row['eval_loss']:10.4f}  vs clean {ratio}")
    args.out.mkdir(parents=True, exist_ok=True)
    report = {
        "setup": asdict(setup),
        "quick": args.quick,
        "variants": rows,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    name = "adversary_quick.json" if args.quick else "adversary.json"
    (args.out / name).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
