"""Hypothesis strategies for hostile messages, drawn against a live fuzz world.

Three families, each a `Call` (the RPC, its request, and the status it must get):

- `mutated_push`: a well-formed push from `mallory` with exactly one defect (missing header,
  header twice, chunk before header, bad kind, unknown session or fragment, base version from
  the future or too stale, sizes that lie, truncated or flipped bytes, wrong shapes, counts or
  codecs, NaN/inf values or scales, huge values, bad checksum, negative tokens...). Each defect
  names the exact status code it must be refused with (or None: accepted).
- `garbage_push`: every header field random (negative and huge integers included), payloads of
  random bytes or of random tensors, chunk sequences reordered, cut or with headers repeated.
  Any refusal code is fine; a crash, a hang or a state change is not.
- `other_rpc`: Join, Heartbeat, Leave and PullParams with random fields (NaN/inf floats,
  mutated fingerprints, unknown sessions and fragments).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
from google.protobuf.descriptor import FieldDescriptor
from hypothesis import strategies as st

from bench.fuzz_world import FINGERPRINT, GOOD, MALLORY, SPECS, Scenario, World, small_delta
from common.codec import CODECS, encode
from common.generated.diloco.v1 import aggregator_pb2 as pb
from common.wire import max_fragment_bytes

Code = grpc.StatusCode
ANY = "any"  # accepted or any refusal code (REFUSALS): the call's outcome is not predicted
ACCEPTED = None
INT64 = st.integers(-(2**63), 2**63 - 1)
FLOATS = st.floats(allow_nan=True, allow_infinity=True, width=64)
# Where int64 arithmetic goes wrong: the ends, float64's last exact integer, int32's end.
INT64_EDGES = st.sampled_from([2**63 - 1, -(2**63), 2**63 - 512, 2**53 + 1, 2**31, -1])

scenarios = st.builds(
    Scenario,
    mode=st.sampled_from(["sync", "quorum", "async"]),
    fragments=st.sampled_from([1, 2]),
    pull_codec=st.sampled_from(["fp4_e2m1", "fp4_e3m0", "fp32"]),
    warm=st.booleans(),
    initialized=st.sampled_from([True, True, True, False]),
)


@dataclass
class Call:
    rpc: str
    request: Any  # a message, or for PushFragment the list of messages in the stream
    expect: Any  # None (accepted), a StatusCode, a set of them, or ANY
    label: str  # the family and defect, for the tally


def _fuzz_session(draw, world: World) -> str:
    """A session of a learner other than `good`, or any string."""
    known = [sid for learner, sid in sorted(world.sessions.items()) if learner != GOOD]
    return draw(st.one_of(st.sampled_from(known), st.text(max_size=40)))


def _with_crc(t: pb.EncodedTensor) -> pb.EncodedTensor:
    t.crc32 = zlib.crc32(t.scales, zlib.crc32(t.payload))
    return t


def _chunked(draw, payload: bytes) -> list[pb.PushFragmentRequest]:
    """The payload cut at up to 4 random places (empty chunks included)."""
    cuts = sorted(draw(st.lists(st.integers(0, len(payload)), max_size=4)))
    bounds = [0, *cuts, len(payload)]
    pieces = [payload[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    return [pb.PushFragmentRequest(chunk=p) for p in pieces]


def _stream(draw, header: pb.PushHeader, payload: bytes) -> list[pb.PushFragmentRequest]:
    return [pb.PushFragmentRequest(header=header), *_chunked(draw, payload)]


def _serialize(tensors: list[pb.EncodedTensor]) -> bytes:
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
        max_staleness = world.aggregator.config.max_staleness
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
        expect = ACCEPTED if world.aggregator.config.weighting == "equal" else expect
    elif defect == "wrong_shape":
        del t.shape[:]
        t.shape.extend(_shapes_other_than(draw, shapes[i]))
        _with_crc(t)
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
        _with_crc(t)
    if version == -1 and defect != "bad_kind":
        # A fragment without parameters takes only its initial values, and checks neither
        # base_version, tokens, inner_steps nor magnitudes for them (the first learner's
        # model is taken as it is).
        header.kind = pb.PUSH_KIND_INITIAL
        expect = ACCEPTED if defect in INITIAL_IGNORES else expect
    payload = _serialize(tensors)
    if defect == "no_messages":
        messages = []
    elif defect == "chunk_first":
        messages = [
            pb.PushFragmentRequest(chunk=payload[:7]),
            pb.PushFragmentRequest(header=header),
        ]
    elif defect == "header_twice":
        header.payload_bytes = len(payload)
        messages = [pb.PushFragmentRequest(header=header), *_stream(draw, header, payload)]
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
        messages = _stream(draw, header, payload)
    return Call("PushFragment", messages, expect, f"mutated:{defect}")


DEFECTS = [
    "valid", "heavy", "no_messages", "chunk_first", "header_twice", "bad_kind", "unknown_session",
    "unknown_fragment", "future_base", "stale_base", "initial_again", "negative_tokens",
    "negative_inner_steps", "zero_tokens_or_steps", "wrong_shape", "wrong_count",
    "mixed_codecs", "unknown_codec", "bad_crc", "nonfinite_value", "huge_value", "nan_scale",
    "over_limit", "announce_short", "announce_long", "truncated", "byte_flip",
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
    _with_crc(t)


@st.composite
def random_tensor(draw, shape: tuple[int, ...]) -> pb.EncodedTensor:
    """An EncodedTensor with any codec and shape, exact or random lengths, any checksum."""
    codec = draw(st.one_of(st.sampled_from(sorted(CODECS.values())), st.integers(-3, 9)))
    dims = draw(st.one_of(st.just(list(shape)), st.lists(st.integers(0, 64), max_size=3)))
    numel = int(np.prod(dims)) if dims else 1
    sizes = {1: (4 * numel, 0), 2: (2 * numel, 0)}.get(
        codec, ((numel + 1) // 2, (numel + 31) // 32)
    )
    exact = draw(st.booleans())
    payload = draw(
        st.binary(min_size=sizes[0], max_size=sizes[0]) if exact else st.binary(max_size=300)
    )
    scale_byte = st.one_of(st.integers(100, 135), st.integers(0, 255))
    scales = (
        bytes(draw(st.lists(scale_byte, min_size=sizes[1], max_size=sizes[1])))
        if exact
        else draw(st.binary(max_size=12))
    )
    t = pb.EncodedTensor(codec=codec, shape=dims, payload=payload, scales=scales)
    return _with_crc(t) if draw(st.booleans()) else t


@st.composite
def random_payload(draw, shapes: list[tuple[int, ...]]) -> bytes:
    """Random bytes, or a serialized fragment of random tensors (maybe of the right shapes)."""
    if draw(st.booleans()):
        return draw(st.binary(max_size=400))
    picks = draw(st.lists(st.sampled_from(shapes), min_size=0, max_size=len(shapes) + 1))
    if draw(st.booleans()):
        picks = list(shapes)
    return _serialize([draw(random_tensor(s)) for s in picks])


@st.composite
def garbage_push(draw, world: World) -> Call:
    """A push with every field random and its message stream reordered or cut."""
    nfrag = world.scenario.fragments
    fid = draw(st.one_of(st.integers(0, nfrag), st.integers(0, 2**32 - 1)))
    version = world.version(min(fid, nfrag - 1))
    payload = draw(random_payload(world.shapes[min(fid, nfrag - 1)]))
    header = pb.PushHeader(
        session_id=_fuzz_session(draw, world),
        fragment_id=fid,
        base_version=draw(st.one_of(st.integers(version - 6, version + 2), INT64)),
        inner_steps=draw(st.one_of(st.integers(-2, 10**4), INT64)),
        tokens=draw(st.one_of(st.integers(-2, 10**7), INT64)),
        kind=draw(st.one_of(st.sampled_from([1, 1, 2]), st.integers(-(2**31), 2**31 - 1))),
        payload_bytes=draw(st.one_of(st.just(len(payload)), st.integers(0, 2**64 - 1))),
    )
    messages = _stream(draw, header, payload)
    for _ in range(draw(st.integers(0, 2))):
        op = draw(st.sampled_from(["swap", "drop", "header", "chunk"]))
        at = draw(st.integers(0, len(messages)))
        if op == "swap" and len(messages) >= 2:
            j = min(at, len(messages) - 2)
            messages[j], messages[j + 1] = messages[j + 1], messages[j]
        elif op == "drop" and messages:
            del messages[min(at, len(messages) - 1)]
        elif op == "header":
            messages.insert(at, pb.PushFragmentRequest(header=header))
        elif op == "chunk":
            messages.insert(at, pb.PushFragmentRequest(chunk=draw(st.binary(max_size=64))))
    return Call("PushFragment", messages, ANY, "garbage:push")


@st.composite
def fingerprints(draw) -> list[pb.ParamSpec]:
    """The run's fingerprint, a mutation of it, or random parameter specs."""
    specs = [pb.ParamSpec(name=n, shape=s, dtype="float32") for n, s in SPECS]
    how = draw(st.sampled_from(["same", "drop", "shape", "dtype", "name", "random"]))
    i = draw(st.integers(0, len(specs) - 1))
    if how == "drop":
        del specs[i]
    elif how == "shape":
        specs[i].shape[:] = draw(st.lists(st.integers(-(2**63), 2**63 - 1), max_size=4))
    elif how == "dtype":
        specs[i].dtype = draw(st.text(max_size=10))
    elif how == "name":
        specs[i].name = draw(st.sampled_from(["", specs[(i + 1) % len(specs)].name, "x"]))
    elif how == "random":
        dims = st.lists(st.one_of(st.integers(-2, 64), INT64), max_size=3)
        specs = draw(
            st.lists(
                st.builds(
                    pb.ParamSpec, name=st.text(max_size=8), shape=dims, dtype=st.text(max_size=8)
                ),
                max_size=6,
            )
        )
    return specs


