"""A safetensors file written from one page-aligned image: safetensors reads back every dtype a
snapshot holds, bit for bit, with the CRCs of the bytes written; a filesystem that refuses
O_DIRECT gets the same bytes through the page cache, said once."""

from __future__ import annotations

import errno
import logging
import os

import pytest
import torch
from safetensors import safe_open

import common.direct_io as direct_io
from common.checksum import crc32
from common.direct_io import PAGE, PagePool
from common.tensor_file import TensorFileImage
from tests.support.direct_io_faults import refuse_at_open, refuse_at_write

TENSORS = {
    "params": torch.randn(33, 17),
    "momentum": torch.randn(5, 3).to(torch.bfloat16),
    "half": torch.randn(7).to(torch.float16),
    "steps": torch.arange(5, dtype=torch.int64),
    "empty": torch.zeros(0, 4),
    "scalar": torch.tensor(2.5),
    "strided": torch.randn(6, 4).t(),  # not contiguous: written as its logical values
}


def written(path, tensors) -> dict[str, dict]:
    image = TensorFileImage(tensors)
    try:
        image.write(path)
        return image.specs()
    finally:
        image.close()


def test_safetensors_reads_back_every_tensor_bit_for_bit(tmp_path) -> None:
    path = tmp_path / "f.safetensors"
    specs = written(path, TENSORS)
    with safe_open(path, framework="pt") as f:
        assert set(f.keys()) == set(TENSORS)
        for name, expected in TENSORS.items():
            got = f.get_tensor(name)
            assert got.dtype == expected.dtype and got.shape == expected.shape
            assert torch.equal(got, expected)
            raw = got.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            assert specs[name] == {
                "dtype": str(expected.dtype).removeprefix("torch."),
                "shape": list(expected.shape),
                "crc32": crc32(raw),
            }
    header_len = int.from_bytes(path.read_bytes()[:8], "little")
    assert (8 + header_len) % PAGE == 0  # the data starts on a page boundary


def test_the_copy_is_taken_when_the_image_is_built(tmp_path) -> None:
    """A snapshot builds the image under the lock and writes it after: later changes to the
    tensors are not in the file."""
    t = torch.zeros(1000)
    image = TensorFileImage({"t": t})
    t.add_(1.0)
    image.write(tmp_path / "f.safetensors")
    image.close()
    with safe_open(tmp_path / "f.safetensors", framework="pt") as f:
        assert torch.equal(f.get_tensor("t"), torch.zeros(1000))


@pytest.mark.skipif(not direct_io.O_DIRECT, reason="O_DIRECT is Linux's")
def test_a_filesystem_without_o_direct_gets_the_same_bytes(tmp_path, monkeypatch, caplog) -> None:
    direct = tmp_path / "direct.safetensors"
    written(direct, TENSORS)
    refuse_at_open(monkeypatch)
    with caplog.at_level(logging.INFO, logger="common.direct_io"):
        for name in ("a.safetensors", "b.safetensors"):
            written(tmp_path / name, TENSORS)
    assert (tmp_path / "a.safetensors").read_bytes() == direct.read_bytes()
    assert caplog.text.count("takes no O_DIRECT writes") == 1


@pytest.mark.skipif(not direct_io.O_DIRECT, reason="O_DIRECT is Linux's")
def test_a_filesystem_that_refuses_o_direct_writes_gets_them_buffered(
    tmp_path, monkeypatch
) -> None:
    """Some mounts (FUSE, overlays) open with O_DIRECT and refuse the write itself."""
    refuse_at_write(monkeypatch)
    written(tmp_path / "f.safetensors", TENSORS)
    with safe_open(tmp_path / "f.safetensors", framework="pt") as f:
        assert torch.equal(f.get_tensor("params"), TENSORS["params"])
    assert direct_io._direct_refused == {os.stat(tmp_path).st_dev}


def test_a_dtype_safetensors_cannot_hold_is_refused_by_name() -> None:
    with pytest.raises(TypeError, match="tensor c: a snapshot cannot hold torch.complex64"):
        TensorFileImage({"c": torch.zeros(2, dtype=torch.complex64)})


def test_a_write_that_fails_raises_its_own_error_and_frees_the_image(tmp_path, monkeypatch):
    """ENOSPC half way: the caller sees ENOSPC, not a complaint that the image's memory is
    still in use when it is closed on the way out."""
    monkeypatch.setattr(direct_io, "WRITE_BLOCK", PAGE)
    real_write, calls = os.pwrite, []

    def fills_up(fd, data, offset):
        calls.append(len(data))
        if len(calls) == 2:
            del data  # as os.pwrite, which keeps no reference to what it was given
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data, offset)

    monkeypatch.setattr(direct_io.os, "pwrite", fills_up)
    image = TensorFileImage({"t": torch.randn(4 * PAGE)})
    with pytest.raises(OSError, match="No space left on device"):
        try:
            image.write(tmp_path / "f.safetensors")
        finally:
            image.close()  # as a snapshot does, while the error is on its way


