"""Streaming DiLoCo on the learner: which fragment syncs when, replicas, and the merge rule.

    schedule = Schedule(sync_every_steps=50, fragments=4, overlap_steps=2)
    schedule.pushes_at(step)   # fragments whose pseudo-gradient is sent after this inner step
    schedule.merges_at(step)   # fragments whose new global value is merged after this step

Fragment p is pushed every H inner steps at offset p·H/P (steps count from 1): after steps
off_p, off_p + H, off_p + 2H … (fragment 0 first after step H). The push travels while
training goes on; τ inner steps later the new global fragment is merged into the local
parameters as θ_p ← α·θ_p(local) + (1−α)·θ_p(global). α = 0 and τ = 0 give plain DiLoCo.

`StreamingSync` drives that schedule over any `Transport`: the learner process uses gRPC on a
background thread; bench/quality.py uses the in-process aggregator, so both run this code.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from common.codec.fragment import (
    apply_updates,
    decode_fragment,
    encode_fragment,
    fragment_with_feedback,
    params_crc32,
)
from common.codec.slices import SliceCut
from common.codec.sparse import (
    DEFAULT_FEEDBACK_DECAY,
    DEFAULT_FEEDBACK_IN_MODEL,
    DEFAULT_TOPK_FRACTION,
    topk_k,
)
from common.codec.tensor import is_sparse
from common.generated.diloco.v1 import aggregator_pb2 as pb

if TYPE_CHECKING:  # sliced.py builds on this module's replicas
    from learner.sliced import ShardedIsland


@dataclass(frozen=True)
class Schedule:
    sync_every_steps: int
    fragments: int = 1
    overlap_steps: int = 0

    def __post_init__(self) -> None:
        if self.sync_every_steps < 1:
            raise ValueError(f"sync_every_steps must be >= 1, got {self.sync_every_steps}")
        if not 1 <= self.fragments <= self.sync_every_steps:
            raise ValueError(
                f"fragments must be between 1 and sync_every_steps ({self.sync_every_steps}), "
                f"got {self.fragments}"
            )
        if not 0 <= self.overlap_steps < self.sync_every_steps:
            raise ValueError(
                f"overlap_steps must be in [0, sync_every_steps), got {self.overlap_steps}"
            )

    def offset(self, fragment: int) -> int:
        return fragment * self.sync_every_steps // self.fragments

    def pushes_at(self, step: int) -> list[int]:
        """Fragments to push right after inner step `step` (1-based)."""
        h = self.sync_every_steps
        return [
            p
            for p in range(self.fragments)
            if step > 0 and step >= self.offset(p) and (step - self.offset(p)) % h == 0
        ]

    def sync_step(self, fragment: int, version: int) -> int:
        """The step after which `fragment` reached `version` (0 for version 0)."""
        if version <= 0:
            return 0
        first = self.offset(fragment) or self.sync_every_steps
        return first + (version - 1) * self.sync_every_steps

    def resume_step(self, versions: Sequence[int]) -> int:
        """The schedule step a (re)joining learner starts from, given the fragment versions.

        In sync mode every live learner must push each fragment at the same schedule step, or
        two learners can each wait at a merge for a push the other makes only later. Starting
        from the step that produced the newest version puts a newcomer in phase with the rest.
        """
        return max(self.sync_step(p, v) for p, v in enumerate(versions))

    def merges_at(self, step: int) -> list[int]:
        """Fragments whose push τ steps ago is merged right after inner step `step`."""
        return self.pushes_at(step - self.overlap_steps)


def merge(local: Sequence[torch.Tensor], global_: Sequence[torch.Tensor], alpha: float) -> None:
    """θ_local ← α·θ_local + (1−α)·θ_global, in place (α = 0 copies the global value exactly)."""
    with torch.no_grad():
        for p, g in zip(local, global_, strict=True):
            g = g.to(p.device, p.dtype)
            if alpha == 0:
                p.copy_(g)
            else:
                p.mul_(alpha).add_(g, alpha=1 - alpha)


@dataclass
class PullReply:
    kind: int  # pb.PULL_KIND_*
    version: int
    payload: bytes
    params_crc32: int
    push_bytes: int = 0  # the sync's push, where the transport encoded it (Transport)


# A push's bytes, or (to a transport that encodes in the background) the encoding to run.
Payload = bytes | Callable[[], bytes]


class Transport(Protocol):
    """How a fragment sync travels: start it now, collect the new global value later."""

    def start_sync(
        self, fragment_id: int, base_version: int, payload: Payload, tokens: int, steps: int
    ) -> Any:
        """Send the pseudo-gradient; returns a handle for finish_sync. With
        `encodes_in_background` True it may be given the encoding to run on its own thread
        (`payload()`), and reports its size in PullReply.push_bytes."""

    def finish_sync(self, handle: Any) -> PullReply | None:
        """Block until the fragment's new global value is available and return it; None if
        the sync was lost with its session (a shard that restarted: nothing to merge)."""

    def ready(self, handle: Any) -> bool:
        """True if finish_sync would return without waiting."""


class FragmentReplica:
    """The learner's exact copy of one global fragment (float32, on the CPU)."""

    def __init__(
        self,
        fragment_id: int,
        indices: list[int],
        shapes: list[tuple[int, ...]],
        cut: SliceCut | None = None,
    ):
        """`cut`: the slice of the fragment this replica holds (a rank of a sharded island,
        common/codec/slices.py); `shapes` are then the slice's."""
        self.fragment_id, self.indices, self.shapes, self.cut = fragment_id, indices, shapes, cut
        self.version = -1
        self.params: list[torch.Tensor] = []

    def apply(self, reply: PullReply) -> bool:
        """Bring the replica to the reply's version; checks the server's checksum."""
        if reply.kind == pb.PULL_KIND_UP_TO_DATE:
            return False
        if reply.kind == pb.PULL_KIND_SNAPSHOT:
            params = decode_fragment(reply.payload, self.shapes)
            version = reply.version
        elif reply.kind == pb.PULL_KIND_UPDATES:
            params = [p.clone() for p in self.params]
            if self.cut is None:
                version = apply_updates(params, reply.payload, self.version)
            else:
                version = self.cut.apply_updates(params, reply.payload, self.version)
        else:
            raise ValueError(f"unknown pull kind {reply.kind}")
        crc = params_crc32(params)
        if version != reply.version or crc != reply.params_crc32:
            raise RuntimeError(
                f"fragment {self.fragment_id} replica at version {version} crc {crc:#x} does "
                f"not match the server's version {reply.version} crc {reply.params_crc32:#x}"
            )
        self.params, self.version = params, version
        return True


