"""The server's memory in proportion to the model stays at four fp32 copies (the target).

A fragment holds its parameters, the outer momentum, the error-feedback residual and the
round's sum (kept between rounds and reused), plus a log of 4-bit updates no larger than one
fp32 copy; an outer step makes no temporary of the model's size. Counted from the objects
themselves (no RSS, no timing), so these tests are exact and fail on the first extra copy.
"""

from __future__ import annotations

from collections import deque

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from common.codec.fragment import TensorBytes
from server.rounds.ingest import CHUNK_VALUES, DenseBody
from server.rounds.outer import DelayedNesterov, NesterovOuter
from server.rpc.servicer import PULL_CHUNK_BYTES, _pieces
from server.state.fragment import FragmentState
from tests.support.fakes import close_round

# Larger than a chunk of the outer step, so that the chunking is exercised.
SHAPES = [(512, 640), (300_001,), (3,)]
MODEL_BYTES = 4 * sum(torch.Size(s).numel() for s in SHAPES)


def run(pull_codec: str, rounds: int, outer=None, update_log_fraction=1.0) -> FragmentState:
    fragment = FragmentState(
        0, [0, 1, 2], SHAPES, outer or NesterovOuter(), pull_codec, 16, update_log_fraction
    )
    g = torch.Generator().manual_seed(0)
    fragment.initialize([torch.randn(s, generator=g) for s in SHAPES])
    for _ in range(rounds):
        for learner in ("a", "b", "c"):
            delta = [torch.randn(s, generator=g) * 1e-2 for s in SHAPES]
            fragment.round.add(learner, DenseBody(delta), tokens=1)
        close_round(fragment)
        fragment.pull(-1)  # builds the snapshot of this version, as a joining learner would
    return fragment


def joined(parts) -> bytes:
    return b"".join(bytes(p) if isinstance(p, TensorBytes) else p for p in parts)


