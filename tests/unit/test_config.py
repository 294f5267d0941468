"""Settings from file, environment and flags: precedence, types, and one-line errors."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import pytest

from common.config import (
    add_config_flags,
    build_config,
    config_from_args,
    flat_values,
    sections,
    settings,
)
from learner.config import DilocoSyncConfig, LearnerConfig
from learner.main import parse_config as learner_config
from server.config import SPARSE_OUTER, SPARSE_PULL_TOPK_FRACTION, AggregatorConfig, ServerConfig
from server.main import parse_config as server_config


def build(argv: list[str], environ: dict[str, str]) -> ServerConfig:
    parser = argparse.ArgumentParser(prog="diloco-server")
    add_config_flags(parser, ServerConfig)
    environ = {"DILOCO_INSECURE": "1", **environ}  # TLS is tested in test_tls.py
    return config_from_args(parser, ServerConfig, parser.parse_args(argv), environ)


def test_defaults_then_file_then_environment_then_flags(tmp_path: Path) -> None:
    config_file = tmp_path / "server.toml"
    config_file.write_text('lease_s = 7\nfragments = 3\nmode = "quorum"\n')
    assert build([], {}).membership.lease_s == 10.0  # the default
    got = flat_values(build(["--config", str(config_file)], {}))
    assert (got["lease_s"], got["fragments"], got["mode"]) == (7.0, 3, "quorum")
    got = flat_values(
        build(["--config", str(config_file)], {"DILOCO_LEASE_S": "8", "DILOCO_FRAGMENTS": "2"})
    )
    assert (got["lease_s"], got["fragments"], got["mode"]) == (8.0, 2, "quorum")
    got = flat_values(
        build(["--config", str(config_file), "--lease-s", "9"], {"DILOCO_LEASE_S": "8"})
    )
    assert (got["lease_s"], got["fragments"]) == (9.0, 3)


def test_server_settings_may_sit_in_their_sections_tables(tmp_path: Path, capsys) -> None:
    config_file = tmp_path / "server.toml"
    config_file.write_text(
        'lease_s = 7\n[rounds]\nmode = "quorum"\n[streaming]\nfragments = 3\n'
        '[network]\nlisten = "0.0.0.0:1"\n'
    )
    got = build(["--config", str(config_file), "--max-staleness", "2"], {"DILOCO_OUTER_LR": "0.5"})
    assert (got.membership.lease_s, got.rounds.mode, got.streaming.fragments) == (7.0, "quorum", 3)
    assert (got.network.listen, got.rounds.max_staleness, got.outer.outer_lr) == (
        "0.0.0.0:1",
        2,
        0.5,
    )
    config_file.write_text("[outer]\nfragments = 2\n")
    with pytest.raises(SystemExit):
        build(["--config", str(config_file)], {})
    assert "fragments belongs in [streaming], not [outer]" in capsys.readouterr().err


def test_the_aggregator_config_is_the_server_config_without_the_service() -> None:
    server, aggregator = sections(ServerConfig), sections(AggregatorConfig)
    assert aggregator.items() <= server.items()
    assert set(server) - set(aggregator) == {"network", "limits", "observability"}
    config = build_config(AggregatorConfig, {"mode": "async", "fragments": 2})
    assert (config.rounds.weighting, config.streaming.fragments) == ("tokens_squared_per_step", 2)
    with pytest.raises(ValueError, match="async mode's Delayed Nesterov has no warm-up"):
        build_config(
            ServerConfig, {"insecure": True, "mode": "async", "outer_momentum_warmup_rounds": 3}
        )


@pytest.mark.parametrize(
    "toml, environ, message",
    [
        ("lease_ss = 5\n", {}, "unknown setting 'lease_ss' in "),
        ("outer_lrr = 0.5\n", {}, "server.toml; did you mean 'outer_lr'?"),
        ("[outer]\nouter_lrr = 0.5\n", {}, "in [outer] of "),
        ("lease-s = 5\n", {}, "did you mean 'lease_s'?"),
        ("[streeming]\nfragments = 2\n", {}, "server.toml; did you mean [streaming]?"),
        ("[zzz]\nfragments = 2\n", {}, "unknown section [zzz] in "),
        ('lease_s = "ten"\n', {}, "lease_s must be a number, got 'ten'"),
        ("fragments = 2.5\n", {}, "fragments must be an integer, got 2.5"),
        ("fragments = true\n", {}, "fragments must be an integer, got True"),
        ("lease_s = \n", {}, "is not valid TOML"),
        ("", {"DILOCO_FRAGMENTS": "many"}, "DILOCO_FRAGMENTS='many': fragments must be an integer"),
        ("", {"DILOCO_OUTER_LR": "abc"}, "DILOCO_OUTER_LR='abc': outer_lr must be a number"),
        ("", {"DILOCO_INSECURE": "maybe"}, "DILOCO_INSECURE='maybe': insecure must be true or"),
        ("", {"DILOCO_LEASE_S": "0"}, "DILOCO_LEASE_S='0': lease_s must be > 0, got 0.0"),
        ("lease_s = 0\n", {"DILOCO_FRAGMENTS": "2"}, ": error: lease_s must be > 0, got 0.0"),
        ("lease_s = -1\n", {}, "lease_s must be > 0, got -1.0"),
        ("stream_idle_timeout_s = 0\n", {}, "stream_min_bytes_per_s needs stream_idle_time"),
        ("max_concurrent_streams = 0\n", {}, "max_concurrent_streams must be >= 1"),
    ],
)
def test_bad_settings_exit_2_with_one_line(
    tmp_path: Path, capsys, toml: str, environ: dict, message: str
) -> None:
    config_file = tmp_path / "server.toml"
    config_file.write_text(toml)
    with pytest.raises(SystemExit) as exited:
        build(["--config", str(config_file)], environ)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("diloco-server: error: ")
    assert message in err


@pytest.mark.parametrize(
    ("parse", "argv", "message"),
    [
        (server_config, ["--lease-s", "abc"], "argument --lease-s: invalid float value: 'abc'"),
        (server_config, ["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        (server_config, ["--zzzz"], "unrecognized arguments: --zzzz (--help lists"),
        (server_config, ["--outer-lrr", "3"], "--outer-lrr 3; did you mean '--outer-lr'?"),
        (learner_config, ["--lerner-id=a"], "did you mean '--learner-id'?"),
        (learner_config, ["--sync-every-steps"], "expected one argument"),
    ],
)
def test_a_bad_flag_is_one_line_and_exit_2(capsys, parse, argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as exited:
        parse(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "(--help lists the options)" in err


def test_a_refused_value_names_the_variable_only_when_it_came_from_the_environment(
    capsys,
) -> None:
    with pytest.raises(SystemExit):
        build(["--lease-s", "0"], {"DILOCO_LEASE_S": "5"})  # the flag's value is refused
    err = capsys.readouterr().err
    assert "lease_s must be > 0" in err and "DILOCO_LEASE_S" not in err
    with pytest.raises(SystemExit):
        build([], {"DILOCO_OUTER_LR": "0.5", "DILOCO_LEASE_S": "0"})
    assert "DILOCO_LEASE_S='0': lease_s must be > 0" in capsys.readouterr().err


def test_missing_config_file(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit):
        build(["--config", str(tmp_path / "nope.toml")], {})
    assert "cannot read config file" in capsys.readouterr().err


@dataclasses.dataclass(kw_only=True)
class _Schedule:
    """How often to sync."""

    every_steps: int = 5
    """Steps between syncs."""

    def __post_init__(self) -> None:
        if self.every_steps < 1:
            raise ValueError(f"every_steps must be >= 1, got {self.every_steps}")


@dataclasses.dataclass(kw_only=True)
class _Link:
    """Where the server is."""

    address: str = "127.0.0.1:1"
    """host:port."""


@dataclasses.dataclass(kw_only=True)
class _Daemon:
    schedule: _Schedule = dataclasses.field(default_factory=_Schedule)
    link: _Link = dataclasses.field(default_factory=_Link)
    name: str = "d"
    """A top-level setting."""


def _nested(argv: list[str], environ: dict[str, str]) -> _Daemon:
    parser = argparse.ArgumentParser(prog="daemon")
    add_config_flags(parser, _Daemon)
    return config_from_args(parser, _Daemon, parser.parse_args(argv), environ)


def test_sections_take_flat_flags_env_and_toml_keys_or_tables(tmp_path: Path) -> None:
    flat = tmp_path / "flat.toml"
    flat.write_text('every_steps = 7\naddress = "h:2"\n')
    tables = tmp_path / "tables.toml"
    tables.write_text('name = "x"\n[schedule]\nevery_steps = 8\n[link]\naddress = "h:3"\n')
    assert _nested(["--config", str(flat)], {}).schedule.every_steps == 7
    got = _nested(["--config", str(tables)], {})
    assert (got.schedule.every_steps, got.link.address, got.name) == (8, "h:3", "x")
    got = _nested(["--config", str(tables), "--every-steps", "9"], {"DILOCO_ADDRESS": "h:4"})
    assert (got.schedule.every_steps, got.link.address) == (9, "h:4")
    assert build_config(_Daemon, {"every_steps": 3}).schedule.every_steps == 3
    assert flat_values(got) == {"every_steps": 9, "address": "h:4", "name": "x"}


@pytest.mark.parametrize(
    "toml, message",
    [
        ("[link]\nevery_steps = 3\n", "every_steps belongs in [schedule], not [link]"),
        ("[link]\nname = 'a'\n", "name belongs at the top, not in [link]"),
        ("[schedule]\nevery = 3\n", "unknown setting 'every' in [schedule] of "),
        ("[shedule]\nevery_steps = 3\n", "unknown section [shedule] in "),
        ("[shedule]\nevery_steps = 3\n", "bad.toml; did you mean [schedule]?"),
        ("[schedule]\nevery_steps = 0\n", "every_steps must be >= 1, got 0"),
    ],
)
def test_bad_section_settings_exit_2_with_one_line(
    tmp_path: Path, capsys, toml: str, message: str
) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(toml)
    with pytest.raises(SystemExit) as exited:
        _nested(["--config", str(path)], {})
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_build_config_names_an_unknown_setting() -> None:
    with pytest.raises(ValueError, match="unknown setting 'every' for _Daemon"):
        build_config(_Daemon, {"every": 1})


def _learner(argv: list[str], environ: dict[str, str]) -> LearnerConfig:
    parser = argparse.ArgumentParser(prog="diloco-learner")
    add_config_flags(parser, LearnerConfig)
    return config_from_args(parser, LearnerConfig, parser.parse_args(argv), environ)


def test_learner_settings_keep_their_flat_names_in_sections(tmp_path: Path) -> None:
    tables = tmp_path / "learner.toml"
    tables.write_text(
        'learner_id = "a"\ninsecure = true\n[sync]\nsync_every_steps = 8\n'
        "[model]\nn_layer = 3\n[simulation]\nslowdown = 2.0\n"
    )
    got = _learner(["--config", str(tables), "--batch-size", "4"], {"DILOCO_SEED": "5"})
    assert (got.connection.learner_id, got.connection.insecure) == ("a", True)
    assert (got.sync.sync_every_steps, got.model.n_layer, got.simulation.slowdown) == (8, 3, 2.0)
    assert (got.data.batch_size, got.training.seed) == (4, 5)
    flat = _learner(["--learner-id", "a", "--sync-every-steps", "8", "--n-layer", "3"], {})
    assert (flat.sync.sync_every_steps, flat.model.n_layer) == (8, 3)
    assert got.library().sync is got.sync  # the daemon's DilocoSync gets the same sections


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"overlap_steps": 50}, "overlap_steps must be in [0, sync_every_steps), got 50"),
        ({"push_codec": "fp8"}, "push_codec must be one of"),
        ({"server": "nohost"}, "server must be host:port, got 'nohost'"),
        ({"insecure": True, "tls_ca": "ca.pem"}, "insecure and tls_* settings exclude"),
        ({"n_embd": 30, "n_head": 4}, "n_embd (30) must be divisible by n_head (4)"),
        ({"eval_batches": 0}, "eval_batches must be >= 1, got 0"),
        ({"checkpoint_every_s": -1.0}, "checkpoint_every_s must be >= 0, got -1.0"),
        ({"metrics_listen": "9101"}, "metrics_listen must be host:port"),
        ({"slowdown": 0.5}, "slowdown must be >= 1, got 0.5"),
        ({"step_period_s": float("nan")}, "step_period_s must be >= 0 and finite, got nan"),
        ({"slowdown": 2.0, "step_period_s": 0.1}, "set slowdown or step_period_s, not both"),
        ({"batch_sizes": 4}, "unknown setting 'batch_sizes' for LearnerConfig; did you mean"),
    ],
)
def test_each_learner_section_names_the_setting_to_fix(settings: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        build_config(LearnerConfig, {"learner_id": "a", **settings})


def test_the_library_config_holds_only_the_connection_and_sync_sections() -> None:
    assert set(sections(DilocoSyncConfig)) == {"connection", "sync"}
    assert set(settings(DilocoSyncConfig)) < set(settings(LearnerConfig))
    assert "slowdown" not in settings(DilocoSyncConfig)
    with pytest.raises(ValueError, match="unknown setting 'batch_size' for DilocoSyncConfig"):
        build_config(DilocoSyncConfig, {"batch_size": 4})


def test_the_best_recipe_is_the_default_and_paper_restores_the_papers_settings() -> None:
    best = build_config(LearnerConfig, {}).sync
    assert (best.recipe, best.merge_alpha) == ("best", 0.05)
    paper = build_config(LearnerConfig, {"recipe": "paper"}).sync
    assert (paper.sync_every_steps, paper.merge_alpha, paper.push_codec) == (
        100,
        0.5,
        "fp4_e3m0",
    )
    mine = build_config(DilocoSyncConfig, {"recipe": "paper", "merge_alpha": 0.2}).sync
    assert (mine.merge_alpha, mine.sync_every_steps) == (0.2, 100)  # what is given wins
    assert build_config(AggregatorConfig, {}).outer.outer_momentum_warmup_rounds == 20
    assert build_config(AggregatorConfig, {"mode": "quorum"}).outer.outer_momentum_warmup_rounds
    for values in ({"recipe": "paper"}, {"mode": "async"}):
        assert build_config(AggregatorConfig, values).outer.outer_momentum_warmup_rounds == 0
    assert build_config(AggregatorConfig, {"recipe": "paper"}).streaming.pull_codec == "fp4_e3m0"
    assert build_config(AggregatorConfig, {"mode": "async"}).streaming.pull_codec == "fp4_e2m1"
    given = {"recipe": "paper", "outer_momentum_warmup_rounds": 5}
    assert build_config(ServerConfig, {**given, "insecure": True}).outer.recipe == "paper"
    assert build_config(AggregatorConfig, given).outer.outer_momentum_warmup_rounds == 5


def test_sparse_pulls_default_to_the_plain_outer_step_and_pushes_to_a_decayed_residual() -> None:
    sparse = build_config(AggregatorConfig, {"pull_codec": "sparse_2bit"})
    got = {name: getattr(sparse.outer, name) for name in SPARSE_OUTER}
    assert got == SPARSE_OUTER and SPARSE_OUTER["outer_momentum"] == 0
    assert sparse.streaming.pull_topk_fraction == SPARSE_PULL_TOPK_FRACTION == 1 / 32
    given = build_config(AggregatorConfig, {"pull_codec": "sparse_2bit", "outer_momentum": 0.5})
    assert (given.outer.outer_momentum, given.outer.outer_lr) == (0.5, SPARSE_OUTER["outer_lr"])
    paper = build_config(AggregatorConfig, {"recipe": "paper", "pull_codec": "sparse_2bit"})
    assert (paper.outer.outer_momentum, paper.outer.outer_lr) == (0.9, 0.7)  # DiLoCo's step
    dense = build_config(AggregatorConfig, {"pull_codec": "fp4_e2m1"}).outer
    assert (dense.outer_momentum, dense.outer_lr) == (0.9, 0.7)
    assert build_config(AggregatorConfig, {}).streaming.pull_topk_fraction == 1 / 64
    assert build_config(LearnerConfig, {}).sync.push_feedback_decay == 0.95
    assert not build_config(LearnerConfig, {}).sync.push_feedback_in_model
    assert not build_config(LearnerConfig, {"recipe": "paper"}).sync.push_feedback_in_model
    assert build_config(LearnerConfig, {"push_feedback_in_model": True}).sync.push_feedback_in_model
    with pytest.raises(ValueError, match="push_feedback_decay must be in \\[0, 1\\], got 1.5"):
        build_config(LearnerConfig, {"push_feedback_decay": 1.5})


def test_the_outer_state_is_bfloat16_by_default_only_where_that_was_measured() -> None:
    """Sync and quorum modes with dense pulls keep the outer state in bfloat16; async mode,
    sparse pulls and the paper recipe keep float32 (torch's SGD exactly); a given value wins,
    and bfloat16 given in async mode is still refused."""

    def dtype(**values: object) -> str:
        return build_config(AggregatorConfig, values).outer.outer_state_dtype

    assert dtype() == dtype(mode="quorum") == dtype(pull_codec="fp32") == "bfloat16"
    assert dtype(mode="async") == dtype(recipe="paper") == "float32"
    assert dtype(pull_codec="sparse_2bit") == "float32"
    assert dtype(recipe="paper", outer_state_dtype="bfloat16") == "bfloat16"
    assert dtype(outer_state_dtype="float32") == "float32"
    with pytest.raises(ValueError, match="outer_state_dtype bfloat16 is for sync and quorum"):
        dtype(mode="async", outer_state_dtype="bfloat16")


@pytest.mark.parametrize("cls", [LearnerConfig, AggregatorConfig])
def test_an_unknown_recipe_is_refused(cls: type) -> None:
    with pytest.raises(ValueError, match="recipe must be one of best, paper, got 'fast'"):
        build_config(cls, {"recipe": "fast"})
