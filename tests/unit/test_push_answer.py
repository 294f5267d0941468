"""A push the aggregator has counted is answered as accepted, even if its session's lease
runs out before the answer is sent (the learner would otherwise rejoin and push again)."""

from __future__ import annotations

import torch

from common.codec.fragment import encode_fragment
from server.aggregator import Aggregator
from server.config import aggregator_config
from server.rpc.servicer import AggregatorServicer
from tests.support.fakes import FINGERPRINT, SHAPES, tensors
from tests.support.fuzz.world import FakeContext, push_messages


class LeaseRunsOutAfterPush(Aggregator):
    """An aggregator whose learner's lease runs out right after its push is counted."""

    def push(self, session_id: str, *args, **kwargs) -> int:
        version = super().push(session_id, *args, **kwargs)
        self.leave(session_id)
        return version


def test_a_counted_push_is_accepted_though_its_lease_ran_out() -> None:
    agg = LeaseRunsOutAfterPush(aggregator_config(mode="quorum", min_contributors=2))
    servicer = AggregatorServicer(agg)
    session = agg.join("a", FINGERPRINT).session_id
    agg.initialize(session, 0, tensors(0))
    delta = encode_fragment([torch.full(s, 1e-3) for s in SHAPES], "fp32")
    context = FakeContext()

    reply = servicer.PushFragment(iter(push_messages(session, 0, 0, delta)), context)

    assert reply.accepted and reply.round_version == 1
    assert context.aborted == []
    assert servicer.push_results.snapshot() == {"accepted": 1}
