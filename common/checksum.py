"""CRC32 of payloads and parameters: the zlib polynomial (as on the wire), at memory speed.

Every push is checked against its CRC32, every pulled replica is compared with the server's
by the CRC32 of its float32 bytes, and every logged update carries one. zlib's crc32 runs at
about 4 GB/s here, which made it about 15% of the time the server spends on a large push;
ISA-L's (the `isal` package, a binding of Intel's storage acceleration library) folds with
carry-less multiplication and runs about 12x faster, with the same values. Where no isal
wheel installs, zlib's is used and that is said once.
"""

from __future__ import annotations

import logging

try:
    from isal.isal_zlib import crc32
except ImportError as err:  # pragma: no cover - every supported platform has an isal wheel
    from zlib import crc32

    logging.getLogger("diloco").warning(
        "isal not importable (%s): CRC32 falls back to zlib's, about 12x slower", err
    )

__all__ = ["crc32"]
