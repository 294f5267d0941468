"""The shard map a learner's joins must agree on (docs/architecture.md, Sharding).

    check_shard(reply, shard, address, shard_count, first)  # or ShardMapError
    version = version_in(reply.fragments, fragment_id)

Every shard's join reply names its index, the shard count, the map id (a hash of the
fingerprint, P, layout and owners) and the mode; a learner joins a run only where each
shard it reaches agrees with the first one that answered, and says which shard does not.
"""

from __future__ import annotations

from collections.abc import Sequence

from common.generated.diloco.v1 import aggregator_pb2 as pb


class ShardMapError(ValueError):
    """The shards disagree with each other or with the learner's list of them."""


def check_shard(
    reply: pb.JoinResponse,
    shard: int,
    address: str,
    shard_count: int,
    first: pb.JoinResponse,
) -> None:
    """ShardMapError, naming the shard, unless its join reply says it is shard `shard` of
    `shard_count` with the map id and mode of `first` (the reply of the first shard that
    answered, already checked: its shard_index is its place in the list)."""
    where = f"shard {shard} at {address}"
    if reply.shard_count != shard_count:
        raise ShardMapError(
            f"{where} is one of {max(1, reply.shard_count)} shards, but --server lists "
            f"{shard_count}: list every shard of the run, in index order"
        )
    if reply.shard_index != shard:
        raise ShardMapError(f"{where} is shard {reply.shard_index}: list the shards in index order")
    if reply.map_id != first.map_id:
        raise ShardMapError(
            f"{where} has shard map {reply.map_id}, shard {first.shard_index} has {first.map_id}: "
            f"the shards disagree on the fingerprint, fragments, layout or shard count"
        )
    if reply.mode != first.mode:
        raise ShardMapError(
            f"{where} runs mode {reply.mode}, shard {first.shard_index} runs {first.mode}"
        )


def version_in(fragments: Sequence[pb.FragmentLayout], fragment_id: int) -> int:
    for fragment in fragments:
        if fragment.fragment_id == fragment_id:
            return fragment.version
    raise ShardMapError(f"fragment {fragment_id} is missing from its owner's layout")
