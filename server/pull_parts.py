"""Snapshot pull answers as shared byte strings whose concatenation is the serialized message.

    parts = snapshot_parts(params)                  # == encode_fragment(params, "fp32")

A snapshot's big parts are TensorBytes: the parameters' bytes read in place, sliced (copied)
a pull chunk at a time, and copied whole only if the parameters change while a pull still
streams them (TensorBytes.freeze).

Why: the server answers every pull of a version with the same bytes. Serializing a whole
message per answer cost, for each snapshot, about four model-sized buffers (the tensors'
bytes, their copies inside the EncodedTensor messages, the merged EncodedFragment and its
serialization), and for each update chain one buffer of up to a snapshot's size per pull.
Those large short-lived buffers, made by many RPC threads at once, fragmented the glibc heap
until the server's RSS grew with the number of learners (bench/load.py, 4 MiB model: 0.7 GB
at 64 learners with about 0.16 GB of live heap). Here the big pieces (each tensor's float32
bytes, each logged update) are made once and shared; the framing around them is a few bytes
written by the wire format's writer (common/fragment_wire.py: tensor_parts, and chain_parts
for update chains). tests/unit/test_pull_parts.py holds the result byte-equal to protobuf's
own serialization.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from common.fragment_wire import Part, fragment_parts
from common.generated.diloco.v1 import aggregator_pb2 as pb

# Snapshot payloads smaller than this are copied.
COPY_BELOW_BYTES = 64 << 10
# Values checked for finiteness at a time (a bool temporary of this many bytes).
_FINITE_CHECK_VALUES = 1 << 20


def snapshot_parts(
    params: Sequence[torch.Tensor], lock: threading.Lock | None = None
) -> tuple[Part, ...]:
    """The serialized fp32 EncodedFragment of `params` (encode_fragment's bytes), in parts
    whose payloads are the parameters' own bytes, read in place (TensorBytes): no copy of
    the parameters is made unless they change while a pull still streams them. Raises
    ValueError for a non-finite value, as common.codec.encode does."""
    lock = lock or threading.Lock()
    tensors = ((pb.CODEC_FP32, tuple(t.shape), _payload(t, lock), b"") for t in params)
    return tuple(part for part in fragment_parts(tensors) if len(part))


def _payload(t: torch.Tensor, lock: threading.Lock) -> Part:
    """The tensor's bytes read in place, or a plain copy when small (servicer.py joins small
    parts with their framing anyway)."""
    payload = TensorBytes(t, lock)
    return bytes(payload) if len(payload) < COPY_BELOW_BYTES else payload


class TensorBytes:
    """The float32 bytes of a contiguous CPU tensor as a pull part, read in place.

    Slicing returns a copy of the slice (what a pull sends, PULL_CHUNK_BYTES at a time). The
    owner of the tensor calls `freeze()`, under `lock`, before it changes the tensor: a pull
    still streaming this part then reads a copy of the old bytes, so every pull answer is
    one version's bytes. Why: a snapshot held as bytes cost one model copy from the first
    pull of a version to the next version, and one per version still being streamed.
    """

    def __init__(self, tensor: torch.Tensor, lock: threading.Lock) -> None:
        flat = tensor.detach().reshape(-1)
        if (
            flat.dtype != torch.float32
            or flat.device.type != "cpu"
            or flat.data_ptr() != (tensor.data_ptr())
        ):
            raise ValueError("TensorBytes needs a contiguous float32 CPU tensor")
        for start in range(0, flat.numel(), _FINITE_CHECK_VALUES):
            if not bool(torch.isfinite(flat[start : start + _FINITE_CHECK_VALUES]).all()):
                raise ValueError("cannot encode a tensor with NaN or infinite values")
        self._view: memoryview | None = memoryview(flat.numpy()).cast("B")
        self._frozen: bytes | None = None
        self._lock = lock

    def __len__(self) -> int:
        return len(self._frozen) if self._view is None else self._view.nbytes

    def __getitem__(self, key: slice) -> bytes:
        with self._lock:
            if self._view is None:
                return self._frozen[key]
            return self._view[key].tobytes()

    def __bytes__(self) -> bytes:
        return self[:]

    def buffer(self) -> memoryview | bytes:
        """The bytes without a copy, for a checksum (call while the tensor cannot change)."""
        return self._frozen if self._view is None else self._view

    def freeze(self) -> None:
        """Keep a copy of the bytes, to serve after the tensor changes; call under the lock."""
        if self._view is not None:
            self._frozen, self._view = self._view.tobytes(), None
