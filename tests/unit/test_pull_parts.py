"""Pull answers built from shared parts are byte-equal to protobuf's own serialization."""

from __future__ import annotations

import pytest
import torch

from common.codec import encode
from common.generated.diloco.v1 import aggregator_pb2 as pb
from common.wire import apply_updates, encode_fragment
from server.pull_parts import TensorBytes, chain_parts, snapshot_parts
from server.servicer import SMALL_PART_BYTES, _pieces


def joined(parts) -> bytes:
    return b"".join(bytes(p) if isinstance(p, TensorBytes) else p for p in parts)


@pytest.mark.parametrize(
    "shapes",
    [
        [(3, 5)],
        [(1024, 40), (7,), ()],  # multi-byte lengths, a 1-d and a 0-d tensor
        [(0, 4), (2, 3)],  # an empty tensor has no payload field at all
        [(1,)],
    ],
)
def test_snapshot_parts_equal_encode_fragment(shapes) -> None:
    torch.manual_seed(0)
    params = [torch.randn(shape) for shape in shapes]
    assert joined(snapshot_parts(params)) == encode_fragment(params, "fp32")
    assert b"".join(_pieces(snapshot_parts(params), 1000)) == encode_fragment(params, "fp32")


def test_snapshot_parts_read_the_parameters_in_place() -> None:
    params = [torch.randn(300, 100), torch.randn(50)]
    parts = snapshot_parts(params)
    big = [p for p in parts if len(p) >= SMALL_PART_BYTES]
    assert [len(p) for p in big] == [300 * 100 * 4]  # the 50-value tensor is small
    assert isinstance(big[0], TensorBytes)
    assert bytes(big[0]) == params[0].numpy().tobytes()
    params[0][0, 0] = 7.0  # no copy: a change shows ...
    assert big[0][:4] == params[0][0, :1].numpy().tobytes()
    big[0].freeze()  # ... until the owner freezes the part before changing the tensor
    params[0][0, 0] = 8.0
    assert big[0][:4] == torch.tensor([7.0]).numpy().tobytes()


def test_snapshot_parts_refuse_non_finite_values() -> None:
    with pytest.raises(ValueError, match="NaN or infinite"):
        snapshot_parts([torch.tensor([1.0, float("nan")])])


@pytest.mark.parametrize("have_version", [0, 5, 127, 128, 300_000])
def test_chain_parts_equal_fragment_updates(have_version: int) -> None:
    torch.manual_seed(1)
    updates = [
        pb.EncodedFragment(tensors=[encode(torch.randn(n) * 1e-3, "fp4_e2m1")])
        for n in (32, 70_000, 1000)
    ]
    logged = [u.SerializeToString() for u in updates]
    parts = chain_parts(have_version, logged)
    expected = pb.FragmentUpdates(from_version=have_version, updates=updates).SerializeToString()
    assert b"".join(parts) == expected
    assert any(part is logged[1] for part in parts)  # shared, not copied


def test_chain_parts_apply_like_a_serialized_chain() -> None:
    torch.manual_seed(2)
    deltas = [torch.randn(64) * 1e-2 for _ in range(3)]
    logged = [
        pb.EncodedFragment(tensors=[encode(d, "fp4_e2m1")]).SerializeToString() for d in deltas
    ]
    replica = [torch.zeros(64)]
    assert apply_updates(replica, b"".join(chain_parts(4, logged)), 4) == 7
    assert not torch.equal(replica[0], torch.zeros(64))


def test_pieces_keep_order_bound_size_and_do_not_copy_parts_that_fit() -> None:
    size = 1000
    big, fits = bytes(range(256)) * 10, b"y" * size  # 2560 bytes; exactly one piece
    parts = (b"a", b"bc", big, b"d", fits, b"e" * (SMALL_PART_BYTES - 1))
    pieces = list(_pieces(parts, size))
    assert b"".join(pieces) == b"".join(parts)
    assert all(0 < len(p) <= size for p in pieces)
    assert any(p is fits for p in pieces)
    assert pieces[0] == b"abc"  # small neighbours travel together
    assert list(_pieces((), size)) == []
    many_small = [b"z" * 300] * 10  # joined, but never past the size
    assert [len(p) for p in _pieces(tuple(many_small), size)] == [900, 900, 900, 300]
