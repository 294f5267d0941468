"""One fragment round: the pushes it took, their weighted sum, and the mean it closes with.

    rnd = Round(shapes, sparse_mean="learners")
    ticket = rnd.add(learner_id, body, tokens, weight, discount, add_later=True)  # under lock
    rnd.adds.run(); ticket.check()                 # after the lock (OrderedAdds, below)
    mean = rnd.mean(expected_weight, trim_fraction)  # at the close: in the sum's own buffers
    rnd = rnd.next()                               # the next round reuses those buffers

This module is the only code that changes a Round; the round policies (policy.py) read it
and decide when it closes, admission.py decides what a push weighs.

Memory stays O(fragment), whatever the learners: a push is decoded into the round's float32
sum a chunk at a time (ingest.py), and the sum's buffers are reused from round to round.
With robust_merge trimmed-mean a round also keeps each push's discounted Δ (one float32 copy
per push), which the trimmed mean replaces the weighted sum with at the close; with
sparse_mean senders it keeps the senders' weights, one more float32 copy (SenderWeights).

Adding outside the lock: a round may hold back up to DEFERRED_PUSHES accepted fp4 pushes (their
receive buffers held, within half the push budget: server/rpc/receive.py) and add them with
the next one in one pass over the sum (ingest.add_in_turn), bit-identical to adding each in
turn. That pass runs after the aggregator's lock is released (OrderedAdds): run under it, it
held up every other push waiting to be counted: profiled with four pushes in flight of 16 M
values each (bench/ingest.py), a push waited 5.5 ms for the lock on average and held it
3.8 ms, about half of the time it took. Batches are queued under the lock, so in acceptance
order, and one runner at a time takes them from the front, so the sum's float32 additions
happen in that order; whatever reads the sum (`mean`, `settle`) runs them first. A batch's
last push is never deferred: its call returns only after run(), which always leaves the
queue empty. An add that fails (a bug: the bytes were checked before the push was counted)
is recorded on its batch's ticket, so the error reaches that push's caller.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from server.rounds.ingest import DenseBody, PushBody, add_in_turn

# Accepted fp4 pushes a round may hold back to add with the next one in a single pass over
# its sum: a 16 M-value fragment's float32 sum is 64 MiB, which one add per push moves
# through memory each time.
DEFERRED_PUSHES = 3
SPARSE_MEANS = ("learners", "senders")
# Values of the trimmed mean made at a time (a (K, chunk) temporary, not K fragment copies).
_TRIM_CHUNK_VALUES = 1 << 17

Batch = Sequence[tuple[PushBody | DenseBody, float]]


@dataclass(eq=False)
class Round:
    """Contributions to a fragment's next version, summed so memory stays O(fragment)."""

    shapes: list[tuple[int, ...]]
    sparse_mean: str = "learners"  # SPARSE_MEANS: what `mean` divides by, value by value
    delta_sum: list[torch.Tensor] | None = None  # Σ weight·discount·Δ
    weight_sum: float = 0.0  # Σ weight (undiscounted: stale contributions shrink the step)
    contributors: set[str] = field(default_factory=set)
    weights: dict[str, float] = field(default_factory=dict)  # each contributor's weight
    # Learners whose push was refused (norm guard, token claim): the round does not wait for
    # them, and a round that ends with no accepted push takes no step (policy.py).
    excused: set[str] = field(default_factory=set)
    pushes: int = 0
    tokens: int = 0
    opened_at: float | None = None  # clock time of the round's first push
    quorum_since: float | None = None  # clock time it first had enough contributors
    # Σ weight·discount·max|Δ|: a bound on max|delta_sum|, so that a push that could
    # overflow the float32 sum is refused before it is added (admission.py).
    abs_bound: float = 0.0
    # trimmed-mean: each push's discounted Δ (else None).
    kept: list[list[torch.Tensor]] | None = None
    # Accepted pushes not yet in delta_sum (their weight, bound and counts are).
    deferred: list[tuple[PushBody, float]] = field(default_factory=list)
    adds: OrderedAdds = field(default_factory=lambda: OrderedAdds())
    senders: SenderWeights | None = None  # sparse_mean senders
    # The last round's buffers, reused: no fragment-sized allocation per round.
    spare_sum: list[torch.Tensor] | None = None
    spare_senders: list[torch.Tensor] | None = None

    def add(
        self,
        learner_id: str,
        body: PushBody | DenseBody,
        tokens: int,
        weight: float = 1.0,
        discount: float = 1.0,
        keep: bool = False,
        add_later: bool = False,
        now: float = 0.0,
    ) -> AddTicket | None:
        """Count a push of `weight` and add weight·discount·Δ to the sum (`discount`: the
        staleness discount and any clip). `keep`: also keep its discounted Δ (trimmed mean).
        A push that is neither the round's first nor deferred is added with the deferred
        ones; with `add_later` that add is queued on `adds` and its ticket returned, for the
        caller to run once it released the aggregator's lock, before the push's buffer is
        given back (see the module docstring). Otherwise None. `now`: the clock's time."""
        scale, ticket = weight * discount, None
        if keep:
            self.kept = (self.kept or []) + [body.add_to(None, discount)]
        if self.delta_sum is None and self.spare_sum is not None:
            self.delta_sum = body.add_to(self.spare_sum, scale, overwrite=True)
            self.spare_sum = None
        elif self.delta_sum is None:
            self.delta_sum = body.add_to(None, scale)
        elif len(self.deferred) < DEFERRED_PUSHES and not keep and body.defer():
            self.deferred.append((body, scale))
        else:  # emptied first: add_in_turn releases their buffers even if it fails
            pending, self.deferred = self.deferred, []
            ticket = self.adds.put([*pending, (body, scale)], self.delta_sum)
            if not add_later:
                self.adds.run()
                ticket.check()
                ticket = None
        if self.sparse_mean == "senders":
            self.senders = self.senders or SenderWeights(self.shapes, self.spare_senders)
            self.senders.add(body.sent_positions(), weight)
        self.abs_bound += scale * body.max_abs
        self.weight_sum += weight
        self.contributors.add(learner_id)
        self.weights[learner_id] = weight
        self.excused.discard(learner_id)
        self.pushes += 1
        self.tokens += tokens
        if self.opened_at is None:
            self.opened_at = now
        return ticket

    def excuse(self, learner_id: str) -> None:
        """The learner's push was refused: the round does not wait for it."""
        self.excused.add(learner_id)

    def forget(self, learner_id: str) -> None:
        """The learner left: its excuse goes (its accepted push stays in the round)."""
        self.excused.discard(learner_id)

    def reached_quorum(self, now: float) -> None:
        """Note the clock time the round first had enough contributors (quorum mode)."""
        if self.quorum_since is None:
            self.quorum_since = now

    def settle(self) -> None:
        """Add the queued and deferred pushes to the sum now, in acceptance order."""
        self.adds.run()
        if self.deferred:
            if self.delta_sum is None:
                raise RuntimeError("a round's first push is never deferred")
            pending, self.deferred = self.deferred, []  # as in add
            add_in_turn(pending, self.delta_sum)

    @property
    def largest_share(self) -> float:
        """The largest share of the round's weight one learner holds (after any cap)."""
        return max(self.weights.values()) / self.weight_sum if self.weight_sum > 0 else 0.0

    def cap_shares(self, max_share: float) -> None:
        """Hold each learner's weight to `max_share` of the round's (0: unbounded) before the
        close; only a trimmed mean's round can (its sum is made at the close, from `kept`)."""
        if max_share and self.kept is not None:
            self.weights = dict(
                zip(self.weights, share_capped(list(self.weights.values()), max_share), strict=True)
            )
            self.weight_sum = sum(self.weights.values())

    def mean(self, expected_weight: float = 0.0, trim_fraction: float = 0.0) -> list[torch.Tensor]:
        """The pseudo-gradient the outer step takes, made in the sum's own buffers.

        The sum is divided by the larger of the round's weight and `expected_weight` (what
        a full round would carry): a partial round takes a partial step. With kept pushes
        (trimmed-mean) the sum is first replaced by their trimmed mean times the round's
        weight; with sparse_mean senders each value is divided by its senders' weight
        instead, times the round's weight over that larger one."""
        self.settle()
        if self.delta_sum is None:
            raise RuntimeError("a round without pushes has no mean")
        if self.kept is not None:
            trim = trim_count(len(self.kept), trim_fraction)
            trimmed_mean_into(self.delta_sum, self.kept, trim, self.weight_sum)
            self.kept = None
        denominator = max(self.weight_sum, expected_weight)
        if self.senders is not None and self.senders.values is not None:
            self.spare_senders = self.senders.divide(self.delta_sum, self.weight_sum / denominator)
            return self.delta_sum
        return [acc.div_(denominator) for acc in self.delta_sum]

    def next(self) -> Round:
        """The fragment's next round, taking over this one's buffers (its mean, once the
        outer step has used it, becomes the next sum)."""
        spare = self.delta_sum if self.delta_sum is not None else self.spare_sum
        return Round(
            self.shapes, self.sparse_mean, spare_sum=spare, spare_senders=self.spare_senders
        )


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


