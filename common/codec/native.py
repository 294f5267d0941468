"""The compiled FP4 kernel for CPU tensors, built on first use from fp4_kernel.c (quantize,
dequantize), fp4_stats.c and fp4_accumulate.c (the server's ingest passes); the same library
holds the sparse codecs' top-k selection (topk_kernel.c, sparse.py). The C sources lie beside
this module.

    from common.codec import native
    kernel = native.load()              # None where it cannot be built (and says why, once)

The pure-torch codec in fp4.py makes about a dozen full-size temporaries per call and
runs at a few percent of memory bandwidth; the C kernel does one pass per block of 32 values.
Both give the same bytes and values (tests/unit/test_fp4_native.py checks bit-identity), so
the kernel is only a speed-up: CUDA tensors and stochastic rounding always take the torch path.

The shared library is compiled with the system C compiler (`$CC`, default `cc`) into
`$DILOCO_CACHE_DIR` (default `$XDG_CACHE_HOME/decoupled-diloco` or `~/.cache/...`), named by
a hash of the sources and flags, and written atomically so concurrent processes can race to
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
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from common.atomic import atomic_path

log = logging.getLogger(__name__)

# fp4_accumulate's modes: how sum and weight * value combine (see fp4_accumulate.c).
ACC_SET, ACC_ADD_FMA, ACC_ADD_MUL = 0, 1, 2
# The instruction sets fp4_accumulate chooses from, narrowest first (Kernel.limit_isa).
ISA_PORTABLE, ISA_AVX2, ISA_AVX512 = 0, 1, 2

_HERE = Path(__file__).parent
SOURCES = [
    _HERE / name for name in ("fp4_kernel.c", "fp4_stats.c", "fp4_accumulate.c", "topk_kernel.c")
]
HEADERS = [_HERE / "fp4_blocks.h"]
# No -ffast-math and no FMA contraction: every multiply must round exactly as torch's does.
CFLAGS = ["-O3", "-std=c11", "-shared", "-fPIC", "-fno-fast-math", "-ffp-contract=off"]
CHOICES = ("auto", "native", "torch")

# Wire bytes the kernel reads in place: bytes, or a view of a receive buffer.
Buffer = bytes | bytearray | memoryview

_lock = threading.Lock()
_loaded: dict[str, object] = {}


class FP4Add(NamedTuple):
    """One push's part of Kernel.accumulate_many: out (mode)= weight * its decoded values."""

    payload: Buffer
    scales: Buffer
    grid: torch.Tensor  # float32, contiguous (fp4.FP4_GRIDS)
    weight: float
    mode: int


