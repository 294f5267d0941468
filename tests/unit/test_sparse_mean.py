"""server/sparse_mean.py: with sparse_mean "senders" a round's mean of sparse pushes is taken
value by value over the pushes that sent each value; dense pushes send every value."""

from __future__ import annotations

import pytest
import torch

from common.codec.fragment import decode_fragment, encode_fragment
from server.config import aggregator_config
from server.rounds.ingest import DenseBody, IngestSlot
from server.rounds.outer import NesterovOuter
from server.state.fragment import FragmentState
from tests.support.fakes import close_round

SHAPES = [(2, 3), (4,)]


def fragment(sparse_mean: str) -> FragmentState:
    """fp32 pulls and a plain step of lr 1: the parameters move by exactly minus the round's
    mean (a pseudo-gradient points from the new parameters to the old)."""
    outer = NesterovOuter(lr=1.0, momentum=0.0)
    state = FragmentState(0, [0, 1], SHAPES, outer, "fp32", 4, sparse_mean=sparse_mean)
    state.initialize([torch.zeros(s) for s in SHAPES])
    return state


def pushes() -> list[list[torch.Tensor]]:
    """Two learners' sparse pushes: value (0, 0) sent by both, (0, 1) and [0] by one each."""
    a = [torch.tensor([[2.0, 6.0, 0.0], [0.0, 0.0, 0.0]]), torch.tensor([4.0, 0, 0, 0])]
    b = [torch.tensor([[4.0, 0.0, 0.0], [0.0, 0.0, 0.0]]), torch.zeros(4)]
    return [a, b]


def step(state: FragmentState, bodies, expected_weight: float = 0.0) -> list[torch.Tensor]:
    for name, body in zip("ab", bodies, strict=True):
        state.round.add(name, body, tokens=1)
    close_round(state, expected_weight)
    return [p.clone() for p in state.params]


def test_each_value_moves_by_the_mean_of_the_pushes_that_sent_it() -> None:
    senders = step(fragment("senders"), [DenseBody(p, sparse=True) for p in pushes()])
    assert senders[0].tolist() == [[-3.0, -6.0, 0.0], [0.0, 0.0, 0.0]]
    assert senders[1].tolist() == [-4.0, 0.0, 0.0, 0.0]
    learners = step(fragment("learners"), [DenseBody(p, sparse=True) for p in pushes()])
    assert learners[0].tolist() == [[-3.0, -3.0, 0.0], [0.0, 0.0, 0.0]]  # the round's mean
    assert learners[1].tolist() == [-2.0, 0.0, 0.0, 0.0]


def test_a_partial_round_takes_a_partial_step() -> None:
    """Two pushes of a round expected to carry four: half of each value's senders' mean."""
    got = step(fragment("senders"), [DenseBody(p, sparse=True) for p in pushes()], 4.0)
    assert got[0].tolist() == [[-1.5, -3.0, 0.0], [0.0, 0.0, 0.0]]
    assert got[1].tolist() == [-2.0, 0.0, 0.0, 0.0]


def test_dense_pushes_send_every_value_so_the_mean_is_the_rounds() -> None:
    """A zero a dense push sends (fp4 rounds small values to zero) is still a value sent."""
    bodies = lambda: [DenseBody(p) for p in pushes()]  # noqa: E731
    senders, learners = step(fragment("senders"), bodies()), step(fragment("learners"), bodies())
    for s, m in zip(senders, learners, strict=True):
        assert torch.equal(s.view(torch.int32), m.view(torch.int32))