class SenderWeights:
    """Per value of one round, Σ weight of the pushes that sent it (sparse_mean senders).

    With top-k sparse pushes a learner sends 1 of every 64 values a round, so few values are
    sent by more than one of a few learners. The plain weighted mean divides every value by
    the whole round's weight, so a value one learner of K sent moves the model by 1/K of that
    learner's step; "senders" divides each value by the weight of the pushes that sent it
    (docs/RESULTS.md, "The round mean of sparse pushes"). A sparse push sends its nonzero
    kept values, a dense push every value (its weight is kept as one number): the buffers,
    one float32 copy of the fragment, are made (or taken from the last round) at the
    round's first sparse push only, and a round of dense pushes takes the plain mean.
    """

    def __init__(self, shapes: Sequence[tuple[int, ...]], spare: list[torch.Tensor] | None) -> None:
        self._shapes, self.spare = shapes, spare
        self.values: list[torch.Tensor] | None = None  # None until a sparse push
        self._dense = 0.0  # Σ weight of the dense pushes

    def add(self, positions: Sequence[torch.Tensor | None], weight: float) -> None:
        """Add a push's `weight` at the values it sent (`positions`: per tensor, the flat
        positions it sent, or None for all of them)."""
        if all(sent is None for sent in positions):
            self._dense += weight
            return
        if self.values is None:
            spare, self.spare = self.spare, None
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
        if self.values is None:
            raise RuntimeError("a round of dense pushes takes the plain mean")
        for total, sent in zip(sums, self.values, strict=True):
            if self._dense:
                sent.add_(self._dense)
            total.div_(sent.masked_fill_(sent == 0, 1.0))
            if fullness != 1.0:
                total.mul_(fullness)
        return self.values


