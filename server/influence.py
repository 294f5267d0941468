"""How much one learner can move the global model: the rules that bound a push's influence.

A learner's weight in a round comes from what it claims (tokens and inner steps), and its
pseudo-gradient is whatever it sends within the norm guard (server/policy.py). An
authenticated learner can lie about both. Three bounds, applied by the server alone (learners
pull the result, so replicas stay bit-identical and a replay of the log rebuilds it):

- Token claims: a learner may declare at Join how many tokens one inner step trains on; a
  push then claims at most TOKEN_CLAIM_SLACK times inner_steps times that (`check_claim`).
  Undeclared (0): unchecked, as for learners that predate the declaration.
- Weight cap: a push weighs at most `max_weight_ratio` (c) times the median of the other live
  learners' last weights (`capped_weight`). The median of the others, not of everyone, so
  that with two learners one cannot raise its own bound; the last weights rather than the
  open round's pushes so far, so that the cap is known when the push is summed (the round
  keeps no per-push copies). Honest learners within a factor c of each other are never
  capped; a liar in a round of n honest ones carries at most c/(n + c) of the weight. The
  last weights live in memory: until another live learner has pushed since the server
  started, a push has nothing to be capped against (the trimmed mean does not need them).
- Robust merge (`robust_merge`, for untrusted learners): `clip-to-median` scales each push
  down to the fragment's recent median norm (`clip_scale`), so that a push moves the model
  no further than a typical one; `trimmed-mean` drops, value by value, the k largest and k
  smallest of the round's (discounted) pseudo-gradients and averages the rest
  (`trimmed_mean_into`): the claimed weights then only set the size of a partial round's
  step. It keeps one float32 copy of the fragment per push of the open round.

What these do not bound: how often a learner pushes (async mode applies every push; the rate
limits bound that), nor how many inner steps a push claims beyond the weight cap (the steps
a learner reports elsewhere, in heartbeats, are its own claims too).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence

import torch

from common.errors import InvalidArgument
from server.outer import spans

ROBUST_MERGES = ("none", "trimmed-mean", "clip-to-median")

# A push's claimed tokens may exceed inner_steps x the declared tokens per step by this
# factor: our learners claim exactly that product; a library user whose batches vary
# declares their mean and stays within 10% over a push.
TOKEN_CLAIM_SLACK = 1.1
# The most tokens per step a learner may declare (a batch of 2^40 tokens is no real step).
MAX_TOKENS_PER_STEP = 2**40


def check_tokens_per_step(tokens_per_step: int) -> None:
    """InvalidArgument unless a declared tokens_per_step is 0 (none) or a sane count."""
    if not 0 <= tokens_per_step <= MAX_TOKENS_PER_STEP:
        raise InvalidArgument(
            f"tokens_per_step {tokens_per_step} is out of range: declare 0 (none) or the "
            f"tokens of one inner step, at most 2^40"
        )


def check_claim(tokens: int, inner_steps: int, tokens_per_step: int) -> None:
    """Raise ValueError (the reason) if a push claims more tokens than its inner steps at the
    declared rate allow; a learner that declared none (0) is not checked."""
    if tokens_per_step and 10 * tokens > 11 * inner_steps * tokens_per_step:
        raise ValueError(
            f"push claims {tokens} tokens for {inner_steps} inner steps, more than "
            f"{TOKEN_CLAIM_SLACK:g} x the {tokens_per_step} tokens per step declared at Join"
        )


def capped_weight(weight: float, others: Iterable[float], max_ratio: float) -> float:
    """`weight`, at most `max_ratio` times the median of `others` (the other live learners'
    last weights); unchanged when the cap is off (0) or there are no others."""
    others = list(others)
    if not max_ratio or not others:
        return weight
    return min(weight, max_ratio * statistics.median(others))


def clip_scale(norm: float, median_norm: float | None) -> float:
    """The factor that brings a push of `norm` down to `median_norm` (1 when it is not above
    it, or when there is no median yet)."""
    if median_norm is None or not norm > median_norm or not math.isfinite(norm):
        return 1.0
    return median_norm / norm


def trim_count(pushes: int, trim_fraction: float) -> int:
    """k, the values dropped at each end: max(1, ⌊trim_fraction·K⌋) for K >= 3 pushes, else
    0 (with two there is no middle to keep). trim_fraction < 0.5 leaves at least one."""
    if pushes < 3:
        return 0
    return max(1, math.floor(trim_fraction * pushes))


def trimmed_mean_into(
    out: Sequence[torch.Tensor], pushes: Sequence[Sequence[torch.Tensor]], trim: int, scale: float
) -> None:
    """out = scale · the coordinate-wise mean of `pushes` without each value's `trim` largest
    and `trim` smallest, a chunk at a time (no temporary of K times the fragment). Sorting
    is deterministic, so every replay gives the same bits."""
    count = len(pushes)
    for i, target in enumerate(out):
        flat = target.view(-1)
        for start, stop in spans(flat.numel()):
            stacked = torch.stack([p[i].view(-1)[start:stop] for p in pushes])  # (K, chunk)
            kept = stacked.sort(dim=0).values[trim : count - trim]
            torch.mean(kept, dim=0, out=flat[start:stop])
            if scale != 1.0:
                flat[start:stop].mul_(scale)
