"""Receiving a push's payload: its chunks as views, into a reused buffer, under a server-wide
memory budget.

    interceptors = (ChunkViews(), ...)      # PushFragment's chunks arrive as memoryviews
    budget = PushBudget(budget_bytes=256 << 20, wait_s=10.0)
    with budget.reserve(header.payload_bytes, gone) as buffer:   # waits, or ResourceExhausted
        view = receive_into(buffer, chunks)                        # one copy per chunk
        body = slot.parse(view, shapes)                            # views of `buffer`

Why: a push is buffered whole before it counts (its checksums and its norm are checked
before the round's sum is touched), and each push stream buffered what it had received so
far, so memory grew with the number of open push streams times the fragment size: a few
dozen half-sent pushes held hundreds of MB, and a push was copied three times on its way
(joined chunks, protobuf's parse, the tensors' bytes). Here a push's announced size is
reserved against the budget before a byte of its payload is read; past the budget a push
waits up to `wait_s` for room (while its sender is held by gRPC's flow control) and is then
refused with RESOURCE_EXHAUSTED and a retry hint. A reservation is returned when its push
ends, however it ends (accepted, refused or cancelled by its sender). A fragment's initial
values (fp32, once per fragment) larger than the whole budget are received alone: new pushes
wait while the ones in flight end, so push buffers hold at most the larger of the budget and
the largest fragment's fp32 bytes. Other pushes larger than the budget are refused.

By default (push_memory_budget_mb 0) the budget is sized to the fragments this shard owns once
the model is known (auto_budget_bytes): a fixed budget was half a model copy of a shard that
owns 512 MiB, and it refused every push of a fragment whose fp4 encoding did not fit it.

A push whose add is deferred (server/rounds/round.py) keeps its buffer past its call:
`hold` keeps it counted until the round adds it, and refuses once held buffers would take
more than half the budget, so pushes being received always have the other half; a push that
finds no room has the rounds add their deferred pushes at once (`drain`), and nothing more is
held while it waits.

Buffers are reused: the pool keeps up to `keep` released buffers (the sizes repeat: one per
fragment and codec), so a push does not fault in fresh pages for its payload every time; a
kept buffer serves pushes of half its size or more. A cancelled push's buffer is freed, as
is a fragment's initial (fp32) one, so that what a hostile sender made the server
touch goes back to the system.

Chunk views: protobuf's parse copies a message's bytes field, and reading the field copies it
again, so each chunk crossed memory three times before it reached the push's receive buffer:
0.7 ms per 8 MB push against 0.01 ms for views (bench/wire.py). ChunkViews gives
PushFragment the codec's parse_push_request (common/codec/framing.py) as its request
deserializer: a chunk message arrives as a view of the received bytes, anything else as
protobuf parses it.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import grpc
import numpy as np

from common.codec.fragment import max_fragment_bytes
from common.codec.framing import parse_push_request
from common.errors import InvalidArgument, ResourceExhausted
from common.generated.diloco.v1 import aggregator_pb2 as pb

# The automatic budget: a quarter of the owned fragments' float32 bytes within these bounds.
AUTO_MIN_BYTES, AUTO_MAX_BYTES = 64 << 20, 256 << 20
# A waiting push checks this often whether its caller went away.
_POLL_S = 0.25
# How long an initial push larger than the budget waits for the pushes in flight to end
# (new ones wait meanwhile); they end within the stream deadlines (stream_idle_timeout_s).
ALONE_WAIT_S = 60.0


def auto_budget_bytes(owned: Sequence[Sequence[tuple[int, ...]]]) -> int:
    """The push memory budget for a shard that owns fragments of these shapes: a quarter of
    their float32 bytes, between AUTO_MIN_BYTES and AUTO_MAX_BYTES, and at least two fp4
    pushes of the largest fragment, so that pushes in the default codec always fit."""
    fp32 = sum(max_fragment_bytes(shapes, pb.CODEC_FP32) for shapes in owned)
    largest_fp4 = max((max_fragment_bytes(s, pb.CODEC_FP4_E2M1) for s in owned), default=0)
    return max(min(max(fp32 // 4, AUTO_MIN_BYTES), AUTO_MAX_BYTES), 2 * largest_fp4)


class BudgetExhausted(ResourceExhausted):
    """No room in the push memory budget: worth a retry once other pushes are done."""


@dataclass
class _Reservation:
    """A buffer handed out by PushBudget.reserve, and whether it is held (PushBudget.hold)."""

    buffer: np.ndarray
    open: bool = True  # its `reserve` block has not ended
    held: bool = False
    released: bool = False


class PushBudget:
    """Bytes of push payloads the server may hold at once, and the buffers that hold them."""

    def __init__(
        self,
        budget_bytes: int | None,
        wait_s: float,
        keep: int = 4,
        drain: Callable[[], None] | None = None,
    ) -> None:
        """`budget_bytes` None: sized by `fit` (auto_budget_bytes) before the first push.
        `drain` gives every held buffer back now (the rounds add their deferred pushes); a
        push that finds no room calls it, so held buffers never keep a push waiting."""
        if budget_bytes is not None and budget_bytes < 1:
            raise ValueError(f"push memory budget must be >= 1 byte, got {budget_bytes}")
        self.budget_bytes, self.wait_s, self._keep = budget_bytes, wait_s, keep
        self._drain = drain
        self._waiting = 0  # pushes waiting for room: nothing more is held meanwhile
        self._cond = threading.Condition()
        self._reserved = 0  # bytes of buffers in use and of the ones kept for reuse
        self._free: list[np.ndarray] = []
        self._waiting_alone = 0  # initial pushes larger than the budget, waiting for room
        self._open: dict[int, _Reservation] = {}  # by id of the view, while its block runs
        self._held_bytes = 0  # of the buffers held past their block and not released
        self.refused = 0  # pushes refused for want of room (for metrics)

    def fit(self, owned_shapes: Callable[[], Sequence[Sequence[tuple[int, ...]]]]) -> None:
        """Size an automatic budget to the shard's fragments (their shapes, once the model
        is known); a given budget stays as it is."""
        if self.budget_bytes is not None:
            return
        size = auto_budget_bytes(owned_shapes())
        with self._cond:
            self.budget_bytes = size

    def reserved_bytes(self) -> int:
        with self._cond:
            return self._reserved

    @contextlib.contextmanager
    def reserve(
        self, size: int, gone: Callable[[], bool] = lambda: False, initial: bool = False
    ) -> Iterator[memoryview]:
        """A writable buffer of `size` bytes counted against the budget until the block
        ends; waits up to wait_s for room (less if `gone()` turns true), else raises
        BudgetExhausted. An `initial` push (a fragment's initial values: once per fragment)
        is a one-off, freed after; if it is larger than the whole budget it is received
        alone: new pushes wait while it waits (up to ALONE_WAIT_S) for the others to end.
        Any other push larger than the budget is refused at once."""
        if self.budget_bytes is None:
            raise RuntimeError("an automatic push memory budget must be fit() before use")
        alone = size > self.budget_bytes
        if alone and not initial:
            raise ResourceExhausted(
                f"push of {size} bytes exceeds the push memory budget of {self.budget_bytes} "
                "bytes (push_memory_budget_mb)"
            )
        buffer = self._take(size, gone, alone)
        view, ok = memoryview(buffer)[:size], False
        reservation = _Reservation(buffer)
        with self._cond:
            self._open[id(view)] = reservation
        try:
            yield view
            ok = not initial
        finally:
            with self._cond:
                del self._open[id(view)]
                reservation.open = False
                kept_held = reservation.held and not reservation.released
            if not kept_held:
                self._give_back(buffer, keep=ok)

    def hold(self, view: memoryview) -> Callable[[], None] | None:
        """Keep the buffer of an open reservation (its `view`) past the end of its block,
        still counted against the budget, until the returned release is called (a push
        whose add is deferred: server/rounds/round.py). None if the view is not an open
        reservation, if a push waits for room, or if held buffers would then take more than
        half the budget: the rest stays free for the pushes being received."""
        with self._cond:
            reservation = self._open.get(id(view))
            if reservation is None or reservation.held or self.budget_bytes is None:
                return None
            if self._waiting:  # a push waits for room: this one is added now instead
                return None
            if self._held_bytes + len(reservation.buffer) > self.budget_bytes // 2:
                return None
            reservation.held = True
            self._held_bytes += len(reservation.buffer)

        def release() -> None:
            with self._cond:
                if reservation.released:
                    return
                reservation.released = True
                self._held_bytes -= len(reservation.buffer)
                if reservation.open:  # its block gives it back when it ends
                    return
            self._give_back(reservation.buffer, keep=True)

        return release

    def held_bytes(self) -> int:
        with self._cond:
            return self._held_bytes

    def _take(self, size: int, gone: Callable[[], bool], alone: bool) -> np.ndarray:
        deadline = time.monotonic() + (max(self.wait_s, ALONE_WAIT_S) if alone else self.wait_s)
        drained = False
        with self._cond:
            self._waiting_alone += alone
            self._waiting += 1
            try:
                while True:
                    if alone or not self._waiting_alone:
                        buffer = self._fitting(size)
                        if buffer is not None:
                            return buffer
                    if self._held_bytes and self._drain is not None and not drained:
                        drained = True  # once per wait: the releases notify the others
                        self._cond.release()  # drain takes the aggregator's lock
                        try:
                            self._drain()
                        finally:
                            self._cond.acquire()
                        continue
                    drained = False
                    left = deadline - time.monotonic()
                    if left <= 0 or gone():
                        self.refused += 1
                        raise BudgetExhausted(
                            f"push memory budget of {self.budget_bytes} bytes is in use by "
                            f"other pushes; waited {self.wait_s:g} s (push_memory_budget_mb)"
                        )
                    self._cond.wait(min(left, _POLL_S))
            finally:
                self._waiting_alone -= alone
                self._waiting -= 1

    def _fitting(self, size: int) -> np.ndarray | None:
        """A buffer of at least `size` bytes if the budget has room for it now (a push larger
        than the budget has room when no other push holds any), else None."""
        # A kept buffer that fits without wasting more than half of itself.
        fits = [i for i, b in enumerate(self._free) if size <= len(b) <= 2 * size]
        if fits:
            return self._free.pop(min(fits, key=lambda i: len(self._free[i])))
        # Drop kept buffers (largest first) until a new one fits, if that is enough.
        in_use = self._reserved - sum(len(b) for b in self._free)
        if in_use + size > self.budget_bytes and in_use:
            return None
        self._free.sort(key=len)
        while self._free and self._reserved + size > self.budget_bytes:
            self._reserved -= len(self._free.pop())
        self._reserved += size
        # np.empty: pages are touched only as the payload arrives.
        return np.empty(size, dtype=np.uint8)

    def _give_back(self, buffer: np.ndarray, keep: bool) -> None:
        with self._cond:
            if keep and len(self._free) < self._keep:
                self._free.append(buffer)
            else:
                self._reserved -= len(buffer)
            self._cond.notify_all()


def receive_into(buffer: memoryview, pieces: Iterable[bytes | memoryview]) -> memoryview:
    """Copy the chunks into `buffer`, which must end exactly full; returns it. Raises
    InvalidArgument for a payload longer or shorter than the buffer (the announced size).

    The copy is ctypes.memmove, which releases the GIL (a slice assignment holds it): the
    other pushes' threads and gRPC's own run meanwhile."""
    if buffer.readonly:
        raise ValueError("receive_into needs a writable buffer")
    filled, size = 0, buffer.nbytes
    base = np.frombuffer(buffer, dtype=np.uint8).ctypes.data
    for piece in pieces:
        source = np.frombuffer(piece, dtype=np.uint8)
        end = filled + source.nbytes
        if end > size:
            raise InvalidArgument(f"payload is longer than the announced {size} bytes")
        ctypes.memmove(base + filled, source.ctypes.data, source.nbytes)
        filled = end
    if filled != size:
        raise InvalidArgument(f"payload ended after {filled} of the announced {size} bytes")
    return buffer


PUSH_METHOD = "/diloco.v1.Aggregator/PushFragment"


def wire_bytes(message: pb.PushFragmentRequest | memoryview) -> int:
    """The serialized size of a request as parse_push_request returned it."""
    if isinstance(message, memoryview):
        return len(message.obj)  # type: ignore[arg-type]  # the whole received message
    return message.ByteSize()


class ChunkViews(grpc.ServerInterceptor):
    """Gives PushFragment parse_push_request as its request deserializer."""

    def intercept_service(self, continuation: Callable, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method != PUSH_METHOD:
            return handler
        return grpc.stream_unary_rpc_method_handler(
            handler.stream_unary,
            request_deserializer=parse_push_request,
            response_serializer=handler.response_serializer,
        )
