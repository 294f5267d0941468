"""How far can one learner of eight move a round's outer step, under each merge?

    python -m bench.influence_bound            # 8 seeds, about a minute on 2 cores
    python -m bench.influence_bound --quick    # 3 seeds

Eight learners start from one model (the built-in GPT, 2 layers, 64 wide, after a common
warm-up on the stdlib corpus) and each trains H inner AdamW steps on batches of its own, so
their pseudo-gradients are real ones. The real Aggregator merges them in quorum mode (K = 8)
with a plain outer step (outer lr 1, no momentum, fp32 pulls): a round's step is exactly its
merged pseudo-gradient. A first round of honest pushes gives every learner a last weight and
the norm guard its window; the second round is measured. The adversary is the eighth learner:
it sends -5 times its own pseudo-gradient (5x the norm, opposite sign), declares at Join 100
times the others' tokens per step and claims the most tokens that declaration allows.

Deviation = ||step with the adversary - step with the eighth learner honest|| / ||that honest
step||, each under the same settings. Writes bench/results/influence_bound.json; prints each
variant's mean, std and largest deviation over the seeds, and PASS/FAIL for untrusted_learners'
bound (at most 0.25).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from bench.simulate import Setup, load_data
from learner.data import BatchSampler
from learner.model import GPT
from server.aggregator import Aggregator
from server.config import aggregator_config
from server.rounds.admission import TOKEN_CLAIM_SLACK
from server.state.params import ParamSpec

RESULTS = Path(__file__).resolve().parent / "results"
LEARNERS, H, WARMUP_STEPS, TOKENS_PER_STEP = 8, 20, 100, 8 * 64
ADVERSARY_SCALE, CLAIM_FACTOR, BOUND = -5.0, 100, 0.25
PLAIN_STEP = {"outer_lr": 1.0, "outer_momentum": 0.0, "pull_codec": "fp32", "mode": "quorum"}
VARIANTS = {  # the server's settings beyond PLAIN_STEP and K = 8
    "defaults (weight cap 4, weighted mean)": {},
    "trimmed-mean": {"robust_merge": "trimmed-mean"},
    "untrusted_learners": {"untrusted_learners": True},
}
SETUP = Setup(n_layer=2, n_embd=64, block_size=64, batch_size=8, inner_lr=2e-3)


def pseudo_gradients(seed: int, tokens: torch.Tensor) -> tuple[list, list[list[torch.Tensor]]]:
    """The start (after a common warm-up) and each learner's pseudo-gradient from it."""
    torch.manual_seed(seed)
    model = GPT(SETUP.model_config())
    train(model, BatchSampler(tokens, SETUP.batch_size, SETUP.block_size, seed), WARMUP_STEPS)
    start = [p.detach().clone() for p in model.parameters()]
    deltas = []
    for i in range(LEARNERS):
        with torch.no_grad():
            for p, s in zip(model.parameters(), start, strict=True):
                p.copy_(s)
        sampler = BatchSampler(tokens, SETUP.batch_size, SETUP.block_size, 1000 * seed + i + 1)
        train(model, sampler, H)
        deltas.append([s - p.detach() for s, p in zip(start, model.parameters(), strict=True)])
    return start, deltas


def train(model: GPT, sampler: BatchSampler, steps: int) -> None:
    optimizer = torch.optim.AdamW(model.parameters(), lr=SETUP.inner_lr, weight_decay=0.1)
    for _ in range(steps):
        _, loss = model(*sampler.next())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()


def round_step(settings: dict, start: list, deltas: list, adversary: bool) -> torch.Tensor:
    """The measured round's step (flattened) under `settings`."""
    config = aggregator_config(**PLAIN_STEP, min_contributors=LEARNERS, **settings)
    agg = Aggregator(config)
    specs = [ParamSpec(f"p{i}", tuple(t.shape), "float32") for i, t in enumerate(start)]
    declared = [TOKENS_PER_STEP] * (LEARNERS - 1) + [TOKENS_PER_STEP * CLAIM_FACTOR]
    sessions = [agg.join(f"l{i}", specs, d).session_id for i, d in enumerate(declared)]
    agg.initialize(sessions[0], 0, [t.clone() for t in start])
    for version in (0, 1):
        for i, (session, delta) in enumerate(zip(sessions, deltas, strict=True)):
            tokens = H * TOKENS_PER_STEP
            if adversary and version == 1 and i == LEARNERS - 1:
                delta = [ADVERSARY_SCALE * d for d in delta]
                tokens = int(TOKEN_CLAIM_SLACK * H * declared[i])  # the most it may claim
            agg.push(session, 0, version, delta, tokens, H)
        if version == 0:
            before = torch.cat([p.flatten() for p in agg.params(0)])
    return before - torch.cat([p.flatten() for p in agg.params(0)])


def deviation(settings: dict, start: list, deltas: list) -> float:
    honest = round_step(settings, start, deltas, adversary=False)
    attacked = round_step(settings, start, deltas, adversary=True)
    return float((attacked - honest).norm() / honest.norm())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 seeds instead of 8")
    parser.add_argument("--out", type=Path, default=RESULTS / "influence_bound.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    seeds = range(3 if args.quick else 8)
    tokens = load_data(SETUP)[1]
    found: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for seed in seeds:
        start, deltas = pseudo_gradients(seed, tokens)
        for name, settings in VARIANTS.items():
            found[name].append(deviation(settings, start, deltas))
    rows = {}
    for name, values in found.items():
        std = statistics.stdev(values) if len(values) > 1 else 0.0
        rows[name] = {"mean": statistics.fmean(values), "std": std, "max": max(values)}
        print(f"{name:40s} deviation {rows[name]['mean']:7.1%} ± {std:6.1%}, max {max(values):.1%}")
    passed = rows["untrusted_learners"]["max"] <= BOUND
    print(f"untrusted_learners: largest deviation <= {BOUND:.0%}: {'PASS' if passed else 'FAIL'}")
    setup = {"learners": LEARNERS, "H": H, "warmup_steps": WARMUP_STEPS, "seeds": list(seeds)}
    setup |= {"adversary_scale": ADVERSARY_SCALE, "claim_factor": CLAIM_FACTOR}
    result = {"setup": setup, "deviation": rows, "per_seed": found, "bound": BOUND}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result | {"passed": passed}, indent=1) + "\n")


if __name__ == "__main__":
    main()
