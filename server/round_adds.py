"""A round's additions to its sum, run outside the aggregator's lock in the order accepted.

    adds = OrderedAdds()
    with aggregator_lock:                     # the push is checked and counted
        ticket = adds.put(batch, round_sum)   # [(body, scale), ...]: ingest.add_in_turn
    adds.run()                                # after the lock: every batch queued so far
    ticket.check()                            # raises if this batch's add failed

Why: a round adds its deferred fp4 pushes together, one pass of a few milliseconds over a
large fragment's sum (server/fragment.py DEFERRED_PUSHES). Run under the aggregator's lock,
that pass held up every other push waiting to be counted, on every fragment: profiled with
four pushes in flight of 16 M values each (bench/ingest.py), a push waited 5.5 ms for the
lock on average and held it 3.8 ms, about half of the time it took. Here the pass runs after
the lock is released; pushes are counted meanwhile.

Order: batches are queued under the aggregator's lock, so in the order their pushes were
accepted, and one runner at a time takes them from the front, so the sum's float32 additions
happen in that order, as when each ran under the lock. Whatever reads the sum (the round's
close, server/fragment.py settle) calls run() first, under the aggregator's lock: it waits
for a pass in progress and adds what is left, so it reads a complete sum.

A batch's last push may not be deferred (its receive buffer goes back to the pool for reuse,
and its slot's scratch to the next push, when its call ends): its call returns only after
run(), which always leaves the queue empty, so that push is in the sum by then, whichever
caller's run() added it. An add that fails (a bug: the bytes were checked before the push was
counted) is recorded on its batch's ticket, so the error reaches that push's caller; the push
stays counted in its round without its values, as do the deferred pushes in its batch.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence

import torch

from server.ingest import DenseBody, PushBody, add_in_turn

Batch = Sequence[tuple[PushBody | DenseBody, float]]


class AddTicket:
    """One queued batch's outcome, for the push whose call queued it."""

    def __init__(self) -> None:
        self.error: BaseException | None = None

    def check(self) -> None:
        """Raise the batch's add failure, if it failed (call after OrderedAdds.run)."""
        if self.error is not None:
            raise RuntimeError(f"adding a push to its round failed: {self.error}") from self.error


class OrderedAdds:
    """Batches of pushes to add to a round's sum, first in, first added."""

    def __init__(self) -> None:
        self._running = threading.Lock()  # one runner at a time: the order holds
        self._queue: deque[tuple[Batch, list[torch.Tensor], AddTicket]] = deque()

    def put(self, batch: Batch, sums: list[torch.Tensor]) -> AddTicket:
        """Queue sums += scale·Δ for each (body, scale) of `batch`, after those queued before
        (called under the aggregator's lock, which orders the calls)."""
        ticket = AddTicket()
        self._queue.append((batch, sums, ticket))
        return ticket

    def run(self) -> None:
        """Add every queued batch, in order; returns once the queue is empty (a runner
        already at work finishes first). A failed add is recorded on its ticket and the
        batches behind it are still added."""
        with self._running:
            while self._queue:
                batch, sums, ticket = self._queue.popleft()
                try:
                    add_in_turn(batch, sums)  # gives the bodies' buffers back however it ends
                except Exception as err:  # noqa: BLE001 - its own push's caller raises it
                    ticket.error = err