def test_images_of_one_pool_reuse_its_buffers_and_give_each_back_once(tmp_path) -> None:
    """A writer of several images copies into pages already mapped: the second image of a
    pool takes the first's buffer, and a buffer closed twice is still given back once (two
    images sharing one buffer would corrupt each other)."""
    pool = PagePool()
    first = TensorFileImage({"t": torch.randn(3 * PAGE)}, pool)
    first_buffer = first._buffer
    first.write(tmp_path / "a.safetensors")
    first.close()
    first.close()
    second = TensorFileImage({"t": torch.randn(2 * PAGE)}, pool)
    third = TensorFileImage({"t": torch.randn(2 * PAGE)}, pool)
    try:
        assert second._buffer is first_buffer  # large enough: taken again
        assert third._buffer is not first_buffer  # given back once, so taken once
        expected = torch.randn(2 * PAGE)
        second.close()
        fourth = TensorFileImage({"t": expected}, pool)  # the same pages, new bytes
        fourth.write(tmp_path / "b.safetensors")
        fourth.close()
        with safe_open(tmp_path / "b.safetensors", "pt") as f:
            assert torch.equal(f.get_tensor("t"), expected)
    finally:
        third.close()
        pool.close()


def test_a_pool_hands_out_the_smallest_buffer_that_fits() -> None:
    """An update chain's staging (small) does not take a tensor image's buffer (large) while
    its own fits, so the next image's copy still finds pages already mapped."""
    pool = PagePool()
    small, large = pool.take(PAGE), pool.take(8 * PAGE)
    pool.give(large)
    pool.give(small)
    assert pool.take(PAGE // 2) is small
    assert pool.take(5 * PAGE) is large
    assert len(pool.take(9 * PAGE)) == 9 * PAGE  # none fits: a new one
    pool.close()


def test_a_pool_keeps_its_largest_buffers_up_to_its_bound_and_lends_them_while_idle() -> None:
    """Buffers beyond `keep` are unmapped as they come back, the smallest first; an idle
    pool's buffers, their pages lent back to the kernel, still take copies."""
    pool = PagePool(keep=2)
    buffers = [pool.take(n * PAGE) for n in (1, 3, 2)]
    for buffer in buffers:
        pool.give(buffer)
    assert buffers[0].closed and not buffers[1].closed and not buffers[2].closed
    pool.idle()
    again = pool.take(2 * PAGE)
    assert again is buffers[2]
    again[:5] = b"write"
    assert again[:5] == b"write"
    pool.give(again)
    pool.close()
    assert buffers[1].closed and buffers[2].closed
    one_use = PagePool(keep=0)
    buffer = one_use.take(PAGE)
    one_use.give(buffer)
    assert buffer.closed


def test_a_reserved_buffer_is_the_one_the_next_take_of_its_size_gets(monkeypatch) -> None:
    """reserve() maps the buffer (off the caller's lock), so the take() under it maps none;
    a free buffer large enough already is picked, not a second one mapped."""
    mapped = []
    real_mmap = direct_io.mmap.mmap

    def counting_mmap(*args, **kwargs):
        mapped.append(args[1])
        return real_mmap(*args, **kwargs)

    monkeypatch.setattr(direct_io.mmap, "mmap", counting_mmap)
    pool = PagePool()
    pool.reserve(3 * PAGE)
    assert mapped == [3 * PAGE]
    reserved = pool.take(3 * PAGE)
    assert mapped == [3 * PAGE]
    reserved[:] = b"\xff" * len(reserved)
    pool.give(reserved)
    pool.reserve(2 * PAGE)  # the 3-page buffer fits: nothing new; each page written
    assert pool.take(2 * PAGE) is reserved and mapped == [3 * PAGE]
    assert [reserved[i] for i in range(0, 3 * PAGE, PAGE)] == [0, 0, 0]
    pool.give(reserved)
    one_use = PagePool(keep=0)
    one_use.reserve(PAGE)  # keeps nothing free: nothing to map
    assert mapped == [3 * PAGE]
    image = TensorFileImage({"t": torch.arange(4096, dtype=torch.float32)}, pool)
    assert image.size == TensorFileImage.size_of({"t": torch.zeros(4096)})
    image.close()
    pool.close()


def test_a_kernel_that_refuses_lazy_free_leaves_the_pages_and_says_so_once(
    monkeypatch, caplog
) -> None:
    monkeypatch.setattr(direct_io, "_LAZY_FREE", 0x7FFF)  # an advice no kernel takes
    monkeypatch.setattr(direct_io, "_lazy_free_refused", [])
    pool = PagePool()
    buffer = pool.take(PAGE)
    buffer[:4] = b"kept"
    pool.give(buffer)
    with caplog.at_level(logging.WARNING, logger="common.direct_io"):
        pool.idle()
        pool.idle()
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == ["MADV_FREE refused"]
    assert pool.take(PAGE) is buffer and buffer[:4] == b"kept"
    pool.give(buffer)
    pool.close()
