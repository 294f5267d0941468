"""A round's mean taken value by value over the pushes that sent each value.

    senders = add_senders(None, shapes, body.sent_positions(), weight)  # per push
    divide_by_senders(round_sums, senders, fullness)                     # at the close

With top-k sparse pushes a learner sends 1 of every 64 values a round, so few values are
sent by more than one of a few learners. The plain weighted mean divides every value by the
whole round's weight, so a value one learner of K sent moves the model by 1/K of that
learner's step, and the outer lr must be large to make up for it; a value all K sent then
moves K times as far.
`sparse_mean = "senders"` divides each value by the weight of the pushes that sent it
instead: each sent value moves by its senders' mean, whatever the others chose to send
(docs/RESULTS.md, "The round mean of sparse pushes"). A dense push sends every value.

A partial round (less than the weight a full round carries, quorum mode) still takes a
partial step: the per-value means are scaled by the round's weight over the full round's.
The senders' weights take one float32 copy of the fragment, kept from round to round.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

SPARSE_MEANS = ("learners", "senders")


def add_senders(
    senders: list[torch.Tensor] | None,
    shapes: Sequence[tuple[int, ...]],
    positions: Sequence[torch.Tensor | None],
    weight: float,
) -> list[torch.Tensor]:
    """Add `weight` at each value a push sent (`positions`: per tensor, the flat positions
    it sent, or None for all of them); `senders` None starts new zeroed tensors."""
    if senders is None:
        senders = [torch.zeros(shape, dtype=torch.float32) for shape in shapes]
    for total, sent in zip(senders, positions, strict=True):
        flat = total.view(-1)
        if sent is None:
            flat.add_(weight)
        else:  # a tensor's positions are distinct: one add each
            flat[sent] += weight
    return senders


def divide_by_senders(
    sums: list[torch.Tensor], senders: list[torch.Tensor], fullness: float
) -> None:
    """sums (Σ weight·Δ) become, value by value, their senders' weighted mean times
    `fullness` (the round's weight over a full round's, at most 1); a value nobody sent
    stays zero. `senders` is left as scratch."""
    for total, sent in zip(sums, senders, strict=True):
        total.div_(sent.masked_fill_(sent == 0, 1.0))
        if fullness != 1.0:
            total.mul_(fullness)
