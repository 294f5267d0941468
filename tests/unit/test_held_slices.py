"""An island's slices at the server (server/rounds/slices.py): held until the set is
complete, added as one push in the same float32 operations as the decoded whole, with the
whole's norm and, for sparse slices, the whole's sent positions."""

from __future__ import annotations

import math

import pytest
import torch

from common.codec.fragment import decode_fragment, encode_fragment
from common.codec.slices import SliceCut
from common.errors import InvalidArgument
from common.generated.diloco.v1 import aggregator_pb2 as pb
from server.rounds.ingest import DenseBody, IngestSlot
from server.rounds.slices import HeldSlices, SlicedBody, slice_cuts

SHAPES = [(7, 5), (3,), (40, 3)]


@pytest.mark.parametrize("codec", ["fp4_e2m1", "fp32", "sparse_2bit"])
def test_a_sliced_body_adds_as_its_decoded_slices_put_together(codec: str) -> None:
    torch.manual_seed(0)
    delta = [torch.randn(s) for s in SHAPES]
    cuts = slice_cuts(SHAPES, 3)
    payloads = [encode_fragment([c.of(d, i) for i, d in enumerate(delta)], codec) for c in cuts]
    slot = IngestSlot()
    body = SlicedBody(
        cuts, [slot.parse(memoryview(p), c.shapes) for p, c in zip(payloads, cuts, strict=True)]
    )
    decoded = [decode_fragment(p, c.shapes) for p, c in zip(payloads, cuts, strict=True)]
    whole = [torch.cat([d[i] for d in decoded]) for i in range(len(SHAPES))]
    assert body.shapes == SHAPES
    start = [torch.randn(s) for s in SHAPES]
    got = body.add_to([t.clone() for t in start], 0.3)
    want = DenseBody(whole).add_to([t.clone() for t in start], 0.3)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert all(
        torch.equal(a, b)
        for a, b in zip(body.add_to(None, 0.5), DenseBody(whole).add_to(None, 0.5), strict=True)
    )
    assert math.isclose(body.norm, math.sqrt(sum(float(w.double().square().sum()) for w in whole)))
    assert body.max_abs == max(float(w.abs().max()) for w in whole)
    for positions, w in zip(body.sent_positions(), whole, strict=True):
        if codec == "sparse_2bit":
            assert torch.equal(positions.sort().values, w.reshape(-1).nonzero().view(-1))
        else:
            assert positions is None


def header(index: int, count: int = 2, base: int = 0, tokens: int = 8, session: str = "s"):
    return pb.PushHeader(
        session_id=session, fragment_id=0, base_version=base, kind=pb.PUSH_KIND_DELTA,
        tokens=tokens, inner_steps=1, slice_index=index, slice_count=count,
    )  # fmt: skip


def test_held_slices_complete_replace_and_forget() -> None:
    held, live = HeldSlices(), lambda session: session != "gone"
    assert held.add(header(1), b"b", live) is None
    assert held.add(header(1), b"B", live) is None  # a retried slice replaces itself
    assert held.add(header(0), b"a", live) == [b"a", b"B"]
    assert held.held_bytes() == 0  # the completed set is forgotten
    assert held.add(header(0, base=0), b"old", live) is None
    assert held.add(header(1, base=1), b"new", live) is None  # a newer base replaces the set
    assert held.add(header(0, base=1), b"a", live) == [b"a", b"new"]
    assert held.add(header(0, session="gone"), b"x" * 100, live) is None
    held.add(header(0, session="other"), b"y", live)
    assert held.held_bytes() == 1  # the ended session's set went when the next slice came


def test_a_slice_whose_claim_differs_is_refused_and_changes_nothing() -> None:
    held, live = HeldSlices(), lambda session: True
    held.add(header(0, tokens=8), b"a", live)
    with pytest.raises(InvalidArgument, match="claims 9 tokens"):
        held.add(header(1, tokens=9), b"b", live)
    assert held.add(header(1, tokens=8), b"b", live) == [b"a", b"b"]


def test_every_slice_of_a_cut_is_its_own() -> None:
    cuts = slice_cuts(SHAPES, 4)
    assert [c.index for c in cuts] == [0, 1, 2, 3]
    assert all(isinstance(c, SliceCut) and c.count == 4 for c in cuts)
