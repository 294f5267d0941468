"""The config files under deploy/config/ that the README's three-terminal example runs."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from common.config import flat_values
from learner.main import parse_config as learner_config
from server.main import parse_config as server_config

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "deploy" / "config"


@pytest.mark.parametrize("name", ["server", "learner"])
def test_the_files_are_plaintext_examples_for_one_machine(name: str) -> None:
    parse = server_config if name == "server" else learner_config
    values = flat_values(parse(["--config", str(CONFIGS / f"{name}.toml")]))
    assert values["insecure"] and values["metrics_listen"].startswith("127.0.0.1:")
    assert values[{"server": "listen", "learner": "server"}[name]].startswith("127.0.0.1:")


def test_the_server_file_parses_and_leaves_the_pull_codec_to_the_recipe() -> None:
    path = str(CONFIGS / "server.toml")
    best = server_config(["--config", path])
    assert (best.rounds.mode, best.streaming.fragments) == ("quorum", 2)
    assert best.streaming.pull_codec == "fp4_e2m1"
    # The file's comment: `recipe = "paper"` gives the papers' pulls, which a pull_codec
    # set in the file would override.
    assert server_config(["--config", path, "--recipe", "paper"]).streaming.pull_codec == (
        "fp4_e3m0"
    )


def test_the_server_file_keeps_its_state_outside_the_checkout() -> None:
    """The README runs it from the repository root: a relative state_dir would land there."""
    state_dir = Path(
        server_config(["--config", str(CONFIGS / "server.toml")]).persistence.state_dir
    )
    assert state_dir.is_absolute() and not state_dir.is_relative_to(REPO)
    assert f"state in `{state_dir}`" in (REPO / "README.md").read_text()


def test_the_learner_file_parses_to_the_defaults_it_spells_out() -> None:
    given = learner_config(["--config", str(CONFIGS / "learner.toml")]).sync
    default = learner_config(["--insecure"]).sync
    assert given == default


def test_every_commented_out_setting_parses_once_uncommented() -> None:
    """A `#   key = value` example line must be valid TOML when a user removes the '#'
    (server.toml's TLS lines; learner.toml has none of that form)."""
    examples = [
        line.lstrip("#").strip()
        for line in (CONFIGS / "server.toml").read_text().splitlines()
        if re.match(r"#\s+\w+ = ", line)
    ]
    assert examples  # the test reads something
    for example in examples:
        tomllib.loads(example)  # raises on two settings on one line, unquoted strings, ...
