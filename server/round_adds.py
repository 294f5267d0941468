"""A round's additions to its sum, run outside the aggregator's lock in the order accepted.

    adds = OrderedAdds()
    with aggregator_lock:              # the push is checked and counted
        adds.put(batch, round_sum)     # [(body, scale), ...], server/ingest.py add_in_turn
    adds.run()                         # after the lock: this batch and any queued before it

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

A batch's last push may not be deferred (its receive buffer is freed when its call ends):
its call returns only after run(), which leaves the queue empty, so that push is in the sum
by then, whichever caller's run() added it.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence

import torch

from server.ingest import DenseBody, PushBody, add_in_turn

Batch = Sequence[tuple[PushBody | DenseBody, float]]


class OrderedAdds:
    """Batches of pushes to add to a round's sum, first in, first added."""

    def __init__(self) -> None:
        self._running = threading.Lock()  # one runner at a time: the order holds
        self._queue: deque[tuple[Batch, list[torch.Tensor]]] = deque()

    def put(self, batch: Batch, sums: list[torch.Tensor]) -> None:
        """Queue sums += scale·Δ for each (body, scale) of `batch`, after those queued before
        (called under the aggregator's lock, which orders the calls)."""
        self._queue.append((batch, sums))

    def run(self) -> None:
        """Add every queued batch, in order; returns once the queue is empty (a runner
        already at work finishes first). A failed add raises here; the batches behind it
        stay queued for the next run."""
        with self._running:
            while self._queue:
                batch, sums = self._queue.popleft()
                add_in_turn(batch, sums)
