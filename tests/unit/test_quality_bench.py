"""The quality benchmark's bookkeeping: rows, the run cache, per-seed gaps and verdicts."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, replace

import pytest

from bench import quality, quality_runs
from bench.quality_runs import Row, cache_key, run_rows
from bench.simulate import Result
from learner.config import SyncConfig
from server.config import SPARSE_OUTER


def test_a_sweep_row_overrides_the_outer_lr_and_the_residual_decay() -> None:
    default = Row("sparse-2bit", h=20, topk=1 / 64)
    swept = Row("sparse-2bit", h=20, topk=1 / 64, outer_lr=2.0, feedback_decay=0.9)
    assert (swept.variant().outer_lr, swept.variant().push_feedback_decay) == (2.0, 0.9)
    assert swept.method == "sparse-2bit top-k 1/64 H=20 lr 0.001 outer lr 2 decay 0.9"
    # A row that names the recipe's own values is the same run as the default row.
    same = Row("sparse-2bit", h=20, topk=1 / 64, outer_lr=SPARSE_OUTER["outer_lr"])
    key = quality_runs.cache_key(default.setup(), default.variant())
    assert quality_runs.cache_key(same.setup(), same.variant()) == key
    assert quality_runs.cache_key(swept.setup(), swept.variant()) != key


def test_a_whole_number_setting_finds_the_run_its_float_made() -> None:
    """A cache key is JSON, where 3 and 3.0 differ: a row keys its real settings as floats."""
    whole = Row("sparse-2bit", h=5, topk=1, lr=1, outer_lr=3, outer_momentum=0, merge_alpha=0)
    real = replace(whole, topk=1.0, lr=1.0, outer_lr=3.0, outer_momentum=0.0, merge_alpha=0.0)
    key = quality_runs.cache_key
    assert key(whole.setup(), whole.variant()) == key(real.setup(), real.variant())
    assert whole == real and whole.method == real.method
    assert Row("fp4", h=5).outer_lr is None  # unset stays unset: the recipe's value


def test_a_row_may_set_the_merge_alpha_and_the_recipes_value_keeps_the_cached_key() -> None:
    default = Row("sparse-2bit", h=5, topk=1 / 64, feedback_in_model=True)
    zero = replace(default, merge_alpha=0.0)
    assert zero.variant().merge_alpha == 0.0
    assert default.variant().merge_alpha == quality_runs.MERGE_ALPHA
    assert zero.method == default.method.replace(" residual", " alpha 0 residual")
    key = quality_runs.cache_key
    same = replace(default, merge_alpha=quality_runs.MERGE_ALPHA)
    assert key(same.setup(), same.variant()) == key(default.setup(), default.variant())
    assert key(zero.setup(), zero.variant()) != key(default.setup(), default.variant())


def test_the_residual_rule_is_part_of_a_sparse_rows_key_and_absent_from_a_dense_rows() -> None:
    """Kept in the model is its own run; apart (the default), the key has no such setting, so
    a cache whose sparse runs carry no such setting holds apart runs."""
    key = quality_runs.cache_key
    model = Row("sparse-2bit", h=5, topk=1 / 64, feedback_in_model=True)
    apart = Row("sparse-2bit", h=5, topk=1 / 64)
    assert '"push_feedback_in_model": true' in key(model.setup(), model.variant())
    assert "push_feedback_in_model" not in key(apart.setup(), apart.variant())
    dense = Row("fp4", h=5)
    assert "push_feedback_in_model" not in key(dense.setup(), dense.variant())
    assert Row("fp4", h=5, feedback_in_model=True).method == dense.method
    assert model.method == apart.method + " residual in model"
    recipe_k = Row("sparse-2bit", h=5, feedback_in_model=True)  # the codec's own top-k
    assert recipe_k.method.endswith("residual in model")


def test_a_state_dtype_row_is_its_own_run_and_float32_keeps_the_cached_key() -> None:
    plain = Row("fp4", h=20, lr=2e-3)
    compact = Row("fp4", h=20, lr=2e-3, state_dtype="bfloat16")
    assert compact.variant().server == {"outer_state_dtype": "bfloat16"}
    assert compact.method == "fp4 H=20 lr 0.002 bfloat16 state"
    assert plain.variant().server == {}  # the key of every run cached before the setting
    sparse = Row("sparse-2bit", h=20, topk=1 / 64, state_dtype="bfloat16").variant()
    assert sparse.server == {"pull_topk_fraction": 1 / 32, "outer_state_dtype": "bfloat16"}


def test_the_simulated_server_keeps_float32_state_unless_a_row_asks(monkeypatch) -> None:
    """The daemons default to bfloat16 outer state; the benchmark's rows (and every run in its
    cache, whose key holds only what a row sets) train with float32 unless they say so."""
    from bench import simulate

    class Built(Exception):
        pass

    def aggregator(config, **_):
        raise Built(config.outer.outer_state_dtype)

    monkeypatch.setattr(simulate, "Aggregator", aggregator)
    for row, dtype in [
        (Row("fp4", h=20), "float32"),
        (Row("fp4", h=20, state_dtype="bfloat16"), "bfloat16"),
        (Row("sparse-2bit", h=20, topk=1 / 64), "float32"),
    ]:
        with pytest.raises(Built, match=dtype):
            simulate.run_variant(row.setup(), row.variant())


def test_the_trend_has_every_row_at_every_step_count_and_seed() -> None:
    from bench.quality_sweep import trend_rows

    args = argparse.Namespace(
        seeds=[0, 1], steps_list=[1000, 3000], codecs=["fp4", "sparse-2bit:0.015625"], h=[20],
        dp_lr=[2e-3], inner_lr=2e-3, residual_in_model=False,
    )  # fmt: skip
    rows = trend_rows(args)
    assert len(rows) == 2 * 2 * 3 and len(set(rows)) == len(rows)
    args.dp_lr = [2e-3, 1e-3]  # one data-parallel row per lr
    assert Row("dp", lr=1e-3, steps=3000, seed=0) in trend_rows(args)
    assert len(trend_rows(args)) == 2 * 2 * 4
    args.dp_lr = []  # `--dp-lr` with no value: the codec rows alone
    assert len(trend_rows(args)) == 2 * 2 * 2
    assert not any(row.codec == "dp" for row in trend_rows(args))
    args.dp_lr = [2e-3]
    assert Row("sparse-2bit", h=20, topk=0.015625, lr=2e-3, steps=3000, seed=1) in rows
    assert Row("dp", lr=2e-3, steps=1000, seed=1) in rows
    assert not any(row.feedback_in_model for row in rows)
    args.residual_in_model = True
    sparse = [row for row in trend_rows(args) if row.codec == "sparse-2bit"]
    assert len(sparse) == 4 and all(row.feedback_in_model for row in sparse)


def test_a_row_is_a_codec_name_h_and_learning_rate() -> None:
    fp4 = Row("fp4", h=20, lr=2e-3).variant()
    assert (fp4.push_codec, fp4.pull_codec, fp4.sync_every_steps) == ("fp4_e2m1", "fp4_e2m1", 20)
    assert (fp4.merge_alpha, fp4.outer_momentum_warmup_rounds, fp4.fragments) == (0.05, 20, 4)
    assert Row("fp4", h=20, lr=2e-3, seed=3).setup().inner_lr == 2e-3
    assert Row("dp", lr=4e-3).variant().kind == "dp"
    sparse = Row("sparse-2bit", h=20, topk=1 / 64)
    assert (sparse.variant().push_codec, sparse.variant().topk_fraction) == ("sparse_2bit", 1 / 64)
    assert sparse.method == "sparse-2bit top-k 1/64 H=20 lr 0.001"
    # Sparse rows take the daemons' defaults for sparse codecs; dense rows keep the Nesterov.
    got = sparse.variant()
    assert (got.outer_lr, got.outer_momentum, got.outer_momentum_warmup_rounds) == tuple(
        SPARSE_OUTER[name]
        for name in ("outer_lr", "outer_momentum", "outer_momentum_warmup_rounds")
    )
    assert got.push_feedback_decay == SyncConfig().push_feedback_decay
    assert got.server == {"pull_topk_fraction": 1 / 32}  # twice the push's
    assert (fp4.outer_lr, fp4.outer_momentum) == (0.7, 0.9)
    dense, other = Row("fp4", h=20), Row("fp4", h=50)
    key = quality_runs.cache_key(dense.setup(), dense.variant())
    # A dense row's key leaves out the settings its run never uses.
    assert "topk_fraction" not in key and "push_feedback_decay" not in key
    assert "push_feedback_decay" in quality_runs.cache_key(sparse.setup(), got)
    assert key != quality_runs.cache_key(other.setup(), other.variant())
    with pytest.raises(ValueError, match="unknown codec 'fp3'"):
        Row("fp3", h=20).variant()


def fake_result(loss: float, push: int, pull: int, syncs: int = 10) -> Result:
    return Result({}, loss, [(0, 5.0), (1, loss)], push + pull, push, pull, syncs, numel=100)


def test_the_cache_trains_each_run_once(tmp_path, monkeypatch) -> None:
    trained = []

    def train(setup, variant, threads):
        trained.append((setup.seed, variant.kind))
        return fake_result(1.0 + setup.seed, 400, 400)

    monkeypatch.setattr(quality_runs, "run_variant", train)
    cache = tmp_path / "runs.json"
    rows = [Row("dp", seed=0), Row("fp4", h=20, seed=0)]
    first = run_rows(rows, cache, workers=1)
    again = run_rows([*rows, Row("dp", seed=1)], cache, workers=1)
    assert trained == [(0, "dp"), (0, "diloco"), (1, "dp")]
    assert again[rows[1]].eval_loss == first[rows[1]].eval_loss == 1.0
    assert asdict(again[rows[0]])["push_bytes"] == 400


def test_a_failed_run_is_named_and_the_others_are_kept(tmp_path, monkeypatch, capsys) -> None:
    def train(setup, variant, threads):
        if variant.kind == "diloco":
            raise ValueError("no fragments")
        return fake_result(1.0 + setup.seed, 400, 400)

    monkeypatch.setattr(quality_runs, "run_variant", train)
    cache = tmp_path / "runs.json"
    rows = [Row("fp4", h=20, seed=0), Row("dp", seed=0), Row("dp", seed=1)]
    with pytest.raises(RuntimeError, match=r"1 run\(s\) failed: fp4 H=20 lr 0.001 seed 0"):
        run_rows(rows, cache, workers=1)
    assert "FAILED: fp4 H=20 lr 0.001 seed 0: ValueError('no fragments')" in capsys.readouterr().out
    assert len(json.loads(cache.read_text())) == 2  # both data-parallel runs kept


def test_model_data_and_device_options_reach_the_setup_and_tf32_off_keeps_cached_keys() -> None:
    parser = argparse.ArgumentParser()
    quality_runs.add_setup_args(parser)
    args = parser.parse_args(["--device", "cuda", "--n-layer", "8", "--n-embd", "512",
                              "--n-head", "8", "--corpus-mb", "16", "--tf32"])  # fmt: skip
    setup = Row("fp4", h=20).setup(**quality_runs.setup_kw(args))
    assert (setup.device, setup.n_layer, setup.n_embd, setup.n_head) == ("cuda", 8, 512, 8)
    assert (setup.corpus_max_bytes, setup.tf32) == (16 << 20, True)
    row = Row("fp4", h=20)
    assert '"tf32": true' in quality_runs.cache_key(setup, row.variant())
    # Off, the key is what it was before the option existed: cached runs stay valid.
    defaults = row.setup(**quality_runs.setup_kw(parser.parse_args([])))
    assert defaults == row.setup()
    assert "tf32" not in quality_runs.cache_key(defaults, row.variant())


def test_rows_report_mean_and_std_of_gaps_against_the_same_seeds_dp() -> None:
    rows = [Row("dp", lr=2e-3, seed=s) for s in (0, 1)] + [Row("fp4", h=20, seed=s) for s in (0, 1)]
    results = {
        rows[0]: fake_result(2.0, 600_000, 600_000, syncs=1000),
        rows[1]: fake_result(1.0, 600_000, 600_000, syncs=1000),
        rows[2]: fake_result(2.2, 30, 20),
        rows[3]: fake_result(1.0, 30, 20),
    }
    dp, fp4 = quality.summarize(results, rows)
    assert (dp["gap_vs_dp"], dp["gap_std"], dp["bits_per_param_push"]) == (0.0, 0.0, 48.0)
    assert fp4["seeds"] == [0, 1] and fp4["dp_lr"] == 2e-3
    assert fp4["gap_vs_dp"] == pytest.approx(0.05)  # +10% and 0%
    assert fp4["gap_std"] == pytest.approx(0.0707, abs=1e-4)
    assert (fp4["bits_per_param_push"], fp4["bits_per_param_pull"]) == (0.24, 0.16)
    assert fp4["bytes_ratio_vs_dp"] == 1_200_000 / 50
    _, one = quality.summarize(results, rows[::2])  # seed 0 alone: no deviation to report
    assert (one["seeds"], one["gap_std"], one["eval_loss_std"]) == ([0], None, None)


def entry(codec: str, h: int, gap: float, nbytes: int) -> dict:
    dp_bytes = 1_000_000
    return {"name": f"{codec} H={h}", "codec": codec, "h": h, "gap_vs_dp": gap}, {
        "bytes_per_learner": nbytes,
        "bytes_ratio_vs_dp": dp_bytes / nbytes,
    }


def test_checks_name_the_best_ratio_and_judge_sparse_against_fp4() -> None:
    entries = [
        {**a, **b}
        for a, b in (
            entry("dp", 0, 0.0, 1_000_000),
            entry("fp4", 20, 0.02, 4000),
            entry("sparse-2bit", 20, 0.024, 400),
            entry("sparse-2bit", 20, 0.03, 900),  # a denser message: fewer bytes saved
        )
    ]
    entries[-1]["name"] = "sparse-2bit H=20 top-k 1/16"
    lines = quality.check(entries)
    assert "INFO  best bytes ratio vs tuned DP at mean gap <= 1%: none" in lines
    assert "INFO  best bytes ratio vs tuned DP at mean gap <= 3%: 2500x (sparse-2bit H=20)" in lines
    assert "FAIL  >= 1000x fewer bytes than tuned DP at mean gap <= 1%" in lines
    assert any(x.startswith("PASS  sparse-2bit H=20: 10.0x fewer bytes") for x in lines)
    assert any(x.startswith("FAIL  sparse-2bit H=20 top-k 1/16: 4.4x fewer") for x in lines)


@pytest.mark.parametrize("quick", [True, False])
def test_the_benchmark_writes_every_row_over_its_seeds(tmp_path, monkeypatch, quick) -> None:
    def train(setup, variant, threads):
        dp = variant.kind == "dp"
        return fake_result(1.5 + 0.01 * setup.seed + (0 if dp else 0.02), 600, 400)

    def plot(entries, out_dir):  # matplotlib is a bench extra, not a test dependency
        (out_dir / "quality_tradeoff.png").write_bytes(b"")

    monkeypatch.setattr(quality_runs, "run_variant", train)
    monkeypatch.setattr(quality, "plot", plot)
    argv = ["quality.py", "--workers", "1", "--out", str(tmp_path), "--seeds", "0", "1", "2"]
    monkeypatch.setattr("sys.argv", argv + (["--quick"] if quick else []))
    assert quality.main() == 0
    report = json.loads(
        (tmp_path / ("quality_quick.json" if quick else "quality.json")).read_text()
    )
    rows = quality.QUICK if quick else quality.HEADLINE
    assert len(report["variants"]) == 1 + len(rows) and report["dp_lr"] == quality.DP_LR
    for e in report["variants"]:
        assert e["seeds"] == [0, 1, 2]
        for key in ("eval_loss", "gap_vs_dp", "gap_std", "bytes_ratio_vs_dp", "dp_lr"):
            assert key in e
        assert e["bits_per_param_push"] > 0 and e["bits_per_param_pull"] > 0
    assert report["checks"][-1].startswith(("PASS", "FAIL"))
    assert (tmp_path / "quality_tradeoff.png").exists() != quick


def test_rows_are_given_as_codec_h_topk_outer_lr_and_residual_rule() -> None:
    row = quality.parse_row("sparse-2bit:20:0.015625")
    assert row == Row("sparse-2bit", h=20, topk=0.015625) and not row.feedback_in_model
    assert row.variant().push_feedback_in_model is False
    assert quality.parse_row("fp32:50") == Row("fp32", h=50)
    assert quality.parse_row("fp4:5:0:0.35") == Row("fp4", h=5, outer_lr=0.35)
    kept = quality.parse_row("sparse-2bit:5:0.015625::inmodel")
    assert kept == Row("sparse-2bit", h=5, topk=0.015625, feedback_in_model=True)
    assert kept.method.endswith("residual in model") and kept.variant().push_feedback_in_model
    for bad, why in [("fp4", "expected codec:H"), ("fp3:20", "unknown codec"), ("fp4:0", "H must"),
                     ("fp4:5:0:0", "outer lr"), ("fp4:5:0:1:2", "expected"),
                     ("sparse-2bit:5:0/0.5", "needs a push"), ("sparse-2bit:5:0.5/0", "must be in"),
                     ("sparse-2bit:5:0.5/2", "must be in"), ("fp4:5:0.5/0.5", "pulls dense"),
                     ("sparse-2bit:5:0.5/x", "could not convert")]:  # fmt: skip
        with pytest.raises(argparse.ArgumentTypeError, match=why):
            quality.parse_row(bad)


def test_a_row_may_set_its_pull_fraction_apart_from_twice_the_push() -> None:
    default = quality.parse_row("sparse-2bit:5:0.015625:4.5")
    assert default.pull_topk is None
    assert default.variant().server["pull_topk_fraction"] == 2 * 0.015625
    row = quality.parse_row("sparse-2bit:5:0.015625/0.046875:4.5:inmodel")
    assert row == Row("sparse-2bit", h=5, topk=0.015625, pull_topk=0.046875, outer_lr=4.5,
                      feedback_in_model=True)  # fmt: skip
    assert row.variant().server["pull_topk_fraction"] == 0.046875
    assert " pull 192/4096 " in row.method and " pull " not in default.method
    assert " pull 1/32 " in replace(row, pull_topk=1 / 32).method
    # The pull's fraction is part of the run's identity: the two rows never share a cache entry.
    apart = replace(row, feedback_in_model=False, outer_lr=None)
    default = replace(default, outer_lr=None)
    assert len({cache_key(r.setup(), r.variant()) for r in (default, apart)}) == 2


def test_a_row_may_set_its_outer_momentum_with_its_outer_lr() -> None:
    row = quality.parse_row("sparse-2bit:5:0.015625:2.25/0.5:inmodel")
    assert row == Row("sparse-2bit", h=5, topk=0.015625, outer_lr=2.25, outer_momentum=0.5,
                      feedback_in_model=True)  # fmt: skip
    assert (row.variant().outer_lr, row.variant().outer_momentum) == (2.25, 0.5)
    assert " outer lr 2.25 momentum 0.5 " in row.method
    # Without one, the recipe's momentum: none for a sparse codec, DiLoCo's 0.9 for fp4.
    assert quality.parse_row("sparse-2bit:5:0.015625:2.25").variant().outer_momentum == 0.0
    assert quality.parse_row("fp4:5:0:0.125").variant().outer_momentum == 0.9
    assert quality.parse_row("fp4:5:0:0.125/0.8").variant().outer_momentum == 0.8
    plain = Row("sparse-2bit", h=5, topk=1 / 64, outer_lr=2.25)
    light = replace(row, feedback_in_model=False)
    assert len({cache_key(r.setup(), r.variant()) for r in (plain, light)}) == 2
    for bad in ("fp4:5:0:/0.5", "fp4:5:0:0.1/1", "fp4:5:0:0.1/-0.1", "fp4:5:0:0.1/nan"):
        with pytest.raises(argparse.ArgumentTypeError, match="outer momentum needs"):
            quality.parse_row(bad)


def test_sparse_is_judged_against_the_best_fp4_row_of_its_h() -> None:
    entries = [
        {**a, **b}
        for a, b in (
            entry("dp", 0, 0.0, 1_000_000),
            entry("fp4", 5, 0.30, 1000),  # the recipe's outer lr
            entry("fp4", 5, 0.05, 1000),  # an outer lr tuned at this H
            entry("sparse-2bit", 5, 0.15, 100),
        )
    ]
    entries[2]["name"] = "fp4 H=5 outer lr 0.35"
    lines = quality.check(entries)
    assert "FAIL  sparse-2bit H=5: 10.0x fewer bytes than fp4 H=5 outer lr 0.35 (>= 8x), " \
        "mean gap +10.00 pp vs its (<= +0.5 pp)" in lines  # fmt: skip


def test_a_codec_can_train_at_its_own_inner_lr(tmp_path, monkeypatch) -> None:
    seen = []

    def train(setup, variant, threads):
        assert threads == 3
        seen.append((variant.push_codec if variant.kind == "diloco" else "dp", setup.inner_lr))
        return fake_result(1.5, 600, 400)

    monkeypatch.setattr(quality_runs, "run_variant", train)
    monkeypatch.setattr(quality, "plot", lambda entries, out_dir: None)
    argv = ["quality.py", "--workers", "1", "--out", str(tmp_path), "--seeds", "0",
            "--threads", "3", "--dp-lr", "2.5e-4", "--inner-lr", "2.5e-4",
            "--codec-lr", "fp4=1.25e-4"]  # fmt: skip
    monkeypatch.setattr("sys.argv", argv)
    assert quality.main() == 0
    assert sorted(seen) == [("dp", 2.5e-4), ("fp4_e2m1", 1.25e-4), ("sparse_2bit", 2.5e-4)]
    assert json.loads((tmp_path / "quality.json").read_text())["codec_lr"] == {"fp4": 1.25e-4}
    for bad in ("fp3=1e-3", "fp4=0", "fp4", "fp4=x"):
        with pytest.raises(argparse.ArgumentTypeError, match="bad --codec-lr"):
            quality.parse_codec_lr(bad)


def test_each_run_gets_the_asked_cpu_threads(tmp_path, monkeypatch) -> None:
    threads_seen = []

    def train(setup, variant, threads):
        threads_seen.append(threads)
        return fake_result(1.0, 400, 400)

    monkeypatch.setattr(quality_runs, "run_variant", train)
    run_rows([Row("dp", seed=0), Row("dp", seed=1)], None, workers=1, threads=3)
    assert threads_seen == [3, 3]


def test_threads_and_workers_must_be_whole_numbers_of_at_least_one() -> None:
    parser = argparse.ArgumentParser()
    quality_runs.add_setup_args(parser)
    assert parser.parse_args(["--threads", "4"]).threads == 4
    assert parser.parse_args(["--workers", "3"]).workers == 3
    for option in ("--threads", "--workers"):
        with pytest.raises(SystemExit):  # argparse's one-line usage error
            parser.parse_args([option, "0"])
    for bad in ("0", "-2", "two"):
        with pytest.raises(argparse.ArgumentTypeError, match="whole number >= 1"):
            quality_runs.positive_int(bad)


def test_a_row_may_take_each_values_mean_over_its_senders() -> None:
    row = quality.parse_row("sparse-2bit:5:0.015625:1.25:inmodel,senders")
    assert row == Row("sparse-2bit", h=5, topk=0.015625, outer_lr=1.25, feedback_in_model=True,
                      sparse_mean="senders")  # fmt: skip
    assert row.method.endswith(" senders mean")
    assert row.variant().server == {"pull_topk_fraction": 1 / 32, "sparse_mean": "senders"}
    assert quality.parse_row("sparse-2bit:5:0.015625:1.25:senders,inmodel") == row
    alone = quality.parse_row("sparse-2bit:20:0.015625:1:senders")
    assert alone.sparse_mean == "senders" and not alone.feedback_in_model
    # Without it the run keeps the key of every run cached before the setting.
    assert "sparse_mean" not in replace(row, sparse_mean="learners").variant().server
    for bad in ("sparse-2bit:5:0.015625:1:median", "sparse-2bit:5:0.015625:1:senders,senders"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected codec:H"):
            quality.parse_row(bad)
