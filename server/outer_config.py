"""The outer optimizer's settings, and the best recipe's values for them by pull codec and mode.

    OuterConfig(outer_lr=0.7, outer_momentum=0.9)        # one section of the server's config
    outer_recipe({"pull_codec": "sparse_2bit"})          # what the best recipe sets for it

A section of server/config.py's daemon configs (each setting keeps its flat name: flag,
DILOCO_* variable, TOML key), kept apart because the recipe's reasons travel with it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from common.codec.sparse import DEFAULT_TOPK_FRACTION
from common.codec.tensor import is_sparse
from server.outer import STATE_DTYPES
from server.sparse_mean import SPARSE_MEANS

RECIPES = ("best", "paper")


# The best recipe for sparse pull codecs: the averaged pushes applied at three times their size, no
# outer momentum, and a pull that keeps twice the push's default fraction. Sparse pushes carry
# their own momentum in the learners' decayed error-feedback residual (learner
# --push-feedback-decay, SparseLoCo); a server momentum on top of it, behind a pull that sends
# 1/64 of each chunk a round, keeps pushing along directions the learners have not been sent
# yet and diverges. The mean of K top-k pushes is denser than each; a pull of 1/32 carries it
# with less delay. Over three seeds outer lr 3 had the best mean (1.2% ahead of 2, within one
# standard deviation; 6.7% ahead of 1); 4 was worse than 1 on seed 0 (docs/RESULTS.md,
# "Headline rows").
SPARSE_OUTER = {"outer_lr": 3.0, "outer_momentum": 0.0, "outer_momentum_warmup_rounds": 0}
SPARSE_PULL_TOPK_FRACTION = 2 * DEFAULT_TOPK_FRACTION

# The outer state in float32: torch's SGD exactly. The best recipe keeps it in bfloat16 (a
# quarter less server memory with 4-bit pulls, no quality cost measured over three seeds) where
# that was measured: sync and quorum modes with dense pulls. The sparse codecs' step keeps
# most of each update in the pull residual for many rounds and was measured in float32 only.
EXACT_STATE = {"outer_state_dtype": "float32"}


def outer_recipe(values: Mapping[str, Any]) -> dict[str, Any]:
    """The outer settings of the recipe named in `values` (the dataclass defaults are best,
    less the momentum warm-up and the bfloat16 state in async mode, which has no rounds to
    warm up over and keeps float32, and with SPARSE_OUTER's step, in float32, for the sparse
    pull codecs)."""
    if values.get("recipe") == "paper":
        return {**EXACT_STATE, "outer_momentum_warmup_rounds": 0, "pull_codec": "fp4_e3m0"}
    pull_codec = values.get("pull_codec")
    if is_sparse(pull_codec):
        return {**SPARSE_OUTER, **EXACT_STATE, "pull_topk_fraction": SPARSE_PULL_TOPK_FRACTION}
    if values.get("mode") == "async":
        return {**EXACT_STATE, "outer_momentum_warmup_rounds": 0}
    return {}


@dataclass(kw_only=True)
class OuterConfig:
    """The outer optimizer's step (server/outer.py)."""

    recipe: str = "best"
    """best: the defaults below, the best measured training from scratch (docs/RESULTS.md;
    async mode: no momentum warm-up, float32 state); paper: DiLoCo's outer step exactly (no
    momentum warm-up, float32 state) and Streaming DiLoCo's fp4_e3m0 pulls, for the settings
    not given (pair it with the learners' --recipe paper)."""
    outer_lr: float = 0.7
    """Outer learning rate of the Nesterov step (0.7 in DiLoCo)."""
    outer_momentum: float = 0.9
    """Outer Nesterov momentum (0.9 in DiLoCo)."""
    outer_momentum_warmup_rounds: int = 20
    """sync/quorum: raise the outer momentum linearly from outer_momentum_warmup_start to
    outer_momentum over each fragment's first N outer steps (0: off, torch's SGD exactly).
    Helps a model trained from scratch (docs/RESULTS.md, quality)."""
    outer_momentum_warmup_start: float = 0.5
    """The outer momentum of the first outer step when the warm-up is on (at most
    outer_momentum: a lower target is the start too)."""
    outer_state_dtype: str = "bfloat16"
    """bfloat16 or float32: the dtype of the outer momentum and of the pull codec's
    error-feedback residual. bfloat16 (sync/quorum modes; the best recipe's default there
    with dense pulls) halves both: the server then holds 3 fp32 copies of its fragments, not
    4, with 4-bit pulls, with no quality cost measured (docs/RESULTS.md); replicas stay
    bit-identical. float32 (async mode, sparse pulls and the paper recipe by default): torch's
    SGD exactly."""
    sparse_mean: str = "learners"
    """What the outer step steps along with sparse pushes: learners (the round's weighted
    mean; a value a learner did not send counts as zero) or senders (each value's mean over
    the pushes that sent it; server/sparse_mean.py). Dense pushes send every value."""

    def __post_init__(self) -> None:
        if self.outer_state_dtype not in STATE_DTYPES:
            raise ValueError(
                f"outer_state_dtype must be one of {', '.join(STATE_DTYPES)}, "
                f"got {self.outer_state_dtype!r}"
            )
        if self.recipe not in RECIPES:
            raise ValueError(f"recipe must be one of {', '.join(RECIPES)}, got {self.recipe!r}")
        if not self.outer_lr > 0:
            raise ValueError(f"outer_lr must be > 0, got {self.outer_lr}")
        if not 0 <= self.outer_momentum < 1:
            raise ValueError(f"outer_momentum must be in [0, 1), got {self.outer_momentum}")
        if self.outer_momentum_warmup_rounds < 0:
            raise ValueError(
                "outer_momentum_warmup_rounds must be >= 0, "
                f"got {self.outer_momentum_warmup_rounds}"
            )
        if not 0 <= self.outer_momentum_warmup_start < 1:
            raise ValueError(
                "outer_momentum_warmup_start must be in [0, 1), "
                f"got {self.outer_momentum_warmup_start}"
            )
        if self.sparse_mean not in SPARSE_MEANS:
            raise ValueError(
                f"sparse_mean must be one of {', '.join(SPARSE_MEANS)}, got {self.sparse_mean!r}"
            )
