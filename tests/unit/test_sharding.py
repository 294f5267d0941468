"""The shard map: ownership balanced by bytes, a map id that names everything it depends on,
refusals naming the owner, and a state dir bound to its shard and N."""

from __future__ import annotations

import re

import pytest
import torch

from common.errors import FailedPrecondition
from server.aggregator import Aggregator
from server.config import aggregator_config
from server.main import parse_config
from server.state.params import ParamSpec, ShardMap, fragment_owners, map_id, state_identity

SPECS = [ParamSpec(f"blocks.{i}.w", (4 * (i + 1), 8), "float32") for i in range(4)]


def test_owners_are_greedy_by_bytes_with_ties_to_the_lower_id_and_index() -> None:
    # In order f1 (40), f4 (40, the tie to the lower id first), f2 (30), f3 (20), f0 (10):
    # f1 -> s0, f4 -> s1, f2 -> s2, f3 -> s2 (30 bytes, the fewest), f0 -> s0 (40 = 40:
    # the lower index).
    assert fragment_owners([10, 40, 30, 20, 40], 3) == [0, 0, 2, 2, 1]
    assert fragment_owners([5, 5, 5, 5], 2) == [0, 1, 0, 1]
    assert fragment_owners([7, 3, 9], 1) == [0, 0, 0]


def test_owners_balance_the_bytes() -> None:
    sizes = [1000 + 37 * (i * 7919 % 101) for i in range(64)]
    owners = fragment_owners(sizes, 4)
    loads = [sum(s for s, o in zip(sizes, owners, strict=True) if o == k) for k in range(4)]
    assert set(owners) == {0, 1, 2, 3}
    assert max(loads) - min(loads) <= max(sizes)  # greedy's bound: at most one fragment apart


def test_map_id_is_stable_and_changes_with_each_input() -> None:
    groups, owners = [[0, 2], [1, 3]], [0, 1]
    base = map_id(2, "strided", groups, owners, SPECS)
    assert base == map_id(2, "strided", [[0, 2], [1, 3]], [0, 1], list(SPECS))
    other_specs = [*SPECS[:3], ParamSpec("blocks.3.w", (16, 9), "float32")]
    assert (
        len(
            {
                base,
                map_id(3, "strided", groups, owners, SPECS),
                map_id(2, "balanced", groups, owners, SPECS),
                map_id(2, "strided", [[0, 1], [2, 3]], owners, SPECS),
                map_id(2, "strided", groups, [1, 0], SPECS),
                map_id(2, "strided", groups, owners, other_specs),
            }
        )
        == 6
    )


def shard(index: int, count: int = 2, **config) -> Aggregator:
    config = {"fragments": 4, "shard_index": index, "shard_count": count, **config}
    return Aggregator(aggregator_config(**config))


def test_every_shard_computes_the_same_map_and_owns_its_part() -> None:
    shards = [shard(i) for i in range(2)]
    maps = [s.join("l0", SPECS).shard_map for s in shards]
    assert maps[0].map_id == maps[1].map_id and maps[0].owners == maps[1].owners
    assert [m.shard_index for m in maps] == [0, 1]
    # Fragment f holds block f (strided, 4 blocks): sizes 4·8, 8·8, 12·8, 16·8 values.
    # f3 -> s0, f2 -> s1, f1 -> s1 (96 < 128), f0 -> s0 (128 < 160).
    assert maps[0].owners == (0, 1, 1, 0)
    assert maps[0] == ShardMap.build(0, 2, SPECS, [[0], [1], [2], [3]], "strided")


def test_a_shard_refuses_fragments_it_does_not_own_naming_the_owner() -> None:
    agg = shard(0)
    session = agg.join("l0", SPECS).session_id
    agg.initialize(session, 0, [torch.ones(4, 8)])  # owned by shard 0
    with pytest.raises(FailedPrecondition, match="fragment 1 is owned by shard 1 of 2"):
        agg.initialize(session, 1, [torch.ones(8, 8)])
    with pytest.raises(FailedPrecondition, match="owned by shard 1 of 2; this is shard 0"):
        agg.pull(session, 2, -1)
    with pytest.raises(FailedPrecondition, match="owned by shard 1"):
        agg.check_push(session, 2, 0)
    assert agg.version(0) == 0
    shard_map, owned = agg.owned()
    assert shard_map is not None and [(fid, v) for fid, v, _ in owned] == [(0, 0), (3, -1)]


def test_one_shard_is_the_plain_server() -> None:
    plain = aggregator_config(fragments=4)
    assert state_identity(plain.streaming, "sync", plain.sharding) == {
        "fragments": 4,
        "layout": "strided",
        "mode": "sync",
        "pull_codec": "fp4_e2m1",
    }
    agg = Aggregator(plain)
    assert agg.join("l0", SPECS).shard_map.owners == (0, 0, 0, 0)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"shard_index": 2, "shard_count": 2}, "shard_index must be in [0, shard_count)"),
        ({"shard_count": 0}, "shard_count must be >= 1"),
        ({"shard_count": 5}, "shard_count (5) must not exceed fragments (4)"),
        (
            {"shard_count": 2, "shard_addresses": "a:1"},
            "shard_addresses lists 1 addresses; it must list all 2 shards",
        ),
        (
            {"shard_count": 2, "shard_addresses": "a:1,b"},
            "shard_addresses must be host:port, got 'b'",
        ),
    ],
)
def test_bad_shard_settings_name_the_setting(settings: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        aggregator_config(fragments=4, **settings)


@pytest.mark.parametrize(("index", "count"), [(1, 2), (0, 3), (0, 1)])
def test_a_state_dir_refuses_another_shard_or_count(tmp_path, index, count) -> None:
    agg = shard(0, 2, state_dir=str(tmp_path))
    session = agg.join("l0", SPECS).session_id
    agg.initialize(session, 0, [torch.ones(4, 8)])
    agg.checkpoint()  # stopped: the dir is free for the next server
    with pytest.raises(ValueError) as refused:
        shard(index, count, state_dir=str(tmp_path))
    message = str(refused.value)
    assert f"belongs to shard 0 of 2, and this server is shard {index} of {count}" in message
    assert "--shard-count 2 --shard-index 0" in message and "diloco-export" in message
    restarted = shard(0, 2, state_dir=str(tmp_path))  # the same shard resumes
    assert restarted.version(0) == 0


def test_a_plain_state_dir_refuses_a_shard(tmp_path) -> None:
    agg = Aggregator(aggregator_config(fragments=4, state_dir=str(tmp_path)))
    agg.initialize(agg.join("l0", SPECS).session_id, 0, [torch.ones(4, 8)])
    agg.checkpoint()
    with pytest.raises(
        ValueError, match="belongs to shard 0 of 1, and this server is shard 0 of 2"
    ):
        shard(0, 2, state_dir=str(tmp_path))


def test_shard_settings_come_from_flags_the_environment_and_a_sharding_table(tmp_path) -> None:
    toml = tmp_path / "server.toml"
    toml.write_text("fragments = 4\n[sharding]\nshard_index = 1\nshard_count = 2\n")
    config = parse_config(["--config", str(toml), "--insecure"])
    assert (config.sharding.shard_index, config.sharding.shard_count) == (1, 2)
    environ = {"DILOCO_SHARD_COUNT": "4", "DILOCO_SHARD_INDEX": "3"}
    config = parse_config(["--config", str(toml), "--insecure"], environ)
    assert (config.sharding.shard_index, config.sharding.shard_count) == (3, 4)
    config = parse_config(["--config", str(toml), "--insecure", "--shard-index", "0"], environ)
    assert config.sharding.shard_index == 0
