"""One adversarial learner among eight cannot steer the model when the defenses are on.

Eight learners train the built-in GPT on the stdlib corpus against the real Aggregator in
quorum mode (bench/simulate.py: the learners' own sync code, lockstep, in one process). The
eighth sends −10 times its pseudo-gradient and declares and claims 100 times its tokens: it
passes the token-claim check (its claims match its declaration) and the norm guard (set to
20x: every one of its pushes gets in, the worst case for the merge). With the weight cap and
the trimmed mean its push is outvoted value by value; with plain token-weighted averaging
it owns the step. bench/adversary.py runs the longer version (docs/RESULTS.md).
"""

from __future__ import annotations

import math

from bench.simulate import Setup, Variant, run_variant

SETUP = Setup(
    n_layer=1,
    n_embd=32,
    n_head=2,
    block_size=32,
    batch_size=4,
    learners=8,
    steps=60,
    eval_every=60,
    eval_batches=4,
    corpus_max_bytes=300_000,
)
QUORUM = {"mode": "quorum", "min_contributors": 8, "max_norm_ratio": 20.0}
UNDEFENDED = {**QUORUM, "max_weight_ratio": 0.0, "robust_merge": "none"}
DEFENDED = {**QUORUM, "max_weight_ratio": 4.0, "robust_merge": "trimmed-mean"}


def final_loss(server: dict, adversaries: int) -> float:
    variant = Variant(name="adversary", sync_every_steps=10, server=server, adversaries=adversaries)
    return run_variant(SETUP, variant).eval_loss


def test_one_adversary_among_eight_is_contained_by_the_defenses() -> None:
    clean = final_loss(UNDEFENDED, adversaries=0)
    defended = final_loss(DEFENDED, adversaries=1)
    undefended = final_loss(UNDEFENDED, adversaries=1)
    print(f"eval loss: clean {clean:.4f} defended {defended:.4f} undefended {undefended:.4f}")
    assert clean < 4.0  # it trained (the untrained model starts near 5.5)
    assert abs(defended - clean) <= 0.02 * clean
    assert not math.isfinite(undefended) or undefended > 1.05 * clean
