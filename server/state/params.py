"""The model a run trains: its fingerprint, fixed by the first learner, one FragmentState per
fragment of it (fragment.py), laid out by the streaming settings, and which of the fragments
this shard owns.

    shard_map = ShardMap.build(shard_index, shard_count, fingerprint, groups, "strided")
    shard_map.check_owned(fragment_id)   # FailedPrecondition naming the owner otherwise

The aggregator can run as N shards. The fragment layout is computed from the fingerprint
(common/fragments.py), the same on every shard; ownership then spreads the fragments over the
N shards by bytes, greedily: fragments in decreasing size (ties: lower fragment id first),
each to the shard that owns the fewest bytes so far (ties: the lowest shard index). Every
shard and learner computes the same owners from the same fingerprint and settings; a
fragment's bytes are its float32 global parameters' (4 per value). The map id is a hash of
everything the map depends on (N, P, the layout's name and parameter groups, the owners and
the fingerprint), so two shards that answer with the same map id agree on all of it; a
learner refuses to train against shards that do not. A shard's state dir records N and the
shard's index (store.py's state identity); a server started on it with another N or index
is refused (check_state_dir_shard): the fragments it would own differ, and their state is in
other shards' dirs.

Not thread-safe on its own: the Aggregator calls it with its lock held.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from common.codec.sparse import topk_k
from common.codec.tensor import is_sparse
from common.config import address_list
from common.errors import FailedPrecondition, InvalidArgument, NotFound
from common.fragments import layout_fragments
from server.rounds.outer import OuterOptimizer
from server.state.fragment import FragmentState

log = logging.getLogger(__name__)

if TYPE_CHECKING:  # the store imports ParamSpec from here
    from server.config import StreamingConfig
    from server.state.formats import Restored

MAX_MODEL_VALUES = 1 << 40
FLOAT32_BYTES = 4


@dataclass(frozen=True)
class ParamSpec:
    """Name, shape and dtype of one model parameter, as the learner reports it at Join."""

    name: str
    shape: tuple[int, ...]
    dtype: str


class GlobalParams:
    """The run's fingerprint and fragments; empty until the first learner joins. Every
    fragment of the layout is built, but only those this shard owns (ShardMap, below)
    ever hold parameters: the others are refused by `fragment`."""

    def __init__(
        self,
        streaming: StreamingConfig,
        new_outer: Callable[[], OuterOptimizer],
        sharding: ShardingConfig,
        sparse_mean: str = "learners",
    ) -> None:
        self.fingerprint: list[ParamSpec] | None = None
        self.fragments: list[FragmentState] = []
        self.shard_map: ShardMap | None = None  # with the fingerprint
        self._streaming = streaming
        self._sharding = sharding
        self._new_outer = new_outer
        self._sparse_mean = sparse_mean  # rounds/round.py SenderWeights

    def adopt(self, fingerprint: list[ParamSpec]) -> None:
        """Fix the run's model at the first learner's; refuse a learner with another model."""
        if self.fingerprint is None:
            self.fragments = self._build(fingerprint)
            self.fingerprint = fingerprint
        elif fingerprint != self.fingerprint:
            raise FailedPrecondition(_fingerprint_mismatch(self.fingerprint, fingerprint))

    def restore(
        self, restored: Restored, before_replay: Callable[[FragmentState, int], None]
    ) -> bool:
        """Rebuild the fragments of a state dir's snapshot, then replay its log's outer
        steps, one record in memory at a time (`before_replay`: the round policy's); True
        if a fragment's state then changed dtype (FragmentState.convert_state)."""
        fragments = self._build(restored.fingerprint)
        for fragment, state in zip(fragments, restored.fragments, strict=True):
            fragment.load_state_dict(state)
        self.fingerprint, self.fragments = restored.fingerprint, fragments
        for record in restored.updates:
            fragment = self.fragments[record.fragment_id]
            before_replay(fragment, record.outer_every)
            fragment.apply_mean(record.mean)
        # Replayed in the snapshot's settings and state dtype; the configured ones from now on.
        for fragment in self.fragments:
            fragment.outer.adopt(self._new_outer())
        changed = [fragment.convert_state() for fragment in self.fragments]  # every one
        if any(changed):
            # Said out loud: from float32 the conversion loses precision for good (the next
            # snapshot is in the new dtype), and the default is bfloat16 in sync/quorum.
            log.warning(
                "outer state (momentum, pull residual) of the state dir converted to %s "
                "(outer_state_dtype); give --outer-state-dtype to keep another",
                self.fragments[0].outer.state_dtype,
            )
        return any(changed)

    def fragment(self, fragment_id: int) -> FragmentState:
        """A fragment this shard owns (FailedPrecondition naming the owner otherwise)."""
        if not 0 <= fragment_id < len(self.fragments):
            raise NotFound(f"fragment {fragment_id} does not exist")
        if self.shard_map is not None:
            self.shard_map.check_owned(fragment_id)
        return self.fragments[fragment_id]

    def has(self, fragment_id: int) -> bool:
        return 0 <= fragment_id < len(self.fragments)

    def version_of(self, fragment_id: int) -> int:
        """The fragment's version, or -2 (below any version) while it does not exist."""
        return self.fragments[fragment_id].version if self.has(fragment_id) else -2

    def owned(self, crc: bool = False) -> list[tuple[int, int, int]]:
        """(fragment_id, version, params CRC) of each fragment this shard owns; the CRC (as a
        pull reports it) only with `crc` and once the fragment has parameters, else 0."""
        return [
            (f.fragment_id, f.version, f.pull(f.version).params_crc32 if crc and f.params else 0)
            for f in self.owned_fragments()
        ]

    def layout(self) -> list[tuple[int, list[int], int]]:
        """(fragment_id, parameter indices, version) of every fragment."""
        return [(f.fragment_id, f.param_indices, f.version) for f in self.fragments]

    def owned_shapes(self) -> list[list[tuple[int, ...]]]:
        """The tensor shapes of each fragment this shard owns (none before a fingerprint)."""
        return [list(f.shapes) for f in self.owned_fragments()]

    def owned_fragments(self) -> list[FragmentState]:
        return [
            f
            for f in self.fragments
            if self.shard_map is None or self.shard_map.owns(f.fragment_id)
        ]

    def _build(self, specs: list[ParamSpec]) -> list[FragmentState]:
        cfg = self._streaming
        numels = [math.prod(spec.shape) for spec in specs]
        try:
            groups = layout_fragments([s.name for s in specs], numels, cfg.fragments, cfg.layout)
        except ValueError as err:  # the model does not fit the server's layout
            raise FailedPrecondition(str(err)) from err
        shards = self._sharding
        self.shard_map = ShardMap.build(
            shards.shard_index, shards.shard_count, specs, groups, cfg.layout
        )
        return [
            FragmentState(
                fragment_id=fid,
                param_indices=indices,
                shapes=[specs[i].shape for i in indices],
                outer=self._new_outer(),
                pull_codec=cfg.pull_codec,
                pull_sparse_k=topk_k(cfg.pull_topk_fraction),
                update_log_versions=cfg.update_log_versions,
                update_log_fraction=cfg.update_log_fraction,
                sparse_mean=self._sparse_mean,
            )
            for fid, indices in enumerate(groups)
        ]


def check_fingerprint(fingerprint: Sequence[ParamSpec]) -> list[ParamSpec]:
    """A Join's fingerprint, checked on its own (names, dimensions, size)."""
    if not fingerprint:
        raise InvalidArgument("fingerprint must list the model's parameters")
    specs = list(fingerprint)
    names = [s.name for s in specs]
    if len(set(names)) != len(names) or not all(names):
        raise InvalidArgument("fingerprint parameter names must be unique and non-empty")
    total = 0
    for spec in specs:
        if any(d < 0 for d in spec.shape):
            raise InvalidArgument(f"parameter {spec.name} has a negative dimension {spec.shape}")
        total += math.prod(spec.shape)
    if total > MAX_MODEL_VALUES:
        raise InvalidArgument(f"fingerprint declares {total} values, more than {MAX_MODEL_VALUES}")
    return specs


def _fingerprint_mismatch(expected: list[ParamSpec], got: list[ParamSpec]) -> str:
    if len(expected) != len(got):
        return f"model fingerprint has {len(got)} parameters, the run has {len(expected)}"
    for want, have in zip(expected, got, strict=True):
        if want != have:
            return f"model fingerprint differs at parameter {want.name}: run has {want}, got {have}"
    return "model fingerprint differs"


# ---- Shards ------------------------------------------------------------------------------


@dataclass(kw_only=True)
class ShardingConfig:
    """The aggregator as shard i of N: each owns some fragments (server/state/params.py)."""

    shard_index: int = 0
    """This server's index among the shards, from 0."""
    shard_count: int = 1
    """N, the number of shards the fragments are spread over (1: one server holds them all)."""
    shard_addresses: str = ""
    """host:port of every shard, in index order, comma-separated: the addresses learners
    given one shard's address discover (DescribeShards). Empty: learners must list them."""

    def __post_init__(self) -> None:
        if self.shard_count < 1:
            raise ValueError(f"shard_count must be >= 1, got {self.shard_count}")
        if not 0 <= self.shard_index < self.shard_count:
            raise ValueError(
                f"shard_index must be in [0, shard_count) = [0, {self.shard_count}), "
                f"got {self.shard_index}"
            )
        addresses = self.addresses()
        if addresses and len(addresses) != self.shard_count:
            raise ValueError(
                f"shard_addresses lists {len(addresses)} addresses; it must list all "
                f"{self.shard_count} shards, in index order"
            )

    def addresses(self) -> list[str]:
        return address_list(self.shard_addresses, "shard_addresses")


def fragment_owners(fragment_bytes: Sequence[int], shard_count: int) -> list[int]:
    """The owning shard of each fragment, balanced by bytes (the rule in the docstring)."""
    if shard_count < 1:
        raise ValueError(f"shard_count must be >= 1, got {shard_count}")
    owned = [0] * shard_count
    owners = [0] * len(fragment_bytes)
    for fid in sorted(range(len(fragment_bytes)), key=lambda f: (-fragment_bytes[f], f)):
        shard = min(range(shard_count), key=lambda s: (owned[s], s))
        owners[fid] = shard
        owned[shard] += fragment_bytes[fid]
    return owners


def fingerprint_hash(fingerprint: Sequence) -> str:
    """A short stable hash of a fingerprint's (name, shape, dtype) triples."""
    triples = [[p.name, list(p.shape), p.dtype] for p in fingerprint]
    return _hash(triples)


def map_id(
    shard_count: int,
    layout: str,
    groups: Sequence[Sequence[int]],
    owners: Sequence[int],
    fingerprint: Sequence,
) -> str:
    """The shard map's identity: equal on two shards only if they agree on all of it."""
    groups_list = [list(g) for g in groups]
    return _hash(
        [shard_count, len(groups_list), layout, groups_list, list(owners)]
        + [fingerprint_hash(fingerprint)]
    )


@dataclass(frozen=True)
class ShardMap:
    """Which shard this is and who owns each fragment of the run's layout."""

    shard_index: int
    shard_count: int
    owners: tuple[int, ...]  # owner shard of each fragment
    map_id: str
    fingerprint_hash: str

    @classmethod
    def build(
        cls,
        shard_index: int,
        shard_count: int,
        fingerprint: Sequence,
        groups: Sequence[Sequence[int]],
        layout: str,
    ) -> ShardMap:
        """The map for a fingerprint (ParamSpecs) laid out in `groups` (parameter indices)."""
        numels = [math.prod(p.shape) for p in fingerprint]
        sizes = [FLOAT32_BYTES * sum(numels[i] for i in group) for group in groups]
        owners = fragment_owners(sizes, shard_count)
        return cls(
            shard_index=shard_index,
            shard_count=shard_count,
            owners=tuple(owners),
            map_id=map_id(shard_count, layout, groups, owners, fingerprint),
            fingerprint_hash=fingerprint_hash(fingerprint),
        )

    def owns(self, fragment_id: int) -> bool:
        return self.owners[fragment_id] == self.shard_index

    def check_owned(self, fragment_id: int) -> None:
        """FailedPrecondition, naming the owner, for a fragment another shard owns."""
        if not self.owns(fragment_id):
            raise FailedPrecondition(
                f"fragment {fragment_id} is owned by shard {self.owners[fragment_id]} of "
                f"{self.shard_count}; this is shard {self.shard_index}: push and pull it there"
            )


def shard_identity(shard_index: int, shard_count: int) -> dict:
    """What a state dir records about its shard (nothing for one server: N = 1)."""
    if shard_count == 1:
        return {}
    return {"shard_index": shard_index, "shard_count": shard_count}


def check_state_identity(state_dir: str, recorded: dict, mine: dict) -> None:
    """Refuse a state dir written with other fixed settings (state identities `recorded`,
    `mine`), naming each, its value in the dir and here, and what to do."""
    check_state_dir_shard(state_dir, recorded, mine)
    differ = [k for k in sorted(recorded.keys() | mine.keys()) if recorded.get(k) != mine.get(k)]
    if differ:
        said = "; ".join(f"{k} {recorded.get(k)!r}, this server {mine.get(k)!r}" for k in differ)
        raise ValueError(
            f"state dir {state_dir} was written with other fixed settings ({said}): start "
            f"with the dir's values (flags, DILOCO_* or the config file), or write the model "
            f"out of it with diloco-export and start on a new state dir"
        )


def check_state_dir_shard(state_dir: str, recorded: dict, mine: dict) -> None:
    """Refuse a state dir written by another shard, or under another N, with what to do.
    `recorded`, `mine`: state identities (a single server's records no shard: 0 of 1)."""
    was, (shard_index, shard_count) = (
        (identity.get("shard_index", 0), identity.get("shard_count", 1))
        for identity in (recorded, mine)
    )
    if was == (shard_index, shard_count):
        return
    raise ValueError(
        f"state dir {state_dir} belongs to shard {was[0]} of {was[1]}, and this server is "
        f"shard {shard_index} of {shard_count}: the shards own other fragments under another "
        f"count. Restart with --shard-count {was[1]} --shard-index {was[0]} on this dir, or "
        f"carry the model over: write it out of every shard's dir with diloco-export, start "
        f"the new shards on empty state dirs and the learners from that model"
    )


def _hash(value: object) -> str:
    return hashlib.sha256(json.dumps(value, separators=(",", ":")).encode()).hexdigest()[:16]


def state_identity(
    streaming: StreamingConfig, mode: str, sharding: ShardingConfig | None = None
) -> dict:
    """The settings a state dir is bound to: a dir written with others is refused, since its
    fragments, codec state and outer optimizer would not fit (a sparse pull codec's kept
    fraction too: replaying the log with another would not rebuild the served replicas; a
    shard's index and the shard count too)."""
    sharding = sharding or ShardingConfig()
    identity = {
        "fragments": streaming.fragments,
        "layout": streaming.layout,
        "mode": mode,
        "pull_codec": streaming.pull_codec,
        **shard_identity(sharding.shard_index, sharding.shard_count),
    }
    if is_sparse(streaming.pull_codec):
        identity["pull_topk_fraction"] = streaming.pull_topk_fraction
    return identity
