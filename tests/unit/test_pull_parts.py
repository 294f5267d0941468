"""Snapshot pull answers built from shared parts are byte-equal to protobuf's own serialization
and read the parameters in place; pull streams cut them without copying what fits."""

from __future__ import annotations

import pytest
import torch

from common.codec.fragment import TensorBytes, encode_fragment, snapshot_parts
from server.rpc.servicer import SMALL_PART_BYTES, _pieces


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