def trim_count(pushes: int, trim_fraction: float) -> int:
    """k, the values dropped at each end: max(1, ⌊trim_fraction·K⌋) for K >= 3 pushes, else
    0 (with two there is no middle to keep). trim_fraction < 0.5 leaves at least one."""
    if pushes < 3:
        return 0
    return max(1, math.floor(trim_fraction * pushes))


def share_capped(weights: Sequence[float], max_share: float) -> list[float]:
    """`weights`, each at most t, with t the largest level at which no weight exceeds
    `max_share` of the capped total (max_share >= 1/len(weights): every level up to t
    keeps it). The largest weights are cut first; the others keep their values."""
    total, ordered = sum(weights), sorted(weights)
    if not weights or ordered[-1] <= max_share * total:
        return list(weights)
    if max_share * len(weights) < 1:
        raise ValueError(f"max_share {max_share} < 1/{len(weights)}: no capped weights fit it")
    uncapped = total
    for capped in range(1, len(weights)):
        uncapped -= ordered[-capped]  # the sum of all but the `capped` largest
        if max_share * capped >= 1:
            level = ordered[-capped]  # every level is feasible: cut down to the next weight
        else:
            level = max_share * uncapped / (1 - max_share * capped)
        if level >= ordered[-capped - 1]:
            return _at_most(weights, level, max_share)
    return [min(w, ordered[0]) for w in weights]  # equal weights: share 1/n each


def _at_most(weights: Sequence[float], level: float, max_share: float) -> list[float]:
    """`weights` cut to `level`, lowered by the ulps its rounding may have put it above the
    exact level, so that the largest share is at most `max_share` in float arithmetic too."""
    capped = [min(w, level) for w in weights]
    while max(capped) > max_share * sum(capped):
        level = math.nextafter(level, 0.0)
        capped = [min(w, level) for w in weights]
    return capped


def twice_fair_share(contributors: int) -> float:
    """2/K of a round of K pushes (at most all of it): what untrusted_learners lets one
    learner hold, and what the weight-share alert compares each round's largest share with."""
    return min(1.0, 2 / max(1, contributors))


def trimmed_mean_into(
    out: Sequence[torch.Tensor], pushes: Sequence[Sequence[torch.Tensor]], trim: int, scale: float
) -> None:
    """out = scale · the coordinate-wise mean of `pushes` without each value's `trim` largest
    and `trim` smallest, a chunk at a time (no temporary of K times the fragment). Sorting
    is deterministic, so every replay gives the same bits."""
    count = len(pushes)
    for i, target in enumerate(out):
        flat = target.view(-1)
        for start in range(0, flat.numel(), _TRIM_CHUNK_VALUES):
            stop = min(start + _TRIM_CHUNK_VALUES, flat.numel())
            stacked = torch.stack([p[i].view(-1)[start:stop] for p in pushes])  # (K, chunk)
            kept = stacked.sort(dim=0).values[trim : count - trim]
            torch.mean(kept, dim=0, out=flat[start:stop])
            if scale != 1.0:
                flat[start:stop].mul_(scale)