@dataclass
class SyncStats:
    syncs: int = 0
    blocked_s: float = 0.0
    push_bytes: int = 0
    pull_bytes: int = 0
    peak_sync_bytes: int = 0  # the largest push + pull of one fragment sync
    late_merges: int = 0  # non-blocking: merged after the merge point, on arrival
    skipped_pushes: int = 0  # previous sync still out (non-blocking), or the shard away


class StreamingSync:
    """Runs the schedule for one learner: push deltas, merge replies, count the cost."""

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        replicas: list[FragmentReplica],
        schedule: Schedule,
        transport: Transport,
        push_codec: str = "fp4_e2m1",
        merge_alpha: float = 0.5,
        tokens_per_step: int = 0,
        blocking: bool = True,
        start_step: int = 0,
        push_topk_fraction: float = DEFAULT_TOPK_FRACTION,
        push_feedback_decay: float = DEFAULT_FEEDBACK_DECAY,
        push_feedback_in_model: bool = DEFAULT_FEEDBACK_IN_MODEL,
        away: Callable[[], Collection[int]] = frozenset,
        island: ShardedIsland | None = None,
    ) -> None:
        """`blocking` (sync mode): wait at a merge point for a reply that is not back.
        Otherwise (quorum, async) keep training and merge on arrival. A sparse `push_codec`
        keeps `push_topk_fraction` of every chunk and feeds back what it leaves out (e), its
        residual decayed by β = `push_feedback_decay`. `push_feedback_in_model`: the merge
        takes the global value minus β·e, so the local model keeps the unsent progress and
        trains on from it, and the next push's delta holds it already (nothing is added
        again); otherwise the merge takes the global value and the push adds β·e to its
        delta. Both send the same bytes. `away()`: the fragments
        whose shard does not know the session now (ShardedClient.away); their pushes are
        skipped, so that nothing waits for them, until the shard is joined again. `island`: a
        sharded island's rank, syncing its slice (learner/sliced.py)."""
        if not 0 <= merge_alpha <= 1:
            raise ValueError(f"merge_alpha must be in [0, 1], got {merge_alpha}")
        self.params = params  # a Sequence looked up at each use (learner/sliced.py LocalSlices)
        self.replicas = replicas
        self.schedule = schedule
        self.transport = transport
        self.push_codec = push_codec
        self.push_sparse_k = topk_k(push_topk_fraction)
        self.push_feedback_decay = push_feedback_decay
        self.push_feedback_in_model = push_feedback_in_model and is_sparse(push_codec)
        # Sparse pushes: per fragment, what earlier pushes left out (error feedback). Held
        # for the learner's life; a restarted learner starts again from zeros.
        self.push_residuals: dict[int, list[torch.Tensor]] = {}
        self.merge_alpha = merge_alpha
        self.tokens_per_step = tokens_per_step
        self.blocking = blocking
        self.away = away
        self.island = island
        self.encode_in_background = bool(getattr(transport, "encodes_in_background", False))
        self.stats = SyncStats()
        # fragment -> (handle, push bytes, the step after which it is due for merging)
        self._in_flight: dict[int, tuple[Any, int, int]] = {}
        # Tokens and steps of a push count from here (in the clock push_phase is given: schedule
        # steps, or inner steps): a (re)joining learner starts mid-schedule.
        self._last_push_step = [start_step] * len(replicas)
        self._clock = start_step  # that clock at the last push_phase

    def local(self, replica: FragmentReplica) -> list[torch.Tensor]:
        return [self.params[i] for i in replica.indices]

    def push_phase(self, step: int, inner_step: int | None = None) -> None:
        """Send the pseudo-gradients of the fragments scheduled after schedule step `step`.

        `inner_step`: the learner's count of inner steps, when its schedule advances faster
        than its own steps (dynamic local updates); a push then reports the real steps and
        tokens since the fragment's last push. Without it, schedule steps are inner steps.
        """
        clock = self._clock = step if inner_step is None else inner_step
        due = self.schedule.pushes_at(step)
        away = self.away() if due else ()
        if self.island is not None and due:
            self.island.check_joined(bool(away))  # no rank pushes where any lost the session
        for p in due:
            if p in self._in_flight:
                # Non-blocking only: the last sync is still out. Keep training; the next
                # push carries the steps of both (and counts their tokens).
                self.stats.skipped_pushes += 1
                continue
            if p in away:
                # Its shard does not know the session now, or does not answer: nothing to
                # push to. The local fragment keeps these steps' progress, so the next push's
                # delta holds them and its claim counts them (unless a rejoin drops them).
                self.stats.skipped_pushes += 1
                continue
            replica = self.replicas[p]
            with torch.no_grad():
                local = self.local(replica)
                # On the parameters' device: a GPU learner quantizes there and only the packed
                # bytes cross to the host (same bytes as on the CPU: IEEE subtraction is exact).
                deltas = [
                    g.to(x.device) - x.detach() for g, x in zip(replica.params, local, strict=True)
                ]
            # A dense encoding of CPU tensors keeps no state: the transport may run it on its
            # own thread. A sparse one updates the error feedback the merge reads, and a GPU
            # encodes fast on its own: here, in order.
            encode = functools.partial(self._encode_push, p, deltas)
            background = (
                self.encode_in_background
                and not is_sparse(self.push_codec)
                and all(d.device.type == "cpu" for d in deltas)
            )
            payload = encode if background else encode()
            steps = clock - self._last_push_step[p]
            self._last_push_step[p] = clock
            handle = self.transport.start_sync(
                p, replica.version, payload, steps * self.tokens_per_step, steps
            )
            size = 0 if callable(payload) else len(payload)  # else known when it is back
            self._in_flight[p] = (handle, size, step + self.schedule.overlap_steps)
            self.stats.push_bytes += size

    def _encode_push(self, fragment: int, deltas: list[torch.Tensor]) -> bytes:
        """The push's payload; a sparse codec sends deltas + residual and keeps the rest."""
        if not is_sparse(self.push_codec):
            return encode_fragment(deltas, self.push_codec)
        if fragment not in self.push_residuals:
            self.push_residuals[fragment] = [torch.zeros_like(d) for d in deltas]
        residuals = self.push_residuals[fragment]
        # In-model feedback: the delta already holds β·e (the merge put it in the model).
        decay = 0.0 if self.push_feedback_in_model else self.push_feedback_decay
        return fragment_with_feedback(deltas, self.push_codec, self.push_sparse_k, residuals, decay)

    def merge_target(self, replica: FragmentReplica) -> list[torch.Tensor]:
        """What the merge moves the local fragment towards: the global value, less the
        decayed unsent residual where the learner keeps its feedback in the model."""
        residuals = self.push_residuals.get(replica.fragment_id)
        if not self.push_feedback_in_model or residuals is None:
            return replica.params
        beta = self.push_feedback_decay
        return [
            g.to(e.device) - beta * e.view_as(g)
            for g, e in zip(replica.params, residuals, strict=True)
        ]

    def merge_phase(self, step: int) -> list[int]:
        """Merge the fragments due after this step; wait for one that is not back only in
        blocking mode, otherwise merge it after a later step, when it has arrived."""
        merged = []
        for p, (handle, push_bytes, due) in sorted(self._in_flight.items()):
            if due > step or not self._ready(handle):
                continue
            del self._in_flight[p]
            started = time.perf_counter()
            reply = self.transport.finish_sync(handle)
            self.stats.blocked_s += time.perf_counter() - started
            replica = self.replicas[p]
            if reply is not None:
                push_bytes = push_bytes or reply.push_bytes
                self.stats.push_bytes += reply.push_bytes
                replica.apply(reply)
            if self.island is not None:  # waits for the other ranks (and may pull)
                started = time.perf_counter()
                self.island.settle(replica, reply is None, lambda v, r=replica: self._pull(r, v))
                self.stats.blocked_s += time.perf_counter() - started
            if reply is None:
                continue  # the fragment is synced again when its shard is joined again
            merge(self.local(replica), self.merge_target(replica), self.merge_alpha)
            self.stats.syncs += 1
            self.stats.late_merges += due < step
            self.stats.pull_bytes += len(reply.payload)
            self.stats.peak_sync_bytes = max(
                self.stats.peak_sync_bytes, push_bytes + len(reply.payload)
            )
            merged.append(p)
        return merged

    def _ready(self, handle: Any) -> bool:
        """Whether to merge a sync due now: blocking, wait for it; otherwise merge once it
        is back (on every rank of a sharded island)."""
        if self.blocking:
            return True
        ready = self.transport.ready(handle)
        return ready if self.island is None else self.island.all_true(ready)

    def _pull(self, replica: FragmentReplica, version: int) -> PullReply:
        """The replica's fragment pulled up to `version` (an island's rank catching up; the
        gRPC transport's pull)."""
        return self.transport.pull(replica.fragment_id, replica.version, version)  # type: ignore[attr-defined]

    def in_flight(self) -> list[int]:
        return sorted(self._in_flight)

    def replace(self, replica: FragmentReplica, keep_local: bool) -> None:
        """Take a replica loaded at a rejoin of its shard, dropping the fragment's sync in
        flight (its session is gone); the local parameters become the global ones unless
        `keep_local` (the run has not moved the fragment since this learner's replica)."""
        self._in_flight.pop(replica.fragment_id, None)
        self.replicas[replica.fragment_id] = replica
        if not keep_local:
            self._take_global(replica)
            # The steps the local fragment held are gone with it: claims count from here.
            self._last_push_step[replica.fragment_id] = self._clock

    def load_globals(self, keep: Collection[int] = ()) -> None:
        """Set the local parameters to the global replicas exactly (at the end of a run),
        but for the fragments in `keep` (their shard is away: no global value to take)."""
        for replica in self.replicas:
            if replica.fragment_id not in keep:
                self._take_global(replica)
        self._in_flight.clear()

    def _take_global(self, replica: FragmentReplica) -> None:
        """Local fragment := its global value exactly. In-model feedback: the unsent
        progress the model held is gone with it, so its residual is dropped too."""
        merge(self.local(replica), replica.params, alpha=0.0)
        if self.push_feedback_in_model:
            self.push_residuals.pop(replica.fragment_id, None)