class Kernel:
    """ctypes bindings of fp4_quantize / fp4_dequantize, taking torch tensors."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        ptr, i64, f64, cint = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double, ctypes.c_int
        lib.fp4_quantize.argtypes = [ptr, i64, ptr, ptr, f64, cint, ptr, ptr]
        lib.fp4_quantize.restype = None
        lib.fp4_dequantize.argtypes = [ptr, ptr, i64, ptr, ptr]
        lib.fp4_dequantize.restype = i64
        # Wire bytes go in by address (_address): read in place, no copy.
        f32 = ctypes.c_float
        lib.fp4_stats.argtypes = [ptr, ptr, i64, ptr, ctypes.POINTER(f64), ctypes.POINTER(f32)]
        lib.fp4_stats.restype = i64
        lib.fp4_accumulate_many.argtypes = [i64, ptr, ptr, i64, ptr, ptr, ptr, ptr]
        lib.fp4_accumulate_many.restype = i64
        lib.fp4_widest_isa.argtypes = []
        lib.fp4_widest_isa.restype = cint
        lib.topk_select.argtypes = [ptr, i64, i64, i64, ptr]
        lib.topk_select.restype = None
        self._lib = lib
        self._add_mode: int | None = None
        self._add_mode_probed = False

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
        # The C code trusts the lengths: a short tensor would be read past its end.
        if packed.dtype != torch.uint8 or scales.dtype != torch.uint8:
            raise ValueError("dequantize needs uint8 packed codes and scale bytes")
        if packed.numel() < (numel + 1) // 2 or scales.numel() < (numel + 31) // 32:
            raise ValueError(
                f"{numel} values need {(numel + 1) // 2} packed and {(numel + 31) // 32} scale "
                f"bytes, got {packed.numel()} and {scales.numel()}"
            )
        out = torch.empty(numel, dtype=torch.float32)
        status = self._lib.fp4_dequantize(
            packed.data_ptr(), scales.data_ptr(), numel, grid.data_ptr(), out.data_ptr()
        )
        return out, int(status)

    def stats(
        self, payload: Buffer, scales: Buffer, numel: int, grid: torch.Tensor
    ) -> tuple[int, float, float]:
        """(status, sum of squares in float64, largest magnitude) of packed values, read in
        place; status as in `dequantize` (-1 NaN scale, else the count of infinities)."""
        _check_lengths(payload, scales, numel)
        squares, max_abs = ctypes.c_double(), ctypes.c_float()
        (codes, code_ptr), (scale_bytes, scale_ptr) = _address(payload), _address(scales)
        status = self._lib.fp4_stats(
            code_ptr, scale_ptr, numel, grid.data_ptr(), ctypes.byref(squares),
            ctypes.byref(max_abs),
        )  # fmt: skip
        del codes, scale_bytes  # kept alive across the call
        if status == -2:
            raise ValueError("fp4 grid squares are not whole 16-bit units of a power of two")
        return int(status), squares.value, max_abs.value

    def accumulate(
        self,
        payload: Buffer,
        scales: Buffer,
        numel: int,
        grid: torch.Tensor,
        weight: float,
        mode: int,
        out: torch.Tensor,
    ) -> int:
        """out (op)= weight * decoded values, in place (`mode` one of ACC_*); -1 (out
        untouched) for a NaN scale byte, else 0. `out` is a contiguous float32 CPU tensor."""
        return self.accumulate_many([FP4Add(payload, scales, grid, weight, mode)], numel, out)

    def accumulate_many(self, pushes: Sequence[FP4Add], numel: int, out: torch.Tensor) -> int:
        """`accumulate` of each push in turn, bit-identical, in one pass over `out` (the
        kernel adds them all to one cache-sized tile of it at a time); -1 (out untouched)
        if any has a NaN scale byte, else 0."""
        count, keep_alive = len(pushes), []
        codes, scales = (ctypes.c_void_p * count)(), (ctypes.c_void_p * count)()
        grids, weights = (ctypes.c_void_p * count)(), (ctypes.c_float * count)()
        modes = (ctypes.c_int * count)()
        for j, push in enumerate(pushes):
            _check_lengths(push.payload, push.scales, numel)
            if push.mode not in (ACC_SET, ACC_ADD_FMA, ACC_ADD_MUL):
                raise ValueError(f"unknown accumulate mode {push.mode}")
            (code_array, codes[j]), (scale_array, scales[j]) = (
                _address(push.payload),
                _address(push.scales),
            )
            keep_alive += [code_array, scale_array]
            grids[j], weights[j], modes[j] = push.grid.data_ptr(), push.weight, push.mode
        if out.dtype != torch.float32 or not out.is_contiguous() or out.numel() != numel:
            raise ValueError(f"accumulate needs a contiguous float32 tensor of {numel} values")
        status = self._lib.fp4_accumulate_many(
            count, codes, scales, numel, grids, weights, modes, out.data_ptr()
        )
        del keep_alive  # kept alive across the call
        return int(status)

    def topk_select(self, rows: torch.Tensor, k: int) -> torch.Tensor:
        """The sparse codec's kept indices (int64, (rows, k), ascending) of a contiguous 2-D
        float32 CPU tensor of finite values: the k largest magnitudes of each row, the lowest
        indices among equal ones (sparse.py's rule, bit-identical to its torch path)."""
        if rows.dtype != torch.float32 or rows.dim() != 2 or not rows.is_contiguous():
            raise ValueError("topk_select needs a contiguous 2-D float32 tensor")
        n, width = rows.shape
        if not 1 <= k <= width:
            raise ValueError(f"topk_select keeps 1..{width} values per row, got {k}")
        idx = torch.empty((n, k), dtype=torch.int64)
        self._lib.topk_select(rows.data_ptr(), n, width, k, idx.data_ptr())
        return idx

    def widest_isa(self) -> int:
        """The widest ISA_* this CPU runs (fp4_accumulate uses it unless limited)."""
        return int(self._lib.fp4_widest_isa())

    def limit_isa(self, isa: int) -> int:
        """Let fp4_accumulate use at most `isa` (ISA_*; by default the widest the CPU has),
        so that tests and benchmarks can check and time the narrower paths on a machine
        with the wider; returns the limit it replaces. Process-wide."""
        if isa not in (ISA_PORTABLE, ISA_AVX2, ISA_AVX512):
            raise ValueError(f"unknown instruction set limit {isa}")
        limit = ctypes.c_int.in_dll(self._lib, "fp4_isa_limit")
        previous, limit.value = limit.value, isa
        return previous

    def torch_add_mode(self) -> int | None:
        """The mode (ACC_ADD_FMA or ACC_ADD_MUL) whose bits equal torch's
        `sum.add_(values, alpha=weight)` in this process, or None when neither does.

        Torch's CPU add with alpha is one fused multiply-add where its kernels are built for
        AVX2/AVX512 and a multiply then an add in its baseline kernels
        (ATEN_CPU_CAPABILITY=default), so it is measured here once, not assumed."""
        if not self._add_mode_probed:
            self._add_mode = self._probe_add_mode()
            self._add_mode_probed = True
            if self._add_mode is None:
                log.warning("FP4 ingest: no kernel mode matches torch's add_; using torch")
        return self._add_mode

    def _probe_add_mode(self) -> int | None:
        gen = torch.Generator().manual_seed(7)
        numel = 4099  # vector bodies and a scalar tail in torch and here
        grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
        payload = torch.randint(0, 256, ((numel + 1) // 2,), generator=gen, dtype=torch.uint8)
        # Values of 0.03 .. 24 and sums of the same size: the two roundings often differ.
        scales = torch.randint(124, 130, ((numel + 31) // 32,), generator=gen, dtype=torch.uint8)
        payload_bytes, scale_bytes = payload.numpy().tobytes(), scales.numpy().tobytes()
        values, status = self.dequantize(payload, scales, numel, grid)
        if status:
            return None
        modes = {ACC_ADD_FMA, ACC_ADD_MUL}
        for weight in (0.3701, 1.0, 1 / 3, 2.5e-7, 7.77e5):
            start = torch.randn(numel, generator=gen) * 4.0 * weight
            expected = start.clone().add_(values, alpha=weight).view(torch.int32)
            for mode in list(modes):
                got = start.clone()
                self.accumulate(payload_bytes, scale_bytes, numel, grid, weight, mode, got)
                if not torch.equal(got.view(torch.int32), expected):
                    modes.discard(mode)
            scaled = torch.empty(numel)
            self.accumulate(payload_bytes, scale_bytes, numel, grid, weight, ACC_SET, scaled)
            if not torch.equal(
                scaled.view(torch.int32), values.clone().mul_(weight).view(torch.int32)
            ):
                return None
        return modes.pop() if len(modes) == 1 else None


def _address(data: Buffer) -> tuple[np.ndarray, int]:
    """A uint8 array over `data` (no copy) and the address of its first byte."""
    array = np.frombuffer(data, dtype=np.uint8)
    return array, array.ctypes.data


def _check_lengths(payload: Buffer, scales: Buffer, numel: int) -> None:
    """The C kernel trusts these lengths: a short buffer would be read past its end."""
    if len(payload) < (numel + 1) // 2 or len(scales) < (numel + 31) // 32:
        raise ValueError(
            f"{numel} fp4 values need {(numel + 1) // 2} payload and {(numel + 31) // 32} "
            f"scale bytes, got {len(payload)} and {len(scales)}"
        )


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
    """The kernel library: the cached build for these sources and flags, else built now."""
    compiler = os.environ.get("CC", "cc")
    source = b"".join(path.read_bytes() for path in [*SOURCES, *HEADERS])
    key = hashlib.sha256(source + " ".join([compiler, *CFLAGS]).encode()).hexdigest()[:16]
    target = cache_dir() / f"fp4_kernel-{platform.machine()}-{key}.so"
    if target.exists():  # e.g. built into an image that carries no compiler (deploy/Dockerfile)
        return target
    if shutil.which(compiler) is None:
        raise FileNotFoundError(f"no C compiler {compiler!r} on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(target) as tmp:  # a concurrent loader sees no half-written library
        subprocess.run(
            [compiler, *CFLAGS, "-o", str(tmp), *map(str, SOURCES), "-lm"],
            check=True,
            capture_output=True,
            timeout=120,
        )
    log.info("FP4 codec: built C kernel %s", target)
    return target
