"""One fuzz case for the decoders: hostile bytes to decode_fragment, decode and apply_updates.

Each returns well-formed float32 tensors (the expected shapes, finite values) or raises
InvalidArgument/ResourceExhausted, never anything else, within CALL_TIMEOUT_S; apply_updates
leaves the replica untouched when it refuses. A quarter of the cases feed a well-formed sparse
tensor with one forgery (sparse_forgery.py) to one of the three, as a push or as a pull's
update; the forgeries the sparse checks must catch have to be refused.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable

import torch
from hypothesis import strategies as st

from common.codec.fragment import apply_updates, decode_fragment, encode_fragment
from common.codec.tensor import CODECS, decode
from common.errors import DilocoError, InvalidArgument, ResourceExhausted
from common.generated.diloco.v1 import aggregator_pb2 as pb
from tests.support.fuzz.cases import CaseReport
from tests.support.fuzz.garbage import random_payload, random_tensor
from tests.support.fuzz.sparse_forgery import MUST_REFUSE, forged_sparse
from tests.support.fuzz.strategies import serialize
from tests.support.fuzz.world import CALL_TIMEOUT_S, SPECS, small_delta


def run_decoder_case(draw: Callable) -> CaseReport:
    """decode_fragment, decode and apply_updates on hostile bytes; see the module docstring."""
    report = CaseReport()
    if draw(st.integers(0, 3)) == 0:
        return _forged_sparse_case(draw, report)
    shapes = draw(
        st.one_of(
            st.just([s for _, s in SPECS]),
            st.lists(st.lists(st.integers(0, 40), max_size=3).map(tuple), min_size=1, max_size=3),
        )
    )
    which = draw(st.sampled_from(["decode_fragment", "decode", "apply_updates"]))
    if which == "decode_fragment":
        data = draw(st.one_of(random_payload(shapes), _mutated_bytes(shapes)))
        _check_decoder(report, which, lambda: decode_fragment(data, shapes), shapes)
    elif which == "decode":
        msg = draw(random_tensor(shapes[0]))
        expected = draw(st.sampled_from([shapes[0], None]))
        want = None if expected is None else [expected]
        _check_decoder(report, which, lambda: [decode(msg, expected)], want)
    else:
        replica = small_delta(shapes, draw(st.integers(0, 2**16)))
        before = [t.clone() for t in replica]
        have = draw(st.integers(-2, 5))
        updates = [draw(random_payload(shapes)) for _ in range(draw(st.integers(0, 3)))]
        chain = pb.FragmentUpdates(
            from_version=draw(st.sampled_from([have, have + 1, -(2**63)])),
            updates=[_parse_or_empty(u) for u in updates],
        ).SerializeToString()
        data = draw(st.one_of(st.just(chain), st.binary(max_size=200)))
        refused = _check_decoder(report, which, lambda: apply_updates(replica, data, have), None)
        if refused and not all(torch.equal(a, b) for a, b in zip(before, replica, strict=True)):
            report.violations.append("state_change: refused update chain changed the replica")
    return report


def _forged_sparse_case(draw: Callable, report: CaseReport) -> CaseReport:
    """One forged sparse tensor through decode, decode_fragment or apply_updates."""
    forgery, t = draw(forged_sparse())
    shape = tuple(t.shape)
    which = draw(st.sampled_from(["decode", "decode_fragment", "apply_updates"]))
    label = f"sparse_{forgery}:{which}"
    replica = small_delta([shape], 0)
    before = replica[0].clone()
    if which == "decode":
        refused = _check_decoder(report, label, lambda: [decode(t, shape)], [shape])
    elif which == "decode_fragment":
        data = serialize([t])
        refused = _check_decoder(report, label, lambda: decode_fragment(data, [shape]), [shape])
    else:
        chain = pb.FragmentUpdates(from_version=3, updates=[pb.EncodedFragment(tensors=[t])])
        data = chain.SerializeToString()
        refused = _check_decoder(report, label, lambda: apply_updates(replica, data, 3), None)
        if refused and not torch.equal(before, replica[0]):
            report.violations.append(f"state_change: {label} changed the replica")
    if forgery in MUST_REFUSE and not refused:
        report.violations.append(f"wrong_status: {label} was accepted")
    return report


def _parse_or_empty(data: bytes) -> pb.EncodedFragment:
    try:
        return pb.EncodedFragment.FromString(data)
    except Exception:  # noqa: BLE001 - random bytes: use an empty update instead
        return pb.EncodedFragment()


@st.composite
def _mutated_bytes(draw, shapes: list[tuple[int, ...]]) -> bytes:
    """A valid fragment encoding, then truncated, extended or with bytes flipped."""
    codec = draw(st.sampled_from(sorted(CODECS)))
    data = bytearray(encode_fragment(small_delta(shapes, draw(st.integers(0, 2**16))), codec))
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["flip", "cut", "extend"]))
        if op == "flip" and data:
            data[draw(st.integers(0, len(data) - 1))] ^= draw(st.integers(1, 255))
        elif op == "cut":
            del data[draw(st.integers(0, len(data))) :]
        else:
            data += draw(st.binary(max_size=16))
    return bytes(data)


def _check_decoder(report: CaseReport, name: str, fn: Callable, shapes) -> bool:
    """Run fn bounded in time; True when it refused the input cleanly."""
    report.labels.append(name if ":" in name else f"decoder:{name}")
    started = time.perf_counter()
    try:
        result = fn()
    except (InvalidArgument, ResourceExhausted) as err:
        report.codes.append(err.code.name)
        return True
    except DilocoError as err:
        report.violations.append(f"wrong_status: {name} raised {type(err).__name__}: {err}")
        return True
    except Exception:  # noqa: BLE001 - anything else is a crash
        report.violations.append(f"crash: {name}: {traceback.format_exc()}")
        return True
    finally:
        elapsed = time.perf_counter() - started
        report.max_call_s = max(report.max_call_s, elapsed)
        if elapsed > CALL_TIMEOUT_S:
            report.violations.append(f"hang: {name} took {elapsed:.1f} s")
    report.codes.append("accepted")
    if isinstance(result, list):
        got = [tuple(t.shape) for t in result]
        if shapes is not None and got != [tuple(s) for s in shapes]:
            report.violations.append(f"wrong_result: {name} returned shapes {got}, not {shapes}")
        if not all(t.dtype == torch.float32 and bool(torch.isfinite(t).all()) for t in result):
            report.violations.append(f"wrong_result: {name} returned non-finite or non-fp32")
    return False
