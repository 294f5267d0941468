"""Slices of a fragment (common/codec/slices.py): the rows FSDP2 gives each rank, and update
chains cut to them whose values are the whole chain's, bit for bit."""

from __future__ import annotations

import pytest
import torch

from common.codec.fragment import UpdateEncoder, apply_updates
from common.codec.framing import chain_parts
from common.codec.slices import SliceCut, slice_rows
from common.codec.tensor import codec_id
from common.errors import InvalidArgument

# Rows that do not split evenly, a tensor smaller than the slice count, and row lengths
# whose slices start inside an fp4 block of 32 values.
SHAPES = [(7, 5), (3,), (2, 9), (64, 3), (33,)]


@pytest.mark.parametrize("rows", [1, 2, 3, 7, 64, 65])
@pytest.mark.parametrize("count", [1, 2, 3, 4, 8])
def test_slices_are_the_rows_torch_chunk_gives_each_rank(rows: int, count: int) -> None:
    chunks = torch.arange(rows).chunk(count)
    for index in range(count):
        start, stop = slice_rows(rows, index, count)
        want = chunks[index].tolist() if index < len(chunks) else []
        assert list(range(start, stop)) == want


def test_the_slices_of_a_fragment_partition_it() -> None:
    full = [torch.randn(shape) for shape in SHAPES]
    cuts = [SliceCut(SHAPES, i, 3) for i in range(3)]
    for t, tensor in enumerate(full):
        parts = [cut.of(tensor, t) for cut in cuts]
        assert [tuple(p.shape) for p in parts] == [cut.shapes[t] for cut in cuts]
        assert torch.equal(torch.cat(parts), tensor)
        assert all(p.is_contiguous() for p in parts)
    assert sum(cut.numel for cut in cuts) == sum(t.numel() for t in full)


def logged_update(values: list[torch.Tensor], codec: str) -> bytes:
    """An update as the server logs it (UpdateEncoder, a tensor at a time)."""
    encoder = UpdateEncoder(codec_id(codec), [tuple(v.shape) for v in values], 0)
    for i, v in enumerate(values):
        encoder.add(i, 0, v.reshape(-1).contiguous())
    return encoder.serialized()


@pytest.mark.parametrize("codec", ["fp4_e2m1", "fp4_e3m0"])
@pytest.mark.parametrize("count", [2, 3, 5])
def test_a_cut_chain_gives_each_slice_the_whole_chains_values(codec: str, count: int) -> None:
    torch.manual_seed(0)
    start = [torch.randn(shape) for shape in SHAPES]
    updates = [logged_update([torch.randn(s) for s in SHAPES], codec) for _ in range(3)]
    whole = [t.clone() for t in start]
    assert apply_updates(whole, b"".join(chain_parts(0, updates)), 0) == 3
    for index in range(count):
        cut = SliceCut(SHAPES, index, count)
        mine = [cut.of(t, i).clone() for i, t in enumerate(start)]
        chain = b"".join(chain_parts(0, [cut.update(u) for u in updates]))
        assert cut.apply_updates(mine, chain, 0) == 3
        for i, got in enumerate(mine):
            assert torch.equal(got, cut.of(whole[i], i))  # bit for bit


def test_a_cut_sends_at_most_a_block_more_at_each_edge() -> None:
    shapes = [(1000, 7)]
    update = logged_update([torch.randn(1000, 7)], "fp4_e2m1")
    cuts = [SliceCut(shapes, i, 4) for i in range(4)]
    sizes = [len(cut.update(update)) for cut in cuts]
    # 4 bits a value and a scale byte per 32 values; two blocks of 32 padding at most.
    assert sum(sizes) <= len(update) + 4 * (2 * (16 + 1) + 64)


def test_a_bad_cut_chain_changes_nothing() -> None:
    cut = SliceCut(SHAPES, 1, 2)
    mine = [torch.zeros(s) for s in cut.shapes]
    good = cut.update(logged_update([torch.randn(s) for s in SHAPES], "fp4_e2m1"))
    bad = cut.update(logged_update([torch.randn(s) for s in SHAPES], "fp4_e2m1"))[:-3]
    with pytest.raises(InvalidArgument):
        cut.apply_updates(mine, b"".join(chain_parts(0, [good, bad])), 0)
    assert all(not t.any() for t in mine)


def test_slices_that_do_not_exist_and_sparse_updates_are_refused() -> None:
    with pytest.raises(InvalidArgument, match="slice 2 of 2 does not exist"):
        SliceCut(SHAPES, 2, 2)
    with pytest.raises(InvalidArgument, match="0-dimensional"):
        SliceCut([()], 0, 2)
    with pytest.raises(InvalidArgument, match="pull_codec is fp32, fp4_e2m1 or fp4_e3m0"):
        SliceCut.check_codec(codec_id("sparse_2bit"))