@pytest.mark.parametrize("codec", ["sparse_2bit"])
def test_a_push_read_from_its_wire_encoding_counts_the_same_values_as_decoded(codec) -> None:
    """The daemon reads the kept entries from the wire (PushBody), the simulator decodes the
    push (DenseBody): both count the nonzero kept values and give the same step bit for bit."""
    shapes = [(70, 130), (4096,)]
    gen = torch.Generator().manual_seed(3)
    data = [
        encode_fragment([torch.randn(s, generator=gen) for s in shapes], codec, sparse_k=64)
        for _ in range(2)
    ]
    slots = [IngestSlot(), IngestSlot()]
    wire = [slot.parse(d, shapes) for slot, d in zip(slots, data, strict=True)]
    dense = [DenseBody(decode_fragment(d, shapes), sparse=True) for d in data]
    for body, decoded in zip(wire, dense, strict=True):
        for w, d in zip(body.sent_positions(), decoded.sent_positions(), strict=True):
            assert w is not None and torch.equal(w, d)
    results = []
    for bodies in (wire, dense):
        outer = NesterovOuter(lr=1.0, momentum=0.0)
        state = FragmentState(0, [0, 1], shapes, outer, "fp32", 4, sparse_mean="senders")
        state.initialize([torch.zeros(s) for s in shapes])
        results.append(step(state, bodies))
    for w, d in zip(*results, strict=True):
        assert torch.equal(w.view(torch.int32), d.view(torch.int32))


def test_the_senders_weights_are_reused_from_round_to_round() -> None:
    state = fragment("senders")
    step(state, [DenseBody(p, sparse=True) for p in pushes()])
    kept = [t.data_ptr() for t in state.round.spare_senders]
    second = step(state, [DenseBody(p, sparse=True) for p in pushes()])
    assert [t.data_ptr() for t in state.round.senders or state.round.spare_senders] == kept
    assert second[0][0, 0] == -6.0  # counted afresh: (2 + 4) / 2 more


def test_dense_pushes_weigh_as_one_number_and_sparse_ones_per_value() -> None:
    """A round of dense pushes makes no buffer; a dense push in a round with a sparse one
    counts at every value."""
    dense_only = fragment("senders")
    dense_only.round.add("a", DenseBody(pushes()[0]), tokens=1)
    assert dense_only.round.senders is not None and dense_only.round.senders.values is None
    mixed = fragment("senders")
    got = step(mixed, [DenseBody(pushes()[0]), DenseBody(pushes()[1], sparse=True)])
    # (0, 0): both sent, (2 + 4) / 2; (0, 1): the dense push's 6 over both, the sparse push
    # sent no value there; [0]: only the dense push.
    assert got[0].tolist() == [[-3.0, -6.0, 0.0], [0.0, 0.0, 0.0]]
    assert got[1].tolist() == [-4.0, 0.0, 0.0, 0.0]


def test_the_setting_is_checked() -> None:
    with pytest.raises(ValueError, match="sparse_mean must be one of learners, senders"):
        aggregator_config(sparse_mean="median")
    with pytest.raises(ValueError, match="robust_merge merges with the trimmed mean instead"):
        aggregator_config(sparse_mean="senders", robust_merge="trimmed-mean")
    with pytest.raises(ValueError, match="untrusted_learners merges with the trimmed mean"):
        aggregator_config(
            sparse_mean="senders", untrusted_learners=True, mode="quorum", min_contributors=3
        )
    with pytest.raises(ValueError, match="sparse_mean senders is for sync and quorum modes"):
        aggregator_config(sparse_mean="senders", mode="async", outer_momentum_warmup_rounds=0)
    assert aggregator_config().outer.sparse_mean == "learners"


def test_no_outer_momentum_keeps_no_momentum_buffer() -> None:
    """The sparse codecs' step has no momentum: no buffer the size of the fragment, and the
    step is the plain one (torch's SGD keeps none either)."""
    outer = NesterovOuter(lr=0.5, momentum=0.0)
    params, grads = [torch.ones(3)], [torch.tensor([1.0, -2.0, 0.5])]
    outer.step(params, grads)
    outer.step(params, grads)
    assert outer.momentum_buffers is None
    assert params[0].tolist() == [0.0, 3.0, 0.5]  # 1 - 2 x 0.5 x g
    # A snapshot that holds a buffer for a step with no momentum: not kept.
    restored = NesterovOuter(momentum=0.0)
    restored.restore({"momentum": 0.0, "momentum_buffers": [torch.ones(3)]}, version=2)
    assert restored.momentum_buffers is None