_SCALARS = {
    FieldDescriptor.TYPE_INT64: st.one_of(st.integers(-2, 10), INT64, INT64_EDGES),
    FieldDescriptor.TYPE_INT32: st.integers(-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_UINT64: st.integers(0, 2**64 - 1),
    FieldDescriptor.TYPE_UINT32: st.integers(0, 2**32 - 1),
    FieldDescriptor.TYPE_DOUBLE: st.one_of(FLOATS, st.sampled_from([5e-324, 1e-300, 1e300])),
    FieldDescriptor.TYPE_FLOAT: st.floats(width=32),
    FieldDescriptor.TYPE_BOOL: st.booleans(),
    FieldDescriptor.TYPE_STRING: st.text(max_size=20),
    FieldDescriptor.TYPE_BYTES: st.binary(max_size=20),
    FieldDescriptor.TYPE_ENUM: st.integers(-(2**31), 2**31 - 1),
}


@st.composite
def any_fields(draw, message_cls, **fixed: st.SearchStrategy):
    """A message with every scalar field random for its type (fields added to the proto later
    are fuzzed too); `fixed` gives the strategy of named fields."""
    values = {}
    for f in message_cls.DESCRIPTOR.fields:
        if f.name in fixed:
            values[f.name] = draw(fixed[f.name])
        elif not f.is_repeated and f.type in _SCALARS:
            values[f.name] = draw(_SCALARS[f.type])
    return message_cls(**values)


@st.composite
def other_rpc(draw, world: World) -> Call:
    """Join, Heartbeat, Leave or PullParams with random fields."""
    rpc = draw(st.sampled_from(["Join", "Heartbeat", "Leave", "PullParams"]))
    session = _fuzz_session(draw, world)
    if rpc == "Join":
        learner = draw(st.one_of(st.sampled_from([MALLORY, "eve"]), st.text(max_size=20)))
        request = pb.JoinRequest(
            learner_id=GOOD + "?" if learner == GOOD else learner,
            fingerprint=draw(st.one_of(st.just(FINGERPRINT), fingerprints())),
            codecs=draw(st.lists(st.integers(-(2**31), 2**31 - 1), max_size=5)),
        )
    elif rpc == "Heartbeat":
        request = draw(any_fields(pb.HeartbeatRequest, session_id=st.just(session)))
    elif rpc == "Leave":
        request = pb.LeaveRequest(session_id=session)
    else:
        nfrag = world.scenario.fragments
        small = st.integers(-2, 8)
        request = draw(
            any_fields(
                pb.PullParamsRequest,
                session_id=st.just(session),
                fragment_id=st.one_of(st.integers(0, nfrag), st.integers(0, 2**32 - 1)),
                have_version=st.one_of(small, INT64),
                wait_for_version=st.one_of(small, INT64),
            )
        )
    return Call(rpc, request, ANY, f"rpc:{rpc}")
