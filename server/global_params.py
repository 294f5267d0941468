"""The model a run trains: its fingerprint, fixed by the first learner, and one FragmentState
per fragment of it (server/fragment.py), laid out by the streaming settings.

Not thread-safe on its own: the Aggregator calls it with its lock held.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from common.codec.sparse import topk_k
from common.errors import FailedPrecondition, InvalidArgument, NotFound
from common.fragments import layout_fragments
from server.config import ShardingConfig, StreamingConfig
from server.fragment import FragmentState
from server.outer import OuterOptimizer
from server.sharding import ShardMap

if TYPE_CHECKING:  # persistence imports ParamSpec from here
    from server.persistence import Restored

MAX_MODEL_VALUES = 1 << 40


@dataclass(frozen=True)
class ParamSpec:
    """Name, shape and dtype of one model parameter, as the learner reports it at Join."""

    name: str
    shape: tuple[int, ...]
    dtype: str


class GlobalParams:
    """The run's fingerprint and fragments; empty until the first learner joins. Every
    fragment of the layout is built, but only those this shard owns (server/sharding.py)
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
        self._sparse_mean = sparse_mean  # server/sparse_mean.py

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
        # Replayed in the snapshot's state dtype; kept in the configured one from now on.
        changed = [fragment.convert_state() for fragment in self.fragments]  # every one
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
            for f in self._owned_fragments()
        ]

    def layout(self) -> list[tuple[int, list[int], int]]:
        """(fragment_id, parameter indices, version) of every fragment."""
        return [(f.fragment_id, f.param_indices, f.version) for f in self.fragments]

    def owned_shapes(self) -> list[list[tuple[int, ...]]]:
        """The tensor shapes of each fragment this shard owns (none before a fingerprint)."""
        return [list(f.shapes) for f in self._owned_fragments()]

    def _owned_fragments(self) -> list[FragmentState]:
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