def held(root: object) -> tuple[int, int]:
    """(bytes of the distinct tensor storages, bytes of bytes objects) reachable from root."""
    storages: dict[int, int] = {}
    blobs: dict[int, int] = {}
    seen: set[int] = set()
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        elif isinstance(obj, bytes):
            blobs[id(obj)] = len(obj)
        elif isinstance(obj, (list, tuple, set, deque)):
            stack.extend(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif hasattr(obj, "__dict__"):
            stack.extend(vars(obj).values())
    return sum(storages.values()), sum(blobs.values())


@pytest.mark.parametrize(("pull_codec", "copies"), [("fp4_e2m1", 4), ("fp32", 3)])
def test_a_fragment_holds_four_model_copies_and_a_bounded_log(pull_codec, copies) -> None:
    fragment = run(pull_codec, rounds=10)
    fragment.round.add("a", DenseBody([torch.ones(s) for s in SHAPES]), tokens=1)  # a round is open
    tensors, blobs = held(fragment)
    # Parameters, momentum, round sum (+ residual with 4-bit pulls): nothing else.
    assert tensors == copies * MODEL_BYTES
    # The snapshot of the current version reads the parameters in place (no bytes of its
    # own); the log of 4-bit updates (0.53 bytes a value each) keeps no more than a
    # snapshot's bytes: a longer chain is never sent.
    assert fragment._snapshot is not None and fragment.snapshots_frozen == 0
    assert blobs <= MODEL_BYTES


@pytest.mark.parametrize(("pull_codec", "copies"), [("fp4_e2m1", 3), ("fp32", 2.5)])
def test_bfloat16_outer_state_holds_half_a_copy_less_each(pull_codec, copies) -> None:
    """outer_state_dtype bfloat16: the momentum (and the residual of 4-bit pulls) in half
    the bytes; the parameters and the round's sum stay float32."""
    fragment = run(pull_codec, rounds=3, outer=NesterovOuter(state_dtype="bfloat16"))
    fragment.round.add("a", DenseBody([torch.ones(s) for s in SHAPES]), tokens=1)
    assert held(fragment)[0] == copies * MODEL_BYTES


@pytest.mark.parametrize("pull_codec", ["fp4_e2m1", "fp32"])
def test_a_snapshot_streamed_across_a_step_keeps_its_versions_bytes(pull_codec) -> None:
    fragment = run(pull_codec, rounds=2)
    expected = joined(fragment.pull(-1).parts)
    in_flight = _pieces(fragment.pull(-1).parts, PULL_CHUNK_BYTES)  # a pull stream
    first = next(in_flight)
    fragment.round.add("a", DenseBody([torch.ones(s) for s in SHAPES]), tokens=1)
    close_round(fragment)  # the parameters change while the stream is half-way
    assert fragment.snapshots_frozen == 2  # the two big tensors, copied once for the stream
    assert first + b"".join(in_flight) == expected
    assert joined(fragment.pull(-1).parts) != expected  # a new pull gets the new version


@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_the_update_log_keeps_what_a_pull_can_use(fraction: float) -> None:
    fragment = run("fp4_e2m1", rounds=10, update_log_fraction=fraction)
    kept = len(fragment._updates)
    # Capped by bytes (about 7 fp4 updates in a snapshot's bytes), not by the 16 versions.
    assert kept == int(fraction * 4 * 8 / 4.25)
    assert fragment._update_bytes <= fraction * fragment.pull(-1).payload_bytes
    chain = fragment.pull(fragment.version - kept)
    assert chain.kind != fragment.pull(-1).kind  # the oldest kept version still gets a chain
    assert fragment.pull(fragment.version - kept - 1).kind == fragment.pull(-1).kind


class _NewStorages(TorchDispatchMode):
    """The largest storage an operator allocated (not a view, not an out= or in-place)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor)
        }
        for t in tree_flatten(result)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.largest = max(self.largest, t.untyped_storage().nbytes())
        return result


def compact() -> NesterovOuter:
    return NesterovOuter(state_dtype="bfloat16")


@pytest.mark.parametrize("pull_codec", ["fp4_e2m1", "fp32"])
@pytest.mark.parametrize("outer", [NesterovOuter, DelayedNesterov, compact])
def test_an_outer_step_makes_no_temporary_of_the_models_size(pull_codec, outer) -> None:
    # Three rounds: Delayed Nesterov has its buffer (not a temporary) and now folds it in.
    made = outer(every=2) if outer is DelayedNesterov else outer()
    fragment = run(pull_codec, rounds=3, outer=made)
    fragment.round.add("a", DenseBody([torch.ones(s) for s in SHAPES]), tokens=1)
    with _NewStorages() as allocations:
        close_round(fragment)
    # Chunks of the update (float32) and the packed 4-bit codes of the largest tensor
    # (half a byte a value, kept for the log) are all it allocates.
    largest_tensor = max(torch.Size(s).numel() for s in SHAPES)
    assert allocations.largest <= max(4 * CHUNK_VALUES, (largest_tensor + 1) // 2)
    assert allocations.largest < MODEL_BYTES / 4


def test_async_holds_one_more_copy_for_delayed_nesterov() -> None:
    """Delayed Nesterov sums the pushes between momentum steps in a buffer of its own."""
    for rounds in (3, 4):  # with and without that buffer pending
        tensors, _ = held(run("fp4_e2m1", rounds=rounds, outer=DelayedNesterov(every=2)))
        assert tensors == (5 if rounds % 2 else 4) * MODEL_BYTES


def test_sparse_pulls_and_the_senders_mean_still_hold_four_copies() -> None:
    """The sparse codecs' step (no momentum, so no momentum buffer) with sparse_mean senders:
    parameters, pull residual, round sum and the senders' weights, and no temporary of the
    model's size at the close."""
    fragment = FragmentState(
        0, [0, 1, 2], SHAPES, NesterovOuter(momentum=0.0), "sparse_2bit", 16,
        sparse_mean="senders",
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    fragment.initialize([torch.randn(s, generator=g) for s in SHAPES])

    def push(learner: str) -> None:
        delta = [torch.randn(s, generator=g) * (torch.rand(s, generator=g) < 0.02) for s in SHAPES]
        fragment.round.add(learner, DenseBody(delta, sparse=True), tokens=1)

    for _ in range(3):
        for learner in ("a", "b", "c"):
            push(learner)
        close_round(fragment)
    push("a")  # a round is open
    assert held(fragment)[0] == 4 * MODEL_BYTES
    with _NewStorages() as allocations:
        close_round(fragment)
    assert allocations.largest < MODEL_BYTES / 4
