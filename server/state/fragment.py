"""One fragment's global state: parameters, version, outer optimizer, open round, update log,
and the answers to pulls.

With a 4-bit or sparse pull codec the server applies each outer update as θ ← θ + Q(u + e),
where u is the Nesterov update, Q the codec's quantize-dequantize and e the residual of
earlier updates (error feedback), and keeps Q(u + e) in a bounded log. A learner at version v pulls
Q(u_v) … Q(u_now−1), adds them in order, and ends bit-identical to the server: both sides do
the same float32 additions of the same decoded tensors. With `fp32` pulls the step is exactly
torch.optim.SGD's and learners pull full snapshots.

Memory (tests/unit/test_fragment_memory.py counts it): a fragment holds four fp32 copies
of itself — parameters, outer momentum, error-feedback residual and the round's sum
(reused from round to round) — three with fp32 pulls, one more in async mode (Delayed
Nesterov's pending sum) and with sparse_mean senders (the senders' weights), one fewer with
no outer momentum; plus the log of encoded updates, at most a snapshot's bytes. With
outer_state_dtype bfloat16 the momentum and the residual take half as much (three copies). The
outer step works a chunk at a time; a snapshot is the parameters' bytes read in place, copied
only if a pull still streams it when the next step changes them.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections import deque
from dataclasses import dataclass

import torch

from common.codec.fp4 import all_finite
from common.codec.fragment import (
    ALIGN_VALUES,
    DEFAULT_SPARSE_K,
    TensorBytes,
    UpdateEncoder,
    params_crc32,
    snapshot_parts,
)
from common.codec.framing import chain_parts
from common.codec.slices import SliceCut, is_sliced
from common.codec.tensor import codec_id, parse_fragment
from common.errors import FailedPrecondition, InvalidArgument
from common.generated.diloco.v1 import aggregator_pb2 as pb
from server.rounds.outer import CHUNK_VALUES, STATE_DTYPES, OuterOptimizer
from server.rounds.round import Round

if CHUNK_VALUES % ALIGN_VALUES:
    raise RuntimeError("outer chunks must start where the pull codec's encoding can split")


@dataclass(frozen=True)
class PullResult:
    """An answer to a pull. Its payload is the concatenation of `parts`, which are shared by
    every pull (the snapshot of a version, each logged update): streaming them part by part
    costs no per-pull copy of the payload, so pulls in flight do not hold memory in
    proportion to the model each (bench/load.py)."""

    kind: int  # pb.PULL_KIND_*
    version: int
    parts: tuple[bytes | TensorBytes, ...]
    params_crc32: int

    @property
    def payload_bytes(self) -> int:
        return sum(len(part) for part in self.parts)

    @property
    def payload(self) -> bytes:
        """The whole payload in one buffer, for in-process callers and tests (a copy when
        there is more than one part); the servicer streams `parts` instead."""
        return b"".join(bytes(p) if isinstance(p, TensorBytes) else p for p in self.parts)


class FragmentState:
    """A fragment's parameters, version, outer state, open round and update log."""

    def __init__(
        self,
        fragment_id: int,
        param_indices: list[int],
        shapes: list[tuple[int, ...]],
        outer: OuterOptimizer,
        pull_codec: str,
        update_log_versions: int,
        update_log_fraction: float = 1.0,
        pull_sparse_k: int = DEFAULT_SPARSE_K,
        sparse_mean: str = "learners",
    ) -> None:
        self.fragment_id = fragment_id
        self.param_indices = param_indices
        self.shapes = shapes
        self.outer = outer
        self._state_dtype = outer.state_dtype  # the configured one (a restore may differ)
        self.pull_codec = codec_id(pull_codec)
        self.pull_sparse_k = pull_sparse_k  # values kept per chunk by a sparse pull codec
        self.params: list[torch.Tensor] | None = None
        self.version = -1
        self.closed_at: float | None = None  # clock time of its last round's close
        self.round = Round(list(shapes), sparse_mean)  # rounds/round.py changes it
        self._residual: list[torch.Tensor] | None = None
        # (version the update starts from, the serialized EncodedFragment of the quantized
        # update) for the newest versions: serialized once, shared by every pull's chain.
        self._updates: deque[tuple[int, bytes]] = deque()
        self._update_log_versions = update_log_versions
        self._update_log_fraction = update_log_fraction  # of a snapshot's bytes (_log_update)
        self._update_bytes = 0  # Σ len(data) over _updates
        self._snapshot: PullResult | None = None
        # Snapshots of slices (sharded islands' ranks), by (index, count), built and freed
        # as the whole one.
        self._slice_snapshots: dict[tuple[int, int], PullResult] = {}
        self._slice_crcs: dict[tuple[int, int], tuple[int, int]] = {}  # key: (version, crc)
        self._params_lock = threading.Lock()  # TensorBytes reads vs. freezing before a step
        # Held (inside the Aggregator's lock) while the state changes; a snapshot copies the
        # state holding only this one, so it waits for no other fragment's round.
        self.state_lock = threading.Lock()
        self.snapshots_frozen = 0  # snapshot tensors copied because a pull still streamed them
        self._crc: tuple[int, int] | None = None  # (version, params_crc32)
        self._numel = sum(math.prod(shape) for shape in shapes)

    def initialize(self, tensors: list[torch.Tensor]) -> None:
        params = [
            t.detach().to(torch.float32).clone(memory_format=torch.contiguous_format)
            for t in tensors
        ]
        with self.state_lock:
            self.params, self.version = params, 0

    def apply_mean(self, mean: list[torch.Tensor]) -> None:
        """One outer step along the round's mean pseudo-gradient; deterministic, so replaying
        the logged means from a snapshot rebuilds the exact state (store.py). The
        mean is left as it was."""
        if self.params is None:
            raise RuntimeError(f"fragment {self.fragment_id} has no parameters to update")
        self._release_snapshot()
        if self.pull_codec == pb.CODEC_FP32:
            self.outer.step(self.params, mean)
        else:
            self._apply_quantized(mean)
        self.version += 1

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
        self.outer.restore(state["outer"], state["version"])
        self._residual = state["residual"]  # in the snapshot's dtype, as the log replays
        self._updates.clear()
        self._update_bytes = 0
        for start, data in state["updates"]:
            list(parse_fragment(data, self.shapes))  # refuse a corrupt log now, not at a pull
            self._updates.append((start, bytes(data)))
            self._update_bytes += len(data)
        self._snapshot, self._crc = None, None

    def convert_state(self) -> bool:
        """After a restore's replay: keep the momentum and the residual in the configured
        dtype (outer_state_dtype) from now on, whatever dtype the state dir held; True if
        that is another dtype than the restored one."""
        changed = self.outer.state_dtype != self._state_dtype
        self.outer.convert_state(self._state_dtype)
        if self._residual is not None:
            dtype = STATE_DTYPES[self._state_dtype]
            self._residual = [r.to(dtype) for r in self._residual]
        return changed

    def pull(self, have_version: int, slice_of: tuple[int, int] = (0, 1)) -> PullResult:
        """What a learner at `have_version` needs: nothing, the update chain, or a snapshot;
        of slice_of = (index, count) only when count > 1 (a rank of a sharded island).

        Answers share their bytes: the snapshot is built once per version, when someone
        first needs it, and a chain is a list of the logged updates' serialized bytes with a
        few bytes of framing. Building one serialized chain per pull instead (up to a
        snapshot's size each, for learners at many different versions) made the server's
        memory grow by about 4 MB per learner for a 4 MiB model in bench/load.py.
        """
        if is_sliced(slice_of[1]):
            return self._pull_slice(have_version, SliceCut(self.shapes, *slice_of))
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
        with a few bytes of framing (common/codec/framing.py: chain_parts)."""
        logged = (data for start, data in self._updates if start >= have_version)
        return PullResult(
            pb.PULL_KIND_UPDATES, self.version, chain_parts(have_version, logged), crc
        )

    def _pull_slice(self, have_version: int, cut: SliceCut) -> PullResult:
        """pull() for a slice: its rows of the snapshot, or each logged update cut to the
        blocks covering them (common/codec/slices.py), with the slice's checksum. The cut
        chain is built per pull (a slice of each update); the snapshot is shared."""
        assert self.params is not None
        if self.pull_codec != pb.CODEC_FP32:
            try:
                SliceCut.check_codec(self.pull_codec)
            except InvalidArgument as err:
                raise FailedPrecondition(str(err)) from err
        slices = [cut.of(p, i) for i, p in enumerate(self.params)]
        key = (cut.index, cut.count)
        known = self._slice_crcs.get(key)
        if known is None or known[0] != self.version:  # once a version, as the whole's
            known = self._slice_crcs[key] = (self.version, params_crc32(slices))
        crc = known[1]
        if have_version >= self.version:
            return PullResult(pb.PULL_KIND_UP_TO_DATE, self.version, (), crc)
        if self._updates and 0 <= self._updates[0][0] <= have_version:
            logged = [cut.update(data) for start, data in self._updates if start >= have_version]
            chain = PullResult(
                pb.PULL_KIND_UPDATES, self.version, chain_parts(have_version, logged), crc
            )
            if chain.payload_bytes < 4 * cut.numel:
                return chain
        snapshot = self._slice_snapshots.get(key)
        if snapshot is None or snapshot.version != self.version:
            parts = snapshot_parts(slices, self._params_lock)
            snapshot = PullResult(pb.PULL_KIND_SNAPSHOT, self.version, parts, crc)
            self._slice_snapshots[key] = snapshot
        return snapshot

    def _current_crc32(self) -> int:
        if self._crc is None or self._crc[0] != self.version:
            assert self.params is not None
            self._crc = (self.version, params_crc32(self.params))
        return self._crc[1]

    def _apply_quantized(self, mean: list[torch.Tensor]) -> None:
        """θ += Q(u + e), e ← (u + e) − Q(u + e), a chunk of the outer update u at a time, and
        log Q(u + e) as a serialized EncodedFragment (codec UpdateEncoder). Element-wise
        the same operations as on whole tensors (and the same bytes as
        encode_fragment), without any float32 temporary of the model's size: the
        server's memory stays at parameters, momentum, residual and the round's sum
        (tests/unit/test_fragment_memory.py). With a sparse codec Q keeps the top k of every
        chunk and e holds all the rest, so the served parameters are exactly the sum of the
        decoded updates learners add, and e is what they have not been sent yet (rounded to
        bfloat16 with outer_state_dtype bfloat16: θ stays exactly that sum)."""
        assert self.params is not None
        first = self._residual is None
        if first:
            dtype = STATE_DTYPES[self.outer.state_dtype]
            self._residual = [torch.empty(shape, dtype=dtype) for shape in self.shapes]
        encoder = UpdateEncoder(self.pull_codec, self.shapes, self.pull_sparse_k)
        for i, start, u in self.outer.update_chunks(mean):
            stop = start + u.numel()
            residual = self._residual[i].view(-1)[start:stop]
            if not first:
                u.add_(residual)
            if not all_finite(u):
                raise ValueError("cannot encode a tensor with NaN or infinite values")
            quantized = encoder.add(i, start, u)
            torch.sub(u, quantized, out=residual)
            # The same float32 addition every learner does (common/codec/fragment.py apply_updates).
            self.params[i].view(-1)[start:stop].add_(quantized)
        self._log_update(encoder.serialized())

    def _log_update(self, data: bytes) -> None:
        """Keep the quantized update; drop the oldest ones beyond `update_log_versions` or
        beyond `update_log_fraction` of a snapshot's size in all. A chain longer than a
        snapshot is never sent (pull() answers with the snapshot instead), so a fraction of
        1 costs no pull bandwidth; below 1 a learner that far behind pulls a snapshot of at
        most 1/fraction times the chain's bytes, and the server holds that much less."""
        self._updates.append((self.version, data))
        self._update_bytes += len(data)
        while len(self._updates) > self._update_log_versions or (
            len(self._updates) > 1
            and self._update_bytes > self._update_log_fraction * 4 * self._numel
        ):
            self._update_bytes -= len(self._updates.popleft()[1])

    def _release_snapshot(self) -> None:
        """Before the parameters change: drop the cached snapshot, and freeze the parts that
        pulls in flight still stream (each then holds a copy of its tensor's old bytes)."""
        answers = [self._snapshot, *self._slice_snapshots.values()]
        self._snapshot, self._slice_snapshots = None, {}
        parts = [p for answer in answers if answer is not None for p in answer.parts]
        refs = [weakref.ref(p) for p in parts if isinstance(p, TensorBytes)]
        del answers, parts  # only the streams that still send a part keep it alive now
        with self._params_lock:
            for ref in refs:
                part = ref()  # alive only if a stream holds it: CPython frees the rest now
                if part is not None:
                    part.freeze()
                    self.snapshots_frozen += 1

    def _current_snapshot(self) -> PullResult:
        if self._snapshot is None or self._snapshot.version != self.version:
            assert self.params is not None
            self._snapshot = PullResult(
                pb.PULL_KIND_SNAPSHOT,
                self.version,
                snapshot_parts(self.params, self._params_lock),
                self._current_crc32(),
            )
        return self._snapshot
