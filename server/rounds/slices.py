"""A sharded island's push: its ranks' slices, held until all have come, then one push.

    held = HeldSlices()
    version = push_slice(aggregator, held, header, shapes, cut, payload, slot)
    # None: the island's other slices are still due. Else all came, counted as one push:
    #   held.add(...) gave every slice's bytes in order, SlicedBody(cuts, their bodies)

An island whose ranks each hold a slice of the model (FSDP: learner/sliced.py) pushes a
fragment as `count` slice pushes, one per rank, all in the island's one session
(PushHeader.slice_index/slice_count; the cut is common/codec/slices.py's). The server counts
the island as one learner: its pseudo-gradient joins a round only when every slice is here,
as one push with one token claim, one weight and one place in the quorum. A slice is checked
when it arrives (so a bad one is refused on its own call) and its bytes are kept; a rank that
dies mid-push leaves an incomplete set, which never counts.

Bounds: a session holds at most one set per fragment (a slice for another base version,
slice count or kind replaces the set), each slice at most its own wire bytes, so an island
holds at most one push's bytes per fragment; the sets of sessions that have ended are
dropped whenever a slice arrives.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from common.codec.slices import SliceCut
from common.codec.tensor import decode_values, parse_fragment_view
from common.errors import InvalidArgument
from common.generated.diloco.v1 import aggregator_pb2 as pb
from server.rounds.ingest import IngestSlot, PushBody

if TYPE_CHECKING:  # the aggregator takes this module's bodies
    from server.aggregator import Aggregator


@dataclass
class _SliceSet:
    base_version: int
    count: int
    kind: int
    tokens: int
    inner_steps: int
    slices: dict[int, bytes] = field(default_factory=dict)


class HeldSlices:
    """The slices of islands' pushes that wait for the rest of their set."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sets: dict[tuple[str, int], _SliceSet] = {}

    def add(
        self, header: pb.PushHeader, payload: bytes, live: Callable[[str], bool]
    ) -> list[bytes] | None:
        """Keep a checked slice; returns every slice's bytes in index order when this one
        completes its set (which is then forgotten), else None. `live(session)`: whether a
        session still exists (the sets of the others are dropped). Raises InvalidArgument
        for a slice whose claim differs from its set's."""
        key = (header.session_id, header.fragment_id)
        with self._lock:
            for gone in [k for k in self._sets if not live(k[0])]:
                del self._sets[gone]
            held = self._sets.get(key)
            shape = (header.base_version, header.slice_count, header.kind)
            if held is None or (held.base_version, held.count, held.kind) != shape:
                held = _SliceSet(*shape, header.tokens, header.inner_steps)
                self._sets[key] = held
            if (header.tokens, header.inner_steps) != (held.tokens, held.inner_steps):
                raise InvalidArgument(
                    f"slice {header.slice_index} claims {header.tokens} tokens in "
                    f"{header.inner_steps} steps; the island's other slices claim "
                    f"{held.tokens} in {held.inner_steps}"
                )
            held.slices[header.slice_index] = payload  # a retried slice replaces itself
            if len(held.slices) < held.count:
                return None
            del self._sets[key]
            return [held.slices[i] for i in range(held.count)]

    def held_bytes(self) -> int:
        with self._lock:
            return sum(len(b) for s in self._sets.values() for b in s.slices.values())


def slice_cuts(shapes: Sequence[tuple[int, ...]], count: int) -> list[SliceCut]:
    return [SliceCut(shapes, index, count) for index in range(count)]


class SlicedBody:
    """One push made of its slices' checked bodies (rounds/ingest.py PushBody): the norm and
    largest magnitude of the whole, and adds that put each slice in its rows of the sums.
    Added in the call that completed it (never deferred: the slices' bytes are plain
    copies, and the bodies read through that call's ingest slot)."""

    def __init__(self, cuts: Sequence[SliceCut], bodies: Sequence[PushBody]) -> None:
        self._cuts, self._bodies = list(cuts), list(bodies)
        self.shapes = list(cuts[0].full_shapes)
        self.norm = math.sqrt(sum(b.norm * b.norm for b in bodies))
        self.max_abs = max(b.max_abs for b in bodies)

    def sent_positions(self) -> list[torch.Tensor | None]:
        """Per tensor, the flat positions sent (None: every value; round.SenderWeights)."""
        out: list[torch.Tensor | None] = []
        per_body = [b.sent_positions() for b in self._bodies]
        for i in range(len(self.shapes)):
            positions = [p[i] for p in per_body]
            if all(p is None for p in positions):
                out.append(None)
                continue
            out.append(
                torch.cat(
                    [
                        (torch.arange(stop - start) if p is None else p) + start
                        for p, (start, stop) in zip(
                            positions, (c.spans[i] for c in self._cuts), strict=True
                        )
                    ]
                )
            )
        return out

    def defer(self) -> bool:
        return False

    def combinable(self) -> bool:
        return False

    def release(self) -> None:
        """Nothing held past the call (the slices' bytes are the caller's)."""

    def add_to(
        self, sums: list[torch.Tensor] | None, scale: float, overwrite: bool = False
    ) -> list[torch.Tensor]:
        """PushBody.add_to over the whole: each slice into its rows (element-wise the same
        float32 operations as one body of the whole fragment)."""
        if sums is None:
            sums, overwrite = [torch.empty(s, dtype=torch.float32) for s in self.shapes], True
        for cut, body in zip(self._cuts, self._bodies, strict=True):
            rows = [cut.of(s, i) for i, s in enumerate(sums)]
            body.add_to(rows, scale, overwrite)
        return sums


def push_slice(
    aggregator: Aggregator,
    held: HeldSlices,
    header: pb.PushHeader,
    shapes: list[tuple[int, ...]],
    cut: SliceCut,
    payload: memoryview,
    slot: IngestSlot,
) -> int | None:
    """Check a slice push (its payload received into `payload`, `shapes` the fragment's)
    and hold it; when it completes its set, count the island's push (or initial values)
    whole and return its version, else None. Every value is checked on the slice's own call,
    so a bad slice is refused there and leaves its set as it was."""
    initial = header.kind == pb.PUSH_KIND_INITIAL
    if initial:
        for t in parse_fragment_view(payload, cut.shapes):
            decode_values(t)
    else:
        slot.parse(payload, cut.shapes)
    complete = held.add(header, bytes(payload), aggregator.has_session)
    if complete is None:
        return None
    cuts = slice_cuts(shapes, header.slice_count)
    sets = list(zip(cuts, complete, strict=True))
    if initial:
        decoded = [
            [decode_values(t) for t in parse_fragment_view(memoryview(b), c.shapes)]
            for c, b in sets
        ]
        tensors = [
            torch.cat([d[i].view(c.shapes[i]) for d, c in zip(decoded, cuts, strict=True)])
            for i in range(len(shapes))
        ]
        return aggregator.initialize(header.session_id, header.fragment_id, tensors)
    body = SlicedBody(cuts, [slot.parse(memoryview(b), c.shapes) for c, b in sets])
    return aggregator.push(
        header.session_id,
        header.fragment_id,
        header.base_version,
        body,
        tokens=header.tokens,
        inner_steps=header.inner_steps,
    )
