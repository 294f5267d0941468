"""common.checksum.crc32 is zlib's CRC32, value for value, on everything the code feeds it."""

import zlib

import numpy as np
import pytest

from common.checksum import crc32


@pytest.mark.parametrize("size", [0, 1, 7, 64, 4097, 1 << 20])
def test_same_values_as_zlib(size: int) -> None:
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    assert crc32(data) == zlib.crc32(data)
    assert crc32(data, 12345) == zlib.crc32(data, 12345)  # chained, as over several tensors


def test_reads_arrays_and_views_in_place() -> None:
    values = np.arange(1000, dtype=np.float32)
    assert crc32(values) == zlib.crc32(values)
    view = memoryview(values.view(np.uint8))[3:]
    assert crc32(view) == zlib.crc32(view)
