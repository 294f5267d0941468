"""The outer step: SGD with Nesterov momentum on a round's mean pseudo-gradient, its settings,
and the best recipe's values for them.

    outer = NesterovOuter(lr=0.7, momentum=0.9)
    for i, start, u in outer.update_chunks(mean):   # the update, a chunk at a time
        ...                                          # θ += Q(u + e) (server/state/fragment.py)

DiLoCo treats the mean pseudo-gradient Δ = θ_global − θ_local as a gradient and takes one
step of torch.optim.SGD(lr, momentum, nesterov=True, dampening=0). NesterovOuter reproduces
that update operation for operation (so results are bit-identical to torch's), keeping its
state explicit and per fragment so it can be saved, restored and sharded. DelayedNesterov
is the asynchronous mode's step. OuterConfig is the server's section for both (each setting
keeps its flat name: flag, DILOCO_* variable, TOML key).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch

from server.rounds.round import SPARSE_MEANS

# Values of the outer update made at a time (512 KiB of float32): the step then needs no
# temporary of the model's size (a fragment stays at ~4 model copies: state/fragment.py).
CHUNK_VALUES = 1 << 17


class OuterOptimizer(Protocol):
    state_dtype: str  # a STATE_DTYPES key: the momentum's dtype, and the pull residual's

    def step(self, params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        """Apply the change in place (in float32, exactly as the optimizer defines it)."""

    def update_chunks(self, grads: list[torch.Tensor]) -> Iterator[tuple[int, int, torch.Tensor]]:
        """The change to apply for these (averaged) pseudo-gradients, a chunk at a time:
        (tensor index, first value, float32 values)."""

    def restore(self, state: dict, version: int) -> None:
        """Load the state a snapshot saved (`vars()` of the optimizer) at fragment `version`."""

    def convert_state(self, state_dtype: str) -> None:
        """Keep the state in `state_dtype` (a STATE_DTYPES key) from now on."""

    def adopt(self, configured: OuterOptimizer) -> None:
        """After a restart's replay (made with the snapshot's settings): take the settings of
        `configured`, a fresh optimizer of this server's config, from the next step on."""


# The OuterConfig setting that each optimizer field saved in a snapshot (`vars()`) holds.
_SETTING_OF_FIELD = {
    "lr": "outer_lr",
    "momentum": "outer_momentum",
    "warmup_rounds": "outer_momentum_warmup_rounds",
    "warmup_start": "outer_momentum_warmup_start",
    "state_dtype": "outer_state_dtype",
}
# Settings a snapshot records but a restore leaves at the config's (the log replays with them).
_CONFIG_FIELDS = ("warmup_rounds", "warmup_start")
# An outer lr schedule a snapshot may record: read to refuse any but a constant lr.
_SCHEDULE_FIELDS = ("lr_schedule", "lr_schedule_rounds", "lr_schedule_power")
# outer_state_dtype's values: the dtype the momentum (and a fragment's pull residual) is kept in.
STATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def snapshot_settings(state: dict) -> dict[str, float | str]:
    """The OuterConfig settings, by flat name, of the optimizer whose `vars()` a snapshot
    saved: what a replay of the state dir's log needs when the flags of the server that
    wrote it are not at hand (diloco-export)."""
    return {setting: state[key] for key, setting in _SETTING_OF_FIELD.items() if key in state}


def warmed_momentum(momentum: float, start: float, rounds: int, taken: int) -> float:
    """The momentum of outer step `taken` (0-based) under a linear warm-up from `start` to
    `momentum` over the first `rounds` steps; `rounds` = 0: always `momentum`.

    Why: from a random start the pseudo-gradients turn quickly, and momentum 0.9 amplifies
    each step up to lr/(1-momentum) = 7x along a direction that is already stale; a model
    trained from scratch falls behind in its first rounds and never makes it up
    (bench/quality.py). Lower momentum early and the full value later avoids that. A `start`
    above `momentum` is taken as `momentum`: a warm-up never raises the momentum above its
    target (so `--outer-momentum 0` alone means no momentum, whatever the warm-up settings).
    """
    start = min(start, momentum)
    if taken >= rounds:
        return momentum
    return start + (momentum - start) * taken / rounds


