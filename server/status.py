"""What a shard tells about itself: its place in the shard map (DescribeShards) and what it
sees now (Status, for `diloco-status`).

    pushes = PushLog()
    pushes.record(learner_id, fragment_id, round_version)     # each accepted push
    describe_shards(aggregator)          # -> pb.DescribeShardsResponse
    shard_status(aggregator, pushes)     # -> pb.StatusResponse
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from common.generated.diloco.v1 import aggregator_pb2 as pb
from server.aggregator import Aggregator


class PushLog:
    """Each learner's last accepted push since this process started; thread-safe."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._last: dict[str, tuple[int, int, float]] = {}  # learner -> (fragment, version, at)

    def record(self, learner_id: str, fragment_id: int, round_version: int) -> None:
        with self._lock:
            self._last[learner_id] = (fragment_id, round_version, self._clock())

    def last(self) -> dict[str, tuple[int, int, float]]:
        """learner -> (fragment, round version, seconds since the push)."""
        now = self._clock()
        with self._lock:
            return {lid: (fid, v, now - at) for lid, (fid, v, at) in self._last.items()}


def describe_shards(aggregator: Aggregator) -> pb.DescribeShardsResponse:
    """This shard's index, the count, the advertised addresses and (once a learner joined)
    the map id and owners."""
    sharding = aggregator.config.sharding
    shard_map, _ = aggregator.owned()
    response = pb.DescribeShardsResponse(
        shard_index=sharding.shard_index,
        shard_count=sharding.shard_count,
        addresses=sharding.addresses(),
        fragments=aggregator.config.streaming.fragments,
    )
    if shard_map is not None:
        response.map_id = shard_map.map_id
        response.fingerprint_hash = shard_map.fingerprint_hash
        response.fragment_owners.extend(shard_map.owners)
    return response


def shard_status(aggregator: Aggregator, pushes: PushLog) -> pb.StatusResponse:
    """Live learners, the owned fragments' versions, outer steps taken, last pushes."""
    sharding = aggregator.config.sharding
    shard_map, owned = aggregator.owned()
    fragments = [
        pb.FragmentStatus(
            fragment_id=fid, version=version, owner=sharding.shard_index, params_crc32=crc
        )
        for fid, version, crc in owned
    ]
    live = set(aggregator.live_learners())
    last = pushes.last()
    learners = []
    for learner_id in sorted(live | set(last)):
        fid, version, age_s = last.get(learner_id, (-1, -1, 0.0))
        learners.append(
            pb.LearnerStatus(
                learner_id=learner_id,
                live=learner_id in live,
                last_push_fragment=fid,
                last_push_version=version,
                last_push_age_s=age_s,
            )
        )
    return pb.StatusResponse(
        shard_index=sharding.shard_index,
        shard_count=sharding.shard_count,
        map_id=shard_map.map_id if shard_map is not None else "",
        mode=aggregator.config.rounds.mode,
        fragments=fragments,
        rounds_closed=sum(max(0, f.version) for f in fragments),
        learners=learners,
    )
