"""Sanity of the whole DiLoCo pipeline: with one learner, outer lr 1 and no momentum, fp32
both ways, an outer step just hands back the learner's own parameters, so the run must equal
plain training step for step. Any error in deltas, signs, replicas or merges breaks this."""

from __future__ import annotations

import pytest

from bench.simulate import Setup, Variant, data_seed, run_variant

TINY = Setup(
    n_layer=1,
    n_embd=32,
    n_head=2,
    block_size=32,
    batch_size=4,
    learners=1,
    steps=20,
    eval_every=5,
    eval_batches=2,
    corpus_max_bytes=300_000,
)


def test_one_learner_diloco_equals_plain_training() -> None:
    plain = run_variant(TINY, Variant(name="plain", kind="dp"))
    diloco = run_variant(
        TINY, Variant(name="diloco", sync_every_steps=5, outer_lr=1.0, outer_momentum=0.0)
    )
    assert [t for t, _ in diloco.curve] == [t for t, _ in plain.curve]
    for (_, a), (_, b) in zip(diloco.curve, plain.curve, strict=True):
        assert a == pytest.approx(b, rel=1e-5)


def test_outer_momentum_changes_the_trajectory() -> None:
    plain = run_variant(TINY, Variant(name="plain", kind="dp"))
    nesterov = run_variant(TINY, Variant(name="nesterov", sync_every_steps=5))
    assert nesterov.eval_loss != pytest.approx(plain.eval_loss, rel=1e-5)


def test_inner_learning_rate_schedules() -> None:
    from bench.simulate import lr_factor

    constant = Setup(steps=100)
    assert {lr_factor(constant, s) for s in (1, 50, 100)} == {1.0}
    cosine = Setup(steps=100, lr_schedule="cosine", warmup_fraction=0.1, min_lr_ratio=0.1)
    assert lr_factor(cosine, 1) == pytest.approx(0.1)  # linear warm-up over 10 steps
    assert lr_factor(cosine, 10) == pytest.approx(1.0)
    assert lr_factor(cosine, 55) == pytest.approx(0.55)  # halfway down the cosine
    assert lr_factor(cosine, 100) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="lr_schedule"):
        lr_factor(Setup(lr_schedule="linear"), 1)


def test_seed_moves_model_init_and_data_order() -> None:
    seeded = Setup(**{**TINY.__dict__, "seed": 1})
    base, other = (
        run_variant(TINY, Variant(name="dp", kind="dp")),
        run_variant(seeded, Variant(name="dp", kind="dp")),
    )
    assert base.curve[0][1] != other.curve[0][1]  # another init
    assert base.eval_loss != other.eval_loss
    assert data_seed(seeded) != data_seed(TINY) == 1000  # seed 0: the published figures


def test_benchmarks_train_on_the_learners_built_in_corpus() -> None:
    """The quality benchmark once read the whole stdlib tree, site-packages and tests
    included, while learners skip those: its figures then belonged to other data."""
    import torch

    from bench.simulate import load_data
    from learner.data import load_corpus

    setup = Setup()  # 4 MiB: enough to reach site-packages/ in the sorted stdlib tree
    mine = load_data(setup)
    for ours, theirs in zip(mine, load_corpus("stdlib", setup.corpus_max_bytes), strict=True):
        assert torch.equal(ours, theirs)
