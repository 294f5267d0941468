"""The compiled FP4 kernel (common/fp4_kernel.c) for CPU tensors, built on first use.

    from common import fp4_native
    kernel = fp4_native.load()          # None where it cannot be built (and says why, once)

The pure-torch codec in common/codec.py makes about a dozen full-size temporaries per call and
runs at a few percent of memory bandwidth; the C kernel does one pass per block of 32 values.
Both give the same bytes and values (tests/unit/test_fp4_native.py checks bit-identity), so
the kernel is only a speed-up: CUDA tensors and stochastic rounding always take the torch path.

The shared library is compiled with the system C compiler (`$CC`, default `cc`) into
`$DILOCO_CACHE_DIR` (default `$XDG_CACHE_HOME/decoupled-diloco` or `~/.cache/...`), named by
a hash of the source and flags, and written atomically so concurrent processes can race to
build it. No compiler, or `DILOCO_FP4_KERNEL=torch`, means the torch path, logged once as a
warning with the reason. `DILOCO_FP4_KERNEL=native` makes a build failure an error instead.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("fp4_kernel.c")
# No -ffast-math and no FMA contraction: every multiply must round exactly as torch's does.
CFLAGS = ["-O3", "-std=c11", "-shared", "-fPIC", "-fno-fast-math", "-ffp-contract=off"]
CHOICES = ("auto", "native", "torch")

_lock = threading.Lock()
_loaded: dict[str, object] = {}


class Kernel:
    """ctypes bindings of fp4_quantize / fp4_dequantize, taking torch tensors."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        ptr, i64, f64, cint = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double, ctypes.c_int
        lib.fp4_quantize.argtypes = [ptr, i64, ptr, ptr, f64, cint, ptr, ptr]
        lib.fp4_quantize.restype = None
        lib.fp4_dequantize.argtypes = [ptr, ptr, i64, ptr, ptr]
        lib.fp4_dequantize.restype = i64
        self._lib = lib

    def quantize(
        self, flat: torch.Tensor, grid: torch.Tensor, mids: torch.Tensor, top_shift: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Packed codes and scale bytes of a contiguous 1-D float32 CPU tensor."""
        numel = flat.numel()
        packed = torch.empty((numel + 1) // 2, dtype=torch.uint8)
        scales = torch.empty((numel + 31) // 32, dtype=torch.uint8)
        self._lib.fp4_quantize(
            flat.data_ptr(),
            numel,
            grid.data_ptr(),
            mids.data_ptr(),
            float(grid[-1]),
            top_shift,
            packed.data_ptr(),
            scales.data_ptr(),
        )
        return packed, scales

    def dequantize(
        self, packed: torch.Tensor, scales: torch.Tensor, numel: int, grid: torch.Tensor
    ) -> tuple[torch.Tensor, int]:
        """(values, status): status -1 for a NaN scale byte, else the count of infinities."""
        out = torch.empty(numel, dtype=torch.float32)
        status = self._lib.fp4_dequantize(
            packed.data_ptr(), scales.data_ptr(), numel, grid.data_ptr(), out.data_ptr()
        )
        return out, int(status)


def choice() -> str:
    value = os.environ.get("DILOCO_FP4_KERNEL", "auto")
    if value not in CHOICES:
        raise ValueError(f"DILOCO_FP4_KERNEL must be one of {', '.join(CHOICES)}, got {value!r}")
    return value


def load() -> Kernel | None:
    """The kernel, built if needed; None (logged once) where the torch path must be used."""
    mode = choice()
    with _lock:
        if mode in _loaded:
            return _loaded[mode]  # type: ignore[return-value]
        kernel = None
        if mode == "torch":
            log.info("FP4 codec: pure-torch path (DILOCO_FP4_KERNEL=torch)")
        else:
            try:
                kernel = Kernel(ctypes.CDLL(str(_build())))
            except (OSError, subprocess.CalledProcessError, FileNotFoundError) as err:
                if mode == "native":
                    raise RuntimeError(f"cannot build the FP4 kernel: {err}") from err
                log.warning("FP4 codec: C kernel unavailable (%s); using the torch path", err)
        _loaded[mode] = kernel
        return kernel


def cache_dir() -> Path:
    if "DILOCO_CACHE_DIR" in os.environ:
        return Path(os.environ["DILOCO_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "decoupled-diloco"


def _build() -> Path:
    compiler = os.environ.get("CC", "cc")
    if shutil.which(compiler) is None:
        raise FileNotFoundError(f"no C compiler {compiler!r} on PATH")
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join([compiler, *CFLAGS]).encode()).hexdigest()[:16]
    target = cache_dir() / f"fp4_kernel-{platform.machine()}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so")
    os.close(fd)
    try:
        subprocess.run(
            [compiler, *CFLAGS, "-o", tmp, str(SOURCE), "-lm"],
            check=True,
            capture_output=True,
            timeout=120,
        )
        os.replace(tmp, target)  # atomic: a concurrent loader sees no half-written library
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("FP4 codec: built C kernel %s", target)
    return target
