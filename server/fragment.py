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
from common.wire import params_crc32
from server.ingest import DenseBody, PushBody
from server.outer import OuterOptimizer
from server.pull_parts import chain_parts, snapshot_parts


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
    """An answer to a pull. Its payload is the concatenation of `parts`, which are shared by
    every pull (the snapshot of a version, each logged update): streaming them part by part
    costs no per-pull copy of the payload, so pulls in flight do not hold memory in
    proportion to the model each (bench/load.py)."""

    kind: int  # pb.PULL_KIND_*
    version: int
    parts: tuple[bytes, ...]
    params_crc32: int

    @property
    def payload_bytes(self) -> int:
        return sum(len(part) for part in self.parts)

    @property
    def payload(self) -> bytes:
        """The whole payload in one buffer, for in-process callers and tests (a copy when
        there is more than one part); the servicer streams `parts` instead."""
        return b"".join(self.parts)


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
        # (version the update starts from, the serialized EncodedFragment of the quantized
        # update) for the newest versions: serialized once, shared by every pull's chain.
        self._updates: deque[tuple[int, bytes]] = deque(maxlen=update_log_versions)
        self._snapshot: PullResult | None = None
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
        self._snapshot = None  # the old answer: free its memory now

    def state_dict(self) -> dict:
        """Everything needed to resume this fragment exactly: parameters, version, outer
        optimizer state, error-feedback residual and the log of quantized updates."""
        return {
            "version": self.version,
            "params": self.params,
            "outer": dict(vars(self.outer)),
            "residual": self._residual,
            "updates": list(self._updates),
        }

    def load_state_dict(self, state: dict) -> None:
        self.version = state["version"]
        self.params = state["params"]
        for name, value in state["outer"].items():
            setattr(self.outer, name, value)
        self._residual = state["residual"]
        self._updates.clear()
        for start, data in state["updates"]:
            pb.EncodedFragment.FromString(data)  # refuse a corrupt log now, not at a pull
            self._updates.append((start, bytes(data)))
        self._snapshot, self._crc = None, None

    def pull(self, have_version: int) -> PullResult:
        """What a learner at `have_version` needs: nothing, the update chain, or a snapshot.

        Answers share their bytes: the snapshot is built once per version, when someone
        first needs it, and a chain is a list of the logged updates' serialized bytes with a
        few bytes of framing. Building one serialized chain per pull instead (up to a
        snapshot's size each, for learners at many different versions) made the server's
        memory grow by about 4 MB per learner for a 4 MiB model in bench/load.py.
        """
        crc = self._current_crc32()
        if have_version >= self.version:
            return PullResult(pb.PULL_KIND_UP_TO_DATE, self.version, (), crc)
        log_covers = bool(self._updates) and 0 <= self._updates[0][0] <= have_version
        if log_covers:
            chain = self._chain(have_version, crc)
            # A snapshot is at least 4 bytes a value: compare with it only when that is close.
            if chain.payload_bytes < 4 * self._numel or chain.payload_bytes < (
                self._current_snapshot().payload_bytes
            ):
                return chain
        return self._current_snapshot()

    def _chain(self, have_version: int, crc: int) -> PullResult:
        """The serialized FragmentUpdates from `have_version`: the logged updates' own bytes
        with a few bytes of framing (server/pull_parts.py)."""
        logged = (data for start, data in self._updates if start >= have_version)
        return PullResult(
            pb.PULL_KIND_UPDATES, self.version, chain_parts(have_version, logged), crc
        )

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
        self._updates.append((self.version, encoded.SerializeToString()))

    def _current_snapshot(self) -> PullResult:
        if self._snapshot is None or self._snapshot.version != self.version:
            assert self.params is not None
            self._snapshot = PullResult(
                pb.PULL_KIND_SNAPSHOT,
                self.version,
                snapshot_parts(self.params),
                self._current_crc32(),
            )
        return self._snapshot
