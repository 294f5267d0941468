"""One fragment's global state: parameters, version, outer optimizer, open round, update log.

With a 4-bit pull codec the server applies each outer update as θ ← θ + Q(u + e), where u is
the Nesterov update, Q the codec's quantize-dequantize and e the residual of earlier updates
(error feedback), and keeps Q(u + e) in a bounded log. A learner at version v pulls
Q(u_v) … Q(u_now−1), adds them in order, and ends bit-identical to the server: both sides do
the same float32 additions of the same decoded tensors. With `fp32` pulls the step is exactly
torch.optim.SGD's and learners pull full snapshots.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from common.codec import codec_id, decode, encode
from common.generated.diloco.v1 import aggregator_pb2 as pb
from common.wire import encode_fragment, params_crc32
from server.ingest import DenseBody, PushBody
from server.outer import OuterOptimizer

# Update chains kept per fragment for the current version (by the version pulled from).
CACHED_CHAINS = 2


@dataclass
class Round:
    """Contributions to the next version, summed so memory stays O(model)."""

    delta_sum: list[torch.Tensor] | None = None  # Σ weight·discount·Δ
    weight_sum: float = 0.0  # Σ weight (undiscounted: stale contributions shrink the step)
    contributors: set[str] = field(default_factory=set)
    pushes: int = 0
    tokens: int = 0
    quorum_since: float | None = None  # clock time the round first had enough contributors
    opened_at: float | None = None  # clock time of the round's first push
    # Σ weight·discount·max|Δ|: a bound on max|delta_sum|, so a push that could overflow the
    # float32 sum is refused before it is added (Aggregator.push).
    abs_bound: float = 0.0


@dataclass(frozen=True)
class PullResult:
    kind: int  # pb.PULL_KIND_*
    version: int
    payload: bytes
    params_crc32: int


@dataclass(frozen=True)
class RoundSummary:
    version: int
    contributors: int
    tokens: int
    outer_step_s: float


class FragmentState:
    def __init__(
        self,
        fragment_id: int,
        param_indices: list[int],
        shapes: list[tuple[int, ...]],
        outer: OuterOptimizer,
        pull_codec: str,
        update_log_versions: int,
    ) -> None:
        self.fragment_id = fragment_id
        self.param_indices = param_indices
        self.shapes = shapes
        self.outer = outer
        self.pull_codec = codec_id(pull_codec)
        self.params: list[torch.Tensor] | None = None
        self.version = -1
        self.round = Round()
        self._residual: list[torch.Tensor] | None = None
        # (version the update starts from, the quantized update) for the newest versions.
        self._updates: deque[tuple[int, pb.EncodedFragment]] = deque(maxlen=update_log_versions)
        self._snapshot: PullResult | None = None
        self._chains: dict[int, PullResult] = {}  # have_version -> chain, current version
        self._crc: tuple[int, int] | None = None  # (version, params_crc32)
        self._numel = sum(math.prod(shape) for shape in shapes)
        self.last_mean: list[torch.Tensor] | None = None  # of the last round, for the log
        # learner -> base_version of its last accepted push: a retried push counts once.
        self.last_push_base: dict[str, int] = {}

    def initialize(self, tensors: list[torch.Tensor]) -> None:
        self.params = [t.detach().to(torch.float32).clone() for t in tensors]
        self.version = 0

    def add(
        self,
        learner_id: str,
        body: PushBody | DenseBody,
        tokens: int,
        weight: float = 1.0,
        discount: float = 1.0,
    ) -> None:
        """Add a pseudo-gradient with its weight and staleness discount to the open round.

        A PushBody is decoded into the sum a chunk at a time (server/ingest.py): no
        per-learner float32 copy of the fragment is ever made."""
        rnd, scale = self.round, weight * discount
        rnd.delta_sum = body.add_to(rnd.delta_sum, scale)
        rnd.abs_bound += scale * body.max_abs
        rnd.weight_sum += weight
        rnd.contributors.add(learner_id)
        rnd.pushes += 1
        rnd.tokens += tokens

    def close_round(self, expected_weight: float = 0.0) -> RoundSummary:
        """Average the round's pseudo-gradients and apply one outer step.

        The sum is divided by the larger of the round's weight and `expected_weight` (the
        weight a full round would carry): a partial round then takes a partial step.
        """
        rnd, started = self.round, time.perf_counter()
        assert rnd.delta_sum is not None and self.params is not None  # caller checked
        denominator = max(rnd.weight_sum, expected_weight)
        mean = [acc.div_(denominator) for acc in rnd.delta_sum]
        self.apply_mean(mean)
        self.round = Round()
        self.last_mean = mean
        return RoundSummary(self.version, rnd.pushes, rnd.tokens, time.perf_counter() - started)

    def apply_mean(self, mean: list[torch.Tensor]) -> None:
        """One outer step along the round's mean pseudo-gradient; deterministic, so replaying
        the logged means from a snapshot rebuilds the exact state (server/durable.py)."""
        if self.params is None:
            raise RuntimeError(f"fragment {self.fragment_id} has no parameters to update")
        if self.pull_codec == pb.CODEC_FP32:
            self.outer.step(self.params, mean)
        else:
            self._apply_quantized(self.outer.update(mean))
        self.version += 1
        self._snapshot, self._chains = None, {}  # old answers: free their memory now

    def state_dict(self) -> dict:
        """Everything needed to resume this fragment exactly: parameters, version, outer
        optimizer state, error-feedback residual and the log of quantized updates."""
        return {
            "version": self.version,
            "params": self.params,
            "outer": dict(vars(self.outer)),
            "residual": self._residual,
            "updates": [(start, msg.SerializeToString()) for start, msg in self._updates],
        }

    def load_state_dict(self, state: dict) -> None:
        self.version = state["version"]
        self.params = state["params"]
        for name, value in state["outer"].items():
            setattr(self.outer, name, value)
        self._residual = state["residual"]
        self._updates.clear()
        for start, data in state["updates"]:
            self._updates.append((start, pb.EncodedFragment.FromString(data)))
        self._snapshot, self._chains, self._crc = None, {}, None

    def pull(self, have_version: int) -> PullResult:
        """What a learner at `have_version` needs: nothing, the update chain, or a snapshot.

        Answers are built once per version and shared: every learner at the same version gets
        the same bytes, so the serialization cost and memory do not grow with the learners.
        The float32 snapshot is built only when someone needs it, not on every pull.
        """
        crc = self._current_crc32()
        if have_version >= self.version:
            return PullResult(pb.PULL_KIND_UP_TO_DATE, self.version, b"", crc)
        log_covers = bool(self._updates) and 0 <= self._updates[0][0] <= have_version
        if log_covers:
            chain = self._chain(have_version, crc)
            # A snapshot is at least 4 bytes a value: compare with it only when that is close.
            if len(chain.payload) < 4 * self._numel or len(chain.payload) < len(
                self._current_snapshot().payload
            ):
                return chain
        return self._current_snapshot()

    def _chain(self, have_version: int, crc: int) -> PullResult:
        """The update chain from `have_version`, cached for the current version (the newest
        few starting points only: learners mostly pull from the version just before)."""
        cached = self._chains.get(have_version)
        if cached is not None and cached.version == self.version:
            return cached
        if any(c.version != self.version for c in self._chains.values()):
            self._chains.clear()
        if len(self._chains) >= CACHED_CHAINS:
            self._chains.pop(next(iter(self._chains)))
        chain = [msg for start, msg in self._updates if start >= have_version]
        data = pb.FragmentUpdates(from_version=have_version, updates=chain).SerializeToString()
        result = PullResult(pb.PULL_KIND_UPDATES, self.version, data, crc)
        self._chains[have_version] = result
        return result

    def _current_crc32(self) -> int:
        if self._crc is None or self._crc[0] != self.version:
            assert self.params is not None
            self._crc = (self.version, params_crc32(self.params))
        return self._crc[1]

    def _apply_quantized(self, update: list[torch.Tensor]) -> None:
        assert self.params is not None
        if self._residual is not None:
            for u, r in zip(update, self._residual, strict=True):
                u.add_(r)
        encoded = pb.EncodedFragment(tensors=[encode(u, self.pull_codec) for u in update])
        quantized = [
            decode(t, shape) for t, shape in zip(encoded.tensors, self.shapes, strict=True)
        ]
        self._residual = [u.sub_(q) for u, q in zip(update, quantized, strict=True)]
        for p, q in zip(self.params, quantized, strict=True):
            p.add_(q)  # the same float32 addition every learner does (common.wire.apply_updates)
        self._updates.append((self.version, encoded))

    def _current_snapshot(self) -> PullResult:
        if self._snapshot is None or self._snapshot.version != self.version:
            assert self.params is not None
            self._snapshot = PullResult(
                pb.PULL_KIND_SNAPSHOT,
                self.version,
                encode_fragment(self.params, "fp32"),
                self._current_crc32(),
            )
        return self._snapshot
