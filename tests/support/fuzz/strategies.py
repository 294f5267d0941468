"""Hypothesis strategies for hostile pushes, drawn against a live fuzz world.

Every strategy returns a `Call` (the RPC, its request, and the status it must get). Here:
`mutated_push`, a well-formed push from `mallory` with exactly one defect (missing header,
header twice, chunk before header, bad kind, unknown session or fragment, base version from
the future or too stale, sizes that lie, truncated or flipped bytes, wrong shapes, counts or
codecs, NaN/inf values or scales, huge values, bad checksum, negative tokens...). Each defect
names the exact status code it must be refused with (or None: accepted). Pushes and other
RPCs with random fields are in garbage.py.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
from hypothesis import strategies as st

from common.codec.fragment import max_fragment_bytes
from common.codec.tensor import CODECS, encode
from common.generated.diloco.v1 import aggregator_pb2 as pb
from tests.support.fuzz.world import GOOD, MALLORY, Scenario, World, small_delta

Code = grpc.StatusCode
ANY = "any"  # accepted or any refusal code (REFUSALS): the call's outcome is not predicted
ACCEPTED = None

scenarios = st.builds(
    Scenario,
    mode=st.sampled_from(["sync", "quorum", "async"]),
    fragments=st.sampled_from([1, 2]),
    pull_codec=st.sampled_from(["fp4_e2m1", "fp4_e3m0", "fp32", "sparse_2bit"]),
    warm=st.booleans(),
    initialized=st.sampled_from([True, True, True, False]),
)


@dataclass
class Call:
    rpc: str
    request: Any  # a message, or for PushFragment the list of messages in the stream
    expect: Any  # None (accepted), a StatusCode, a set of them, or ANY
    label: str  # the family and defect, for the tally


def fuzz_session(draw, world: World) -> str:
    """A session of a learner other than `good`, or any string."""
    known = [sid for learner, sid in sorted(world.sessions.items()) if learner != GOOD]
    return draw(st.one_of(st.sampled_from(known), st.text(max_size=40)))


def with_crc(t: pb.EncodedTensor) -> pb.EncodedTensor:
    crc = zlib.crc32(t.scales, zlib.crc32(t.payload))
    t.crc32 = zlib.crc32(t.sparse_k.to_bytes(4, "little"), crc) if t.sparse_k else crc
    return t


def chunked(draw, payload: bytes) -> list[pb.PushFragmentRequest]:
    """The payload cut at up to 4 random places (empty chunks included)."""
    cuts = sorted(draw(st.lists(st.integers(0, len(payload)), max_size=4)))
    bounds = [0, *cuts, len(payload)]
    pieces = [payload[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    return [pb.PushFragmentRequest(chunk=p) for p in pieces]


def stream(draw, header: pb.PushHeader, payload: bytes) -> list[pb.PushFragmentRequest]:
    return [pb.PushFragmentRequest(header=header), *chunked(draw, payload)]


def serialize(tensors: list[pb.EncodedTensor]) -> bytes:
    return pb.EncodedFragment(tensors=tensors).SerializeToString()


def _shapes_other_than(draw, shape: tuple[int, ...]) -> list[int]:
    dims = st.one_of(st.integers(0, 40), st.integers(0, 2**62))
    return draw(st.lists(dims, max_size=4).filter(lambda s: tuple(s) != tuple(shape)))


@st.composite
def mutated_push(draw, world: World) -> Call:
    """A push by `mallory` against the current version with one defect and its status."""
    scenario = world.scenario
    fid = draw(st.integers(0, scenario.fragments - 1))
    shapes = world.shapes[fid]
    version = world.version(fid)
    codec = draw(st.sampled_from(sorted(CODECS)))
    seed = draw(st.integers(0, 2**16))
    tensors = [encode(t, codec) for t in small_delta(shapes, seed)]
    header = pb.PushHeader(
        session_id=world.sessions[MALLORY],
        fragment_id=fid,
        base_version=version,
        inner_steps=draw(st.integers(1, 10**4)),
        tokens=draw(st.integers(1, 10**7)),
        kind=pb.PUSH_KIND_DELTA,
    )
    limit = max_fragment_bytes(shapes, pb.CODEC_FP32)
    defect = draw(st.sampled_from(DEFECTS))
    i = draw(st.integers(0, len(tensors) - 1))  # the tensor a defect applies to
    t = tensors[i]
    expect = Code.INVALID_ARGUMENT
    messages: list[pb.PushFragmentRequest] | None = None
    if defect == "valid":
        expect = ACCEPTED
    elif defect == "heavy":  # large but finite values with an enormous claimed weight
        factor = 10.0 ** draw(st.integers(0, 14))
        tensors = [encode(t * factor, codec) for t in small_delta(shapes, seed)]
        big = st.one_of(
            st.just(2**63 - 1), st.integers(2**31, 2**63 - 1), st.integers(1, 2**63 - 1)
        )
        header.tokens = draw(big)
        header.inner_steps = draw(st.one_of(st.just(1), st.integers(1, 2**63 - 1)))
        expect = ANY
    elif defect == "bad_kind":
        header.kind = draw(st.integers(-(2**31), 2**31 - 1).filter(lambda k: k not in (1, 2)))
    elif defect == "unknown_session":
        header.session_id = draw(
            st.text(max_size=40).filter(lambda s: s not in world.sessions.values())
        )
        expect = Code.NOT_FOUND
    elif defect == "unknown_fragment":
        header.fragment_id = draw(st.integers(scenario.fragments, 2**32 - 1))
        expect = Code.NOT_FOUND
    elif defect == "future_base":
        header.base_version = draw(st.integers(version + 1, 2**63 - 1))
    elif defect == "stale_base":
        max_staleness = world.aggregator.config.rounds.max_staleness
        header.base_version = draw(st.integers(-(2**63), version - max_staleness - 1))
        expect = Code.FAILED_PRECONDITION
    elif defect == "initial_again":
        header.kind = pb.PUSH_KIND_INITIAL
        expect = Code.ALREADY_EXISTS
    elif defect == "negative_tokens":
        header.tokens = draw(st.integers(-(2**63), -1))
    elif defect == "negative_inner_steps":
        header.inner_steps = draw(st.integers(-(2**63), -1))
    elif defect == "zero_tokens_or_steps":
        setattr(header, draw(st.sampled_from(["tokens", "inner_steps"])), 0)
        expect = ACCEPTED if world.aggregator.config.rounds.weighting == "equal" else expect
    elif defect == "wrong_shape":
        del t.shape[:]
        t.shape.extend(_shapes_other_than(draw, shapes[i]))
        with_crc(t)
    elif defect == "wrong_count":
        if draw(st.booleans()):
            del tensors[i]
        else:
            tensors.insert(i, t)
            expect = {Code.INVALID_ARGUMENT, Code.RESOURCE_EXHAUSTED}  # may pass the size limit
    elif defect == "mixed_codecs":
        other = draw(st.sampled_from(sorted(set(CODECS) - {codec})))
        tensors[i] = encode(small_delta([shapes[i]], seed)[0], other)
    elif defect == "unknown_codec":
        t.codec = draw(st.integers(-(2**31), 2**31 - 1).filter(lambda c: c not in CODECS.values()))
    elif defect == "bad_crc":
        t.crc32 ^= draw(st.integers(1, 2**32 - 1))
    elif defect in ("nonfinite_value", "huge_value"):
        if defect == "nonfinite_value":
            value = draw(st.sampled_from([float("nan"), float("inf"), -float("inf")]))
        else:  # bf16 keeps the top 16 bits: 1.1e12 stays above MAX_DELTA_ABS (1e12)
            value = draw(st.floats(1.1e12, 3.0e38)) * draw(st.sampled_from([1, -1]))
        plain = draw(st.sampled_from(["fp32", "bf16"]))  # one codec for the whole fragment
        tensors = [encode(x, plain) for x in small_delta(shapes, seed)]
        _poke_value(draw, tensors[i], value)
    elif defect == "nan_scale" and draw(st.booleans()):  # sparse: all scale bytes NaN
        sparse = draw(st.just("sparse_2bit"))
        tensors = [encode(x, sparse) for x in small_delta(shapes, seed)]
        tensors[i].scales = b"\xff" * len(tensors[i].scales)
        with_crc(tensors[i])
    elif defect == "sparse_index":  # two equal indices, or one past its chunk's end
        sparse = draw(st.just("sparse_2bit"))
        tensors = [
            encode(x, sparse, sparse_k=draw(st.integers(1, 4096)))
            for x in small_delta(shapes, seed)
        ]
        t = tensors[i]
        a = draw(st.integers(0, 4095))
        first = bytes([a & 0xFF, (a >> 8) | (a & 0xF) << 4, a >> 4])  # entries 0 and 1 both a
        t.payload = first + t.payload[3:] if len(t.payload) >= 5 else b"\xff\x0f" + t.payload[2:]
        with_crc(t)
    elif defect == "nan_scale":
        fp4 = draw(st.sampled_from(["fp4_e2m1", "fp4_e3m0"]))  # one codec for the fragment
        tensors = [encode(x, fp4) for x in small_delta(shapes, seed)]
        t = tensors[i]
        numel = int(np.prod(shapes[i]))
        codes = draw(st.binary(min_size=(numel + 1) // 2, max_size=(numel + 1) // 2))
        scales = bytearray(
            draw(st.binary(min_size=(numel + 31) // 32, max_size=(numel + 31) // 32))
        )
        scales[draw(st.integers(0, len(scales) - 1))] = 255
        t.payload, t.scales = codes, bytes(scales)
        with_crc(t)
    if version == -1 and defect != "bad_kind":
        # A fragment without parameters takes only its initial values, and checks neither
        # base_version, tokens, inner_steps nor magnitudes for them (the first learner's
        # model is taken as it is).
        header.kind = pb.PUSH_KIND_INITIAL
        expect = ACCEPTED if defect in INITIAL_IGNORES else expect
    payload = serialize(tensors)
    if defect == "no_messages":
        messages = []
    elif defect == "chunk_first":
        messages = [
            pb.PushFragmentRequest(chunk=payload[:7]),
            pb.PushFragmentRequest(header=header),
        ]
    elif defect == "header_twice":
        header.payload_bytes = len(payload)
        messages = [pb.PushFragmentRequest(header=header), *stream(draw, header, payload)]
    elif defect == "over_limit":
        header.payload_bytes = draw(st.integers(limit + 1, 2**64 - 1))
        expect = Code.RESOURCE_EXHAUSTED
    elif defect == "announce_short":
        header.payload_bytes = draw(st.integers(0, len(payload) - 1))
    elif defect == "announce_long":
        header.payload_bytes = draw(st.integers(len(payload) + 1, limit))
    elif defect == "truncated":
        payload = payload[: draw(st.integers(0, len(payload) - 1))]
    elif defect == "byte_flip":
        data = bytearray(payload)
        data[draw(st.integers(0, len(data) - 1))] ^= draw(st.integers(1, 255))
        # Some flips parse to the very same message (bits past 32 in a uint32 varint, such as
        # the checksum's last byte, are dropped by the parser): those are fine to accept.
        same = _parses_to(bytes(data), payload)
        payload = bytes(data)
        if same:
            expect = ACCEPTED
    if messages is None:
        if not header.payload_bytes and defect not in ("announce_short",):
            header.payload_bytes = len(payload)
        messages = stream(draw, header, payload)
    return Call("PushFragment", messages, expect, f"mutated:{defect}")


DEFECTS = [
    "valid", "heavy", "no_messages", "chunk_first", "header_twice", "bad_kind", "unknown_session",
    "unknown_fragment", "future_base", "stale_base", "initial_again", "negative_tokens",
    "negative_inner_steps", "zero_tokens_or_steps", "wrong_shape", "wrong_count",
    "mixed_codecs", "unknown_codec", "bad_crc", "nonfinite_value", "huge_value", "nan_scale",
    "sparse_index", "over_limit", "announce_short", "announce_long", "truncated", "byte_flip",
]  # fmt: skip


INITIAL_IGNORES = {
    "future_base", "stale_base", "initial_again", "negative_tokens", "negative_inner_steps",
    "zero_tokens_or_steps", "huge_value",
}  # fmt: skip


def _parses_to(data: bytes, original: bytes) -> bool:
    try:
        return pb.EncodedFragment.FromString(data) == pb.EncodedFragment.FromString(original)
    except Exception:  # noqa: BLE001 - does not parse at all
        return False


def _poke_value(draw, t: pb.EncodedTensor, value: float) -> None:
    """Write `value` into one element of an fp32 or bf16 tensor, with a correct checksum."""
    numel = int(np.prod(tuple(t.shape)))
    values = np.zeros(numel, dtype=np.float32)
    values[draw(st.integers(0, numel - 1))] = value
    if t.codec == pb.CODEC_FP32:
        t.payload = values.tobytes()
    else:  # bf16: the top half of each float32 (inf and NaN survive the cut)
        t.payload = (values.view(np.uint32) >> 16).astype(np.uint16).tobytes()
    t.scales = b""
    with_crc(t)
