"""Hypothesis strategies for messages with random fields, drawn against a live fuzz world.

- `garbage_push`: every header field random (negative and huge integers included), payloads of
  random bytes or of random tensors, chunk sequences reordered, cut or with headers repeated.
  Any refusal code is fine; a crash, a hang or a state change is not.
- `other_rpc`: Join, Heartbeat, Leave and PullParams with random fields (NaN/inf floats,
  mutated fingerprints, unknown sessions and fragments).
- `random_tensor`, `random_payload`: hostile inputs for the decoders too (decoders.py).
"""

from __future__ import annotations

import numpy as np
from google.protobuf.descriptor import FieldDescriptor
from hypothesis import strategies as st

from common.codec.sparse import SPARSE_CODECS, sparse_sizes
from common.codec.tensor import CODECS
from common.generated.diloco.v1 import aggregator_pb2 as pb
from tests.support.fuzz.strategies import ANY, Call, fuzz_session, serialize, stream, with_crc
from tests.support.fuzz.world import FINGERPRINT, GOOD, MALLORY, SPECS, World

INT64 = st.integers(-(2**63), 2**63 - 1)
FLOATS = st.floats(allow_nan=True, allow_infinity=True, width=64)
# Where int64 arithmetic goes wrong: the ends, float64's last exact integer, int32's end.
INT64_EDGES = st.sampled_from([2**63 - 1, -(2**63), 2**63 - 512, 2**53 + 1, 2**31, -1])


@st.composite
def random_tensor(draw, shape: tuple[int, ...]) -> pb.EncodedTensor:
    """An EncodedTensor with any codec and shape, exact or random lengths, any checksum."""
    codec = draw(st.one_of(st.sampled_from(sorted(CODECS.values())), st.integers(-3, 9)))
    dims = draw(st.one_of(st.just(list(shape)), st.lists(st.integers(0, 64), max_size=3)))
    numel = int(np.prod(dims)) if dims else 1
    sparse_k = draw(st.one_of(st.integers(1, 4096), st.integers(0, 2**32 - 1)))
    sizes = {1: (4 * numel, 0), 2: (2 * numel, 0)}.get(
        codec, ((numel + 1) // 2, (numel + 31) // 32)
    )
    if codec in SPARSE_CODECS and 1 <= sparse_k <= 4096:
        sizes = sparse_sizes(codec, numel, sparse_k)
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
    if codec in SPARSE_CODECS or draw(st.integers(0, 9)) == 0:
        t.sparse_k = sparse_k
    return with_crc(t) if draw(st.booleans()) else t


@st.composite
def random_payload(draw, shapes: list[tuple[int, ...]]) -> bytes:
    """Random bytes, or a serialized fragment of random tensors (maybe of the right shapes)."""
    if draw(st.booleans()):
        return draw(st.binary(max_size=400))
    picks = draw(st.lists(st.sampled_from(shapes), min_size=0, max_size=len(shapes) + 1))
    if draw(st.booleans()):
        picks = list(shapes)
    return serialize([draw(random_tensor(s)) for s in picks])


@st.composite
def garbage_push(draw, world: World) -> Call:
    """A push with every field random and its message stream reordered or cut."""
    nfrag = world.scenario.fragments
    fid = draw(st.one_of(st.integers(0, nfrag), st.integers(0, 2**32 - 1)))
    version = world.version(min(fid, nfrag - 1))
    payload = draw(random_payload(world.shapes[min(fid, nfrag - 1)]))
    header = pb.PushHeader(
        session_id=fuzz_session(draw, world),
        fragment_id=fid,
        base_version=draw(st.one_of(st.integers(version - 6, version + 2), INT64)),
        inner_steps=draw(st.one_of(st.integers(-2, 10**4), INT64)),
        tokens=draw(st.one_of(st.integers(-2, 10**7), INT64)),
        kind=draw(st.one_of(st.sampled_from([1, 1, 2]), st.integers(-(2**31), 2**31 - 1))),
        payload_bytes=draw(st.one_of(st.just(len(payload)), st.integers(0, 2**64 - 1))),
    )
    messages = stream(draw, header, payload)
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
    session = fuzz_session(draw, world)
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