@dataclass
class NesterovOuter:
    """Momentum buffers for one fragment's tensors; `step` updates params in place.

    With `warmup_rounds` > 0 the momentum rises linearly from `warmup_start` to `momentum`
    over the first outer steps (`warmed_momentum`); with 0 it is torch's SGD exactly. With
    `state_dtype` "bfloat16" the buffers take half the memory: each chunk is advanced in
    float32 and stored rounded (then not torch's SGD bit for bit).
    """

    lr: float = 0.7
    momentum: float = 0.9
    momentum_buffers: list[torch.Tensor] | None = field(default=None)
    warmup_rounds: int = 0
    warmup_start: float = 0.5
    steps_taken: int = 0
    state_dtype: str = "float32"

    def restore(self, state: dict, version: int) -> None:
        """Load a snapshot's `vars()`. The warm-up's settings stay the config's; the state
        dtype is the snapshot's, so that the log after it replays as it ran (`convert_state`
        then takes the config's). A snapshot without a count of steps took one outer step per
        version, one without a state dtype kept float32; one whose outer lr follows a
        schedule is refused (this server's outer lr is constant)."""
        if state.get("lr_schedule", "constant") != "constant":
            raise ValueError(
                f"the state dir's outer optimizer follows outer_lr_schedule "
                f"{state['lr_schedule']}, which this server does not offer: start on a new "
                f"state dir from the model diloco-export writes out of this one"
            )
        state = {k: v for k, v in state.items() if k not in _CONFIG_FIELDS + _SCHEDULE_FIELDS}
        state.setdefault("steps_taken", version)
        state.setdefault("state_dtype", "float32")
        for name, value in state.items():
            setattr(self, name, value)
        if self.momentum == 0:  # a snapshot may hold a buffer momentum 0 never reads
            self.momentum_buffers = None

    def adopt(self, configured: NesterovOuter) -> None:
        self.lr, self.momentum = configured.lr, configured.momentum
        self.warmup_rounds, self.warmup_start = configured.warmup_rounds, configured.warmup_start

    def convert_state(self, state_dtype: str) -> None:
        """Keep the momentum in `state_dtype` from now on (buffers converted)."""
        self.state_dtype = state_dtype
        if self.momentum_buffers is not None:
            dtype = STATE_DTYPES[state_dtype]
            self.momentum_buffers = [b.to(dtype) for b in self.momentum_buffers]

    def step(self, params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        """One torch.optim.SGD(nesterov=True) step of `params` along `grads`.

        Made a chunk at a time with torch's own operations (p += −lr·(g + momentum·buf)):
        element-wise, so bit-identical to the whole-tensor step, with no full-size temporary.
        """
        lr = self.lr
        for i, start, out in self._nesterov_chunks(grads):
            _flat(params[i])[start : start + out.numel()].add_(out, alpha=-lr)

    def update_chunks(self, grads: list[torch.Tensor]) -> Iterator[tuple[int, int, torch.Tensor]]:
        """Advance the momentum, then yield the Nesterov update −lr·(g + momentum·buf) a chunk
        at a time: (tensor index, first value, float32 values), each valid until the next is
        asked for. With quantized pulls the server adds a quantized copy of it."""
        lr = self.lr
        for i, start, out in self._nesterov_chunks(grads):
            yield i, start, out.mul_(-lr)

    def _nesterov_chunks(
        self, grads: list[torch.Tensor]
    ) -> Iterator[tuple[int, int, torch.Tensor]]:
        """Advance the momentum and yield g + momentum·buf a chunk at a time (float32, valid
        until the next chunk is asked for)."""
        momentum = warmed_momentum(
            self.momentum, self.warmup_start, self.warmup_rounds, self.steps_taken
        )
        self.steps_taken += 1
        scratch = torch.empty(min(CHUNK_VALUES, _largest(grads)), dtype=torch.float32)
        # No momentum (the sparse codecs' step): no buffer to keep, torch's SGD keeps none.
        momentum_of = None
        if self.momentum != 0:
            momentum_of = self._chunk_momentum(grads, momentum, torch.empty_like(scratch))
        for i, g in enumerate(grads):
            flat_g = _flat(g)
            for start, stop in spans(flat_g.numel()):
                out = scratch[: stop - start]
                if momentum_of is None:
                    out.copy_(flat_g[start:stop])
                else:
                    torch.add(
                        flat_g[start:stop], momentum_of(i, start, stop), alpha=momentum, out=out
                    )
                yield i, start, out

    def _chunk_momentum(
        self, grads: list[torch.Tensor], momentum: float, advanced: torch.Tensor
    ) -> Callable[[int, int, int], torch.Tensor]:
        """The advanced momentum of values [start, stop) of tensor i, in float32. float32
        buffers are advanced whole first, as torch's SGD does; bfloat16 ones a chunk at a
        time, in float32 (`advanced`), stored rounded."""
        if self.state_dtype == "float32":
            whole = self._advance_whole(grads, momentum)
            return lambda i, start, stop: _flat(whole[i])[start:stop]
        first = self.momentum_buffers is None
        if self.momentum_buffers is None:
            dtype = STATE_DTYPES[self.state_dtype]
            self.momentum_buffers = [torch.empty(g.shape, dtype=dtype) for g in grads]
        buffers = self.momentum_buffers

        def advance(i: int, start: int, stop: int) -> torch.Tensor:
            g, buf = _flat(grads[i])[start:stop], _flat(buffers[i])[start:stop]
            m = advanced[: stop - start]
            if first:  # torch starts the buffer as a copy of the first gradient
                m.copy_(g)
            else:
                m.copy_(buf).mul_(momentum).add_(g)
            buf.copy_(m)
            return m

        return advance

    def _advance_whole(self, grads: list[torch.Tensor], momentum: float) -> list[torch.Tensor]:
        """Advance float32 buffers as torch's SGD does, whole tensors at a time."""
        if self.momentum_buffers is None:
            # torch starts the buffer as a copy of the first gradient.
            self.momentum_buffers = [g.detach().clone() for g in grads]
        else:
            for buf, g in zip(self.momentum_buffers, grads, strict=True):
                buf.mul_(momentum).add_(g)
        return self.momentum_buffers


@dataclass
class DelayedNesterov:
    """Delayed Nesterov for asynchronous pushes (Liu et al. 2024, arXiv 2401.09135).

    Every pseudo-gradient g is applied at once as plain SGD, θ ← θ − (lr/N)·g, and summed in
    a buffer; after every N of them the momentum absorbs the buffer's mean ḡ and only the
    momentum term is applied, θ ← θ − lr·momentum·m with m ← momentum·m + ḡ. Over N pushes
    that is exactly one Nesterov step along ḡ, but stale gradients no longer hit the momentum
    one by one.
    """

    lr: float = 0.7
    momentum: float = 0.9
    every: int = 1
    buffer: list[torch.Tensor] | None = None
    momentum_buffers: list[torch.Tensor] | None = None
    pending: int = 0
    state_dtype: str = "float32"  # the only one (the config refuses another in async)

    def restore(self, state: dict, version: int) -> None:
        """Load a snapshot's `vars()`."""
        for name, value in state.items():
            setattr(self, name, value)

    def adopt(self, configured: DelayedNesterov) -> None:
        """The lr and momentum; N (`every`) follows the live learners or the config at each
        push already."""
        self.lr, self.momentum = configured.lr, configured.momentum

    def convert_state(self, state_dtype: str) -> None:
        if state_dtype != "float32":
            raise ValueError("Delayed Nesterov keeps its state in float32")

    def step(self, params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        for i, start, u in self.update_chunks(grads):
            _flat(params[i])[start : start + u.numel()].add_(u)

    def update_chunks(self, grads: list[torch.Tensor]) -> Iterator[tuple[int, int, torch.Tensor]]:
        """The update −(lr/N)·g (plus −lr·momentum·m every N pushes) a chunk at a time, like
        NesterovOuter's."""
        momentum = self._absorb(grads)
        scratch = torch.empty(min(CHUNK_VALUES, _largest(grads)), dtype=torch.float32)
        for i, g in enumerate(grads):
            flat_g = _flat(g)
            flat_m = _flat(self.momentum_buffers[i]) if momentum and self.momentum_buffers else None
            for start, stop in spans(flat_g.numel()):
                out = torch.mul(
                    flat_g[start:stop], -self.lr / self.every, out=scratch[: stop - start]
                )
                if flat_m is not None:
                    out.add_(flat_m[start:stop], alpha=-self.lr * self.momentum)
                yield i, start, out

    def _absorb(self, grads: list[torch.Tensor]) -> bool:
        """Sum the gradients into the buffer; every N of them, fold the buffer's mean into the
        momentum. Returns whether this update carries the momentum term."""
        if self.buffer is None:
            self.buffer = [
                torch.zeros_like(g, memory_format=torch.contiguous_format) for g in grads
            ]
        for b, g in zip(self.buffer, grads, strict=True):
            b.add_(g)
        self.pending += 1
        if self.pending < self.every:
            return False
        mean = [b.div_(self.pending) for b in self.buffer]
        if self.momentum_buffers is None:
            self.momentum_buffers = [m.clone() for m in mean]
        else:
            for m, g in zip(self.momentum_buffers, mean, strict=True):
                m.mul_(self.momentum).add_(g)
        self.buffer, self.pending = None, 0
        return True


def spans(numel: int, size: int = CHUNK_VALUES) -> Iterator[tuple[int, int]]:
    """[start, stop) ranges of at most `size` values covering `numel` values."""
    for start in range(0, numel, size):
        yield start, min(start + size, numel)


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A 1-D view of a contiguous tensor (the server's tensors all are)."""
    if not t.is_contiguous():
        raise ValueError("outer optimizer tensors must be contiguous")
    return t.view(-1)


def _largest(tensors: list[torch.Tensor]) -> int:
    return max((t.numel() for t in tensors), default=0)


RECIPES = ("best", "paper")  # the recipes server/config.py's outer_recipe knows


@dataclass(kw_only=True)
class OuterConfig:
    """The outer optimizer's step."""

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
    the pushes that sent it; server/rounds/round.py). Dense pushes send every value."""

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
