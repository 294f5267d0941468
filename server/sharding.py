"""The aggregator as N shards: which shard owns which fragment, and the map's identity.

    shard_map = ShardMap.build(shard_index, shard_count, fingerprint, groups, "strided")
    shard_map.check_owned(fragment_id)   # FailedPrecondition naming the owner otherwise

The fragment layout is computed once from the fingerprint (common/fragments.py), the same on
every shard. Ownership then spreads the fragments over the N shards by bytes, greedily:
fragments in decreasing size (ties: lower fragment id first), each to the shard that owns
the fewest bytes so far (ties: the lowest shard index). Every shard and learner computes
the same owners from the same fingerprint and settings; a fragment's bytes are its float32
global parameters' (4 per value).

The map id is a hash of everything the map depends on (N, P, the layout's name and
parameter groups, the owners and the fingerprint), so two shards that answer with the same
map id agree on all of it; a learner refuses to train against shards that do not.

A shard's state dir records N and the shard's index (state_identity, server/persistence.py);
a server started on it with another N or index is refused (check_state_dir_shard): the
fragments it would own differ, and their state is in other shards' dirs.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

from common.errors import FailedPrecondition

FLOAT32_BYTES = 4


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
