"""The push ingest's fast paths: several fp4 pushes added in the kernel's one pass over a sum,
the push budget's held buffers, a round that defers pushes giving the very bits of one that
adds each push as it comes, and chunks read as views as protobuf would read them."""

from __future__ import annotations

import pytest
import torch

from common.codec import native
from common.codec.fp4 import FP4_GRIDS
from common.codec.fragment import encode_fragment
from common.codec.framing import parse_push_request
from common.generated.diloco.v1 import aggregator_pb2 as pb
from server.rounds.ingest import IngestSlot
from server.rounds.outer import NesterovOuter
from server.rounds.round import DEFERRED_PUSHES
from server.rpc.receive import PushBudget, receive_into, wire_bytes
from server.state.fragment import FragmentState
from tests.support.fakes import close_round

E2M1 = FP4_GRIDS[pb.CODEC_FP4_E2M1]
E3M0 = FP4_GRIDS[pb.CODEC_FP4_E3M0]


@pytest.fixture(scope="module")
def kernel() -> native.Kernel:
    kernel = native.load()
    assert kernel is not None, "the C kernel must build on the CI machine"
    return kernel


def _packed(numel: int, seed: int) -> tuple[bytes, bytes]:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, ((numel + 1) // 2,), generator=gen, dtype=torch.uint8)
    scales = torch.randint(100, 140, ((numel + 31) // 32,), generator=gen, dtype=torch.uint8)
    return codes.numpy().tobytes(), scales.numpy().tobytes()


# Past one tile of the kernel (16,384 values), with a partial tile and a partial block.
@pytest.mark.parametrize("numel", [1, 33, 16_384, 40_001])
def test_pushes_added_in_one_pass_equal_one_call_each(kernel, numel: int) -> None:
    mode = kernel.torch_add_mode()
    assert mode is not None
    parts = [
        native.FP4Add(*_packed(numel, seed), grid, weight, mode)
        for seed, grid, weight in [(1, E2M1, 0.3701), (2, E3M0, 1 / 3), (3, E2M1, 7.77e5)]
    ]
    first = native.FP4Add(*_packed(numel, 4), E2M1, 0.25, native.ACC_SET)
    start = torch.randn(numel, generator=torch.Generator().manual_seed(5))
    one_by_one = start.clone()
    for p in [first, *parts]:
        assert (
            kernel.accumulate(p.payload, p.scales, numel, p.grid, p.weight, p.mode, one_by_one) == 0
        )
    together = start.clone()
    assert kernel.accumulate_many([first, *parts], numel, together) == 0
    assert torch.equal(together.view(torch.int32), one_by_one.view(torch.int32))


def test_a_nan_scale_in_any_push_leaves_the_sum_untouched(kernel) -> None:
    numel, mode = 40_001, kernel.torch_add_mode()
    good = native.FP4Add(*_packed(numel, 1), E2M1, 0.5, mode)
    codes, scales = _packed(numel, 2)
    bad = native.FP4Add(codes, scales[:-1] + b"\xff", E2M1, 0.5, mode)  # last block
    out = torch.randn(numel)
    before = out.clone()
    assert kernel.accumulate_many([good, bad], numel, out) == -1
    assert torch.equal(out, before)
    with pytest.raises(ValueError, match="payload"):  # short buffers never reach the C code
        kernel.accumulate_many([good, native.FP4Add(codes[:-1], scales, E2M1, 1, mode)],
                               numel, out)  # fmt: skip


def test_a_held_buffer_stays_counted_until_released_and_is_given_back_once() -> None:
    budget = PushBudget(100, wait_s=0.0, keep=4)
    with budget.reserve(40) as view:
        release = budget.hold(view)
        assert release is not None and budget.hold(view) is None  # held once
    assert budget.held_bytes() == 40 and budget.reserved_bytes() == 40
    with budget.reserve(50) as other:
        assert budget.hold(other) is None  # 40 + 50 held would pass half the budget
    release()
    release()  # a second release changes nothing
    assert budget.held_bytes() == 0 and budget.reserved_bytes() == 90  # both kept for reuse
    with budget.reserve(40) as view:  # released while its block still runs
        budget.hold(view)()
    assert budget.held_bytes() == 0 and budget.reserved_bytes() == 90
    assert budget.hold(memoryview(bytearray(10))) is None  # not a reservation


def _fp4_push(seed: int, shapes: list[tuple[int, ...]]) -> bytes:
    g = torch.Generator().manual_seed(seed)
    return encode_fragment([torch.randn(s, generator=g) * 1e-2 for s in shapes], "fp4_e2m1")


def _run_round(
    shapes, pushes: list[bytes], budget: PushBudget | None, add_later: bool = False
) -> FragmentState:
    """One round of `pushes`; with `add_later`, as the aggregator adds them: a push whose add
    was queued runs the queue after its call (server/rounds/round.py), its buffer still held."""
    fragment = FragmentState(0, [0, 1], shapes, NesterovOuter(), "fp32", 16)
    fragment.initialize([torch.zeros(s) for s in shapes])
    slot = IngestSlot()
    for i, payload in enumerate(pushes):
        if budget is None:
            body = slot.parse(payload, shapes)
            fragment.round.add(f"l{i}", body, tokens=1, weight=1.0 + i / 7)
            continue
        with budget.reserve(len(payload)) as view:
            receive_into(view, [payload])
            body = slot.parse(view, shapes, hold=lambda view=view: budget.hold(view))
            adds = fragment.round.adds
            ticket = fragment.round.add(
                f"l{i}", body, tokens=1, weight=1.0 + i / 7, add_later=add_later
            )
            # The first push starts the sum; each later batch is the held ones and one more.
            assert (ticket is not None) == (add_later and i > 0 and i % (DEFERRED_PUSHES + 1) == 0)
            if ticket is not None:
                adds.run()
                ticket.check()
    return fragment


@pytest.mark.parametrize("add_later", [False, True])
def test_a_round_that_defers_pushes_ends_with_the_same_bits(kernel, add_later) -> None:
    shapes = [(300, 211), (5,)]
    pushes = [_fp4_push(seed, shapes) for seed in range(2 * DEFERRED_PUSHES + 2)]
    budget = PushBudget(64 << 20, wait_s=0.0)
    deferring = _run_round(shapes, pushes, budget, add_later)
    held = len(deferring.round.deferred)
    assert held > 0 and budget.held_bytes() == held * len(pushes[0])
    reference = _run_round(shapes, pushes, None)  # no holder: every push added at once
    assert not reference.round.deferred
    close_round(deferring)
    close_round(reference)
    assert budget.held_bytes() == 0  # the close added and released them
    for a, b in zip(deferring.params or [], reference.params or [], strict=True):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize(
    "message",
    [
        pb.PushFragmentRequest(chunk=b"x" * 300),  # a two-byte length
        pb.PushFragmentRequest(chunk=b""),
        pb.PushFragmentRequest(header=pb.PushHeader(fragment_id=3, payload_bytes=9)),
        pb.PushFragmentRequest(),
    ],
)
def test_push_messages_read_as_protobuf_does(message: pb.PushFragmentRequest) -> None:
    data = message.SerializeToString()
    read = parse_push_request(data)
    if message.WhichOneof("part") == "chunk":
        assert isinstance(read, memoryview) and bytes(read) == message.chunk
    else:
        assert read == message
    assert wire_bytes(read) == len(data)


@pytest.mark.parametrize(
    "data",
    [
        b"\x12\x05abc",  # a length past the end
        b"\x12\x02abc",  # bytes after the field
        b"\x12\x01a\x12\x01b",  # the field twice: protobuf keeps the last
        b"\x12\x01a\x18\x01",  # an unknown field after it
        b"\x12" + b"\xff" * 11,  # a varint longer than any
        b"\x12\x85\x80\x80\x80\x80\x00abcde",  # a length longer than protobuf reads
    ],
)
def test_other_messages_go_to_protobufs_parser(data: bytes) -> None:
    try:
        expected = pb.PushFragmentRequest.FromString(data)
    except Exception as err:  # noqa: BLE001 - whatever protobuf raises, the same is raised
        with pytest.raises(type(err)):
            parse_push_request(data)
        return
    assert parse_push_request(data) == expected


def test_a_push_that_finds_no_room_has_the_held_buffers_given_back_first() -> None:
    releases = []
    budget = PushBudget(100, wait_s=0.0, keep=0, drain=lambda: [r() for r in releases])
    with budget.reserve(40) as view:
        releases.append(budget.hold(view))
    assert budget.held_bytes() == 40
    with budget.reserve(70):  # fits only once the held 40 bytes are back
        assert budget.held_bytes() == 0


class _FailingBody:
    """A push whose add fails (a bug, not bad input)."""

    shapes, max_abs, norm = [(300, 211), (5,)], 0.0, 0.0

    def defer(self) -> bool:
        return False

    def combinable(self) -> bool:
        return False

    def release(self) -> None:
        pass

    def add_to(self, sums, scale, overwrite=False):
        raise RuntimeError("add failed")


def test_a_failed_add_leaves_no_deferred_push_behind(kernel) -> None:
    shapes = [(300, 211), (5,)]
    budget = PushBudget(64 << 20, wait_s=0.0)
    fragment = _run_round(shapes, [_fp4_push(seed, shapes) for seed in range(3)], budget)
    assert len(fragment.round.deferred) == 2
    with pytest.raises(RuntimeError, match="add failed"):
        fragment.round.add("bad", _FailingBody(), tokens=1)  # type: ignore[arg-type]
    assert not fragment.round.deferred and budget.held_bytes() == 0  # never added twice
