"""A round's mean taken value by value over the pushes that sent each value.

    senders = SenderWeights(shapes, spare=None)       # one per round
    senders.add(body.sent_positions(), weight)         # per push, under the aggregator's lock
    spare = senders.divide(round_sums, fullness)       # at the close (a sparse push came)

With top-k sparse pushes a learner sends 1 of every 64 values a round, so few values are
sent by more than one of a few learners. The plain weighted mean divides every value by the
whole round's weight, so a value one learner of K sent moves the model by 1/K of that
learner's step, and the outer lr must be large to make up for it; a value all K sent then
moves K times as far. `sparse_mean = "senders"` divides each value by the weight of the
pushes that sent it instead: each sent value moves by its senders' mean, whatever the others
chose to send (docs/RESULTS.md, "The round mean of sparse pushes"). A sparse push sends its
nonzero kept values, a dense push every value (a zero it sends counts).

A partial round (less than the weight a full round carries, quorum mode) still takes a
partial step: the per-value means are scaled by the round's weight over the full round's.
The senders' weights take one float32 copy of the fragment, kept from round to round. Sync
and quorum modes: in async mode every push is a round of its own.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

SPARSE_MEANS = ("learners", "senders")


class SenderWeights:
    """Per value of one round, Σ weight of the pushes that sent it.

    A dense push sends every value: its weight is kept as one number and the buffers, one
    float32 copy of the fragment, are made (or taken from the last round) at the round's
    first sparse push only; a round of dense pushes takes the plain mean.
    """

    def __init__(self, shapes: Sequence[tuple[int, ...]], spare: list[torch.Tensor] | None) -> None:
        self._shapes, self._spare = shapes, spare
        self.values: list[torch.Tensor] | None = None  # None until a sparse push
        self._dense = 0.0  # Σ weight of the dense pushes

    def add(self, positions: Sequence[torch.Tensor | None], weight: float) -> None:
        """Add a push's `weight` at the values it sent (`positions`: per tensor, the flat
        positions it sent, or None for all of them)."""
        if all(sent is None for sent in positions):
            self._dense += weight
            return
        if self.values is None:
            spare, self._spare = self._spare, None
            if spare is None:
                spare = [torch.empty(shape, dtype=torch.float32) for shape in self._shapes]
            self.values = [t.zero_() for t in spare]
        for total, sent in zip(self.values, positions, strict=True):
            flat = total.view(-1)
            if sent is None:
                flat.add_(weight)
            else:  # a tensor's positions are distinct: one add each
                flat[sent] += weight

    def divide(self, sums: list[torch.Tensor], fullness: float) -> list[torch.Tensor]:
        """Make `sums` (Σ weight·Δ, a round with a sparse push) each value's senders'
        weighted mean times `fullness` (the round's weight over a full round's, at most 1);
        a value nobody sent stays zero. Returns the buffers, free to reuse."""
        assert self.values is not None  # a round of dense pushes takes the plain mean
        for total, sent in zip(sums, self.values, strict=True):
            if self._dense:
                sent.add_(self._dense)
            total.div_(sent.masked_fill_(sent == 0, 1.0))
            if fullness != 1.0:
                total.mul_(fullness)
        return self.values
