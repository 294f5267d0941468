"""Settings across a restart on the same state dir: one that may change takes effect from the
next round, is logged and shown in Status; one the dir is bound to is refused, naming it."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from learner.status import format_shard
from server.aggregator import Aggregator
from server.config import RECORDED_SECTIONS, aggregator_config, restart_notes
from server.rpc.servicer import _shard_status
from server.state.params import ParamSpec

SPECS = [ParamSpec("w", (40,), "float32")]


def start(state_dir: Path | None, **config) -> tuple[Aggregator, str]:
    agg = Aggregator(aggregator_config(state_dir=str(state_dir or ""), **config))
    return agg, agg.join("l0", SPECS).session_id


def rounds(agg: Aggregator, session: str, seeds: range) -> None:
    if agg.version(0) < 0:
        agg.initialize(session, 0, [torch.ones(40)])
    for seed in seeds:
        g = torch.Generator().manual_seed(seed)
        pushed = [torch.randn(40, generator=g) * 0.01]
        version = agg.push(session, 0, agg.version(0), pushed, tokens=64, inner_steps=4)
        assert agg.wait_for_version(0, version, timeout_s=30) == version


def stop(agg: Aggregator) -> None:
    """As if killed: nothing more is written, and the dir is free."""
    assert agg.wait_for_snapshot(timeout_s=30)
    with agg._cond:
        agg._store.close()


def test_a_changed_outer_lr_steps_from_the_next_round_and_says_so(tmp_path, caplog) -> None:
    fast = {"pull_codec": "fp32", "outer_lr": 0.7, "snapshot_every_versions": 4}
    agg, s = start(tmp_path, **fast)
    reference, r = start(None, **fast)
    for server, session in ((agg, s), (reference, r)):
        rounds(server, session, range(6))  # a snapshot at 4, then 2 logged rounds
    stop(agg)
    slow = {**fast, "outer_lr": 0.1}
    with caplog.at_level(logging.WARNING, logger="server.config"):
        changed, s2 = start(tmp_path, **slow)
    assert "outer_lr 0.7 -> 0.1 from the rounds after versions [6]" in caplog.text
    assert torch.equal(changed.params(0)[0], reference.params(0)[0])  # replayed at 0.7
    reference._params.fragment(0).outer.lr = 0.1  # what the change means: 0.1 from round 7
    rounds(changed, s2, range(6, 9))
    rounds(reference, r, range(6, 9))
    assert torch.equal(changed.params(0)[0], reference.params(0)[0])
    assert changed.setting_changes == [("outer_lr", 0.7, 0.1)]
    status = _shard_status(changed)
    assert [(c.setting, json.loads(c.was), json.loads(c.now)) for c in status.setting_changes] == [
        ("outer_lr", 0.7, 0.1)
    ]
    assert "  setting outer_lr: 0.7 -> 0.1 since the restart" in format_shard("here", status)
    # The change was snapshotted at start: a later restart with 0.1 replays at 0.1 and has
    # nothing to say; one back at 0.7 says that.
    stop(changed)
    caplog.clear()
    again, _ = start(tmp_path, **slow)
    assert again.setting_changes == [] and "outer_lr" not in caplog.text
    assert torch.equal(again.params(0)[0], reference.params(0)[0])
    stop(again)
    back, _ = start(tmp_path, **fast)
    assert back.setting_changes == [("outer_lr", 0.1, 0.7)]


def test_round_and_guard_settings_may_change_and_are_listed(tmp_path) -> None:
    agg, s = start(tmp_path, mode="quorum", min_contributors=1, grace_min_s=0.5)
    rounds(agg, s, range(2))
    stop(agg)
    changed, _ = start(tmp_path, mode="quorum", min_contributors=2, grace_min_s=1.5)
    assert changed.setting_changes == [("min_contributors", 1, 2), ("grace_min_s", 0.5, 1.5)]
    assert changed.version(0) == 2
    assert changed.config.rounds.min_contributors == 2  # in force from the next round


@pytest.mark.parametrize(
    ("setting", "was", "now"),
    [
        ("pull_codec", "fp4_e2m1", "fp32"),
        ("layout", "balanced", "strided"),
        ("mode", "sync", "quorum"),
    ],
)
def test_a_setting_the_dir_is_bound_to_is_refused_naming_it(tmp_path, setting, was, now) -> None:
    agg, s = start(tmp_path, fragments=1, **{setting: was})
    rounds(agg, s, range(1))
    stop(agg)
    with pytest.raises(ValueError) as refused:
        start(tmp_path, fragments=1, **{setting: now})
    message = str(refused.value)
    assert f"{setting} {was!r}, this server {now!r}" in message
    assert "diloco-export" in message and "new state dir" in message
    start(tmp_path, fragments=1, **{setting: was})  # the dir was let go; its values work


def test_the_reference_says_which_settings_may_change_and_which_are_fixed() -> None:
    notes = restart_notes()
    assert notes["pull_codec"] == notes["fragments"] == "*Restart:* fixed by the state dir."
    assert "may change" in notes["outer_lr"] and "may change" in notes["min_contributors"]
    assert "listen" not in notes and "state_dir" not in notes  # not part of the state
    assert set(RECORDED_SECTIONS) == {"membership", "rounds", "outer", "streaming"}
    reference = Path("docs/configuration.md").read_text()
    assert "| `outer_lr` |" in reference and "*Restart:* may change" in reference
