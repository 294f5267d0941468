"""A small, fresh aggregator for one fuzz case, a bit-exact digest of its state, and bounded calls.

    world = build_world(Scenario(mode="sync", fragments=2, pull_codec="fp4_e2m1"))
    before = state_digest(world.aggregator)
    outcome = call_direct(world.servicer, "PushFragment", [msg, ...])   # never hangs forever
    assert outcome.code is None or state_digest(world.aggregator) == before

Every fuzz case gets its own world, so a case cannot leak into the next one and hypothesis can
replay it exactly. The world has two learners: `good`, which only ever sends well-formed
messages, and `mallory`, whose session the fuzzer uses. Both have pushed for two rounds, so
each fragment has a version > 0, outer momentum, an update log and a warm norm guard, and no
round is open (a scenario with warm=False skips those rounds: the state right after
initialization). The clock is a FakeClock: it stands still during a call and moves only when
the fuzzer says so between calls (`World.advance`, which then runs the reaper's tick).

The digest reads the Aggregator's private parts on purpose: the property under test is that
a rejected message changes *nothing*, and the public API would hide exactly the state a bug
would touch (round sums, momentum, error-feedback residual, norm history).
"""

from __future__ import annotations

import contextlib
import struct
import time
import traceback
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import grpc
import torch

from common.codec.fragment import encode_fragment
from common.generated.diloco.v1 import aggregator_pb2 as pb
from server.aggregator import Aggregator
from server.config import aggregator_config
from server.rpc import servicer as servicer_module
from server.rpc.servicer import AggregatorServicer

# Parameter names use `h.i.` so the strided layout can split them into two fragments; sizes are
# odd on purpose (FP4 pads the last byte and the last block of 32).
SPECS = [
    ("h.0.w", (4, 9)),
    ("h.0.b", (7,)),
    ("h.1.w", (33,)),
    ("h.1.b", (1, 5)),
    ("head", (3,)),
]
FINGERPRINT = [pb.ParamSpec(name=n, shape=s, dtype="float32") for n, s in SPECS]
DELTA_SCALE = 0.01  # typical pseudo-gradient values; the norm guard learns this scale
FROZEN_CLOCK_S = 1000.0
CALL_TIMEOUT_S = 10.0  # a call that takes longer than this counts as a hang
PULL_WAIT_CAP_S = 0.05  # servicer.MAX_PULL_WAIT_S during fuzzing (a long-poll is not a hang)
GOOD, MALLORY = "good", "mallory"
WARMUP_ROUNDS = 2


@dataclass(frozen=True)
class Scenario:
    mode: str = "sync"
    fragments: int = 1
    pull_codec: str = "fp4_e2m1"
    warm: bool = True
    """Run WARMUP_ROUNDS before fuzzing (else: version 0, no momentum, a cold norm guard)."""
    initialized: bool = True
    """Push every fragment's initial parameters (else: the learners joined, nothing more)."""


@dataclass
class FakeClock:
    now_s: float = FROZEN_CLOCK_S

    def __call__(self) -> float:
        return self.now_s


@dataclass
class World:
    scenario: Scenario
    aggregator: Aggregator
    servicer: AggregatorServicer
    sessions: dict[str, str]  # learner id -> session id
    shapes: list[list[tuple[int, ...]]]  # per fragment
    clock: FakeClock

    def version(self, fragment_id: int) -> int:
        return self.aggregator.version(fragment_id)

    def advance(self, seconds: float) -> None:
        """Let time pass between calls, then do what the server's reaper does every tick
        (expire leases, close rounds whose grace window is over)."""
        self.clock.now_s += seconds
        self.aggregator.tick()


@dataclass
class Outcome:
    """What one call did: accepted (code None), aborted with a status, crashed or hung."""

    code: grpc.StatusCode | None = None
    details: str = ""
    crash: str = ""  # traceback of an exception other than the servicer's abort
    hang: bool = False
    elapsed_s: float = 0.0
    response: Any = None


@dataclass
class _Aborted(Exception):
    code: grpc.StatusCode
    details: str


@dataclass
class FakeContext:
    """The part of grpc.ServicerContext the servicer uses; abort raises, as grpc's does."""

    aborted: list[tuple[grpc.StatusCode, str]] = field(default_factory=list)

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.aborted.append((code, details))
        raise _Aborted(code, details)

    def is_active(self) -> bool:
        return True

    def add_callback(self, callback) -> bool:
        return True  # a direct call never ends from outside

    def invocation_metadata(self) -> tuple:
        return ()


@contextlib.contextmanager
def pull_wait_capped(cap_s: float = PULL_WAIT_CAP_S) -> Iterator[None]:
    """Shorten the servicer's long-poll limit: a fuzzed PullParams may legitimately wait that
    long, and at 60 s it would pass for a hang. Restored on exit."""
    with mock.patch.object(servicer_module, "MAX_PULL_WAIT_S", cap_s):
        yield


def small_delta(shapes: list[tuple[int, ...]], seed: int) -> list[torch.Tensor]:
    """A plausible pseudo-gradient: values around DELTA_SCALE, reproducible from `seed`."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen) * DELTA_SCALE for s in shapes]


def push_messages(
    session_id: str,
    fragment_id: int,
    base_version: int,
    payload: bytes,
    kind: int = pb.PUSH_KIND_DELTA,
    tokens: int = 1000,
    inner_steps: int = 10,
) -> list[pb.PushFragmentRequest]:
    """A well-formed push: the header, then the payload in one chunk."""
    header = pb.PushHeader(
        session_id=session_id,
        fragment_id=fragment_id,
        base_version=base_version,
        inner_steps=inner_steps,
        tokens=tokens,
        kind=kind,
        payload_bytes=len(payload),
    )
    return [pb.PushFragmentRequest(header=header), pb.PushFragmentRequest(chunk=payload)]


def build_world(scenario: Scenario) -> World:
    """Two learners joined, every fragment initialized and WARMUP_ROUNDS rounds applied
    (fewer steps as the scenario says)."""
    config = aggregator_config(
        mode=scenario.mode,
        fragments=scenario.fragments,
        pull_codec=scenario.pull_codec,
        lease_s=60.0,
    )
    clock = FakeClock()
    aggregator = Aggregator(config, clock=clock)
    servicer = AggregatorServicer(aggregator)
    sessions = {}
    for learner in (GOOD, MALLORY):
        reply = _must(
            call_direct(
                servicer, "Join", pb.JoinRequest(learner_id=learner, fingerprint=FINGERPRINT)
            )
        )
        sessions[learner] = reply.session_id
    spec_shapes = [s for _, s in SPECS]
    shapes = [[spec_shapes[i] for i in indices] for _, indices, _ in aggregator.layout()]
    world = World(scenario, aggregator, servicer, sessions, shapes, clock)
    if not scenario.initialized:
        return world
    for fid, fshapes in enumerate(shapes):
        initial = encode_fragment([torch.ones(s) for s in fshapes], "fp32")
        msgs = push_messages(sessions[GOOD], fid, -1, initial, kind=pb.PUSH_KIND_INITIAL)
        _must(call_direct(servicer, "PushFragment", msgs))
    for step in range(WARMUP_ROUNDS if scenario.warm else 0):
        for fid in range(len(shapes)):
            for n, learner in enumerate((GOOD, MALLORY)):
                good_push(world, learner, fid, seed=100 * step + 10 * fid + n)
    return world


def good_push(world: World, learner: str, fragment_id: int, seed: int) -> Outcome:
    """A well-formed FP4 pseudo-gradient against the current version; raises if refused."""
    payload = encode_fragment(small_delta(world.shapes[fragment_id], seed), "fp4_e2m1")
    base = world.version(fragment_id)
    msgs = push_messages(world.sessions[learner], fragment_id, base, payload)
    outcome = call_direct(world.servicer, "PushFragment", msgs)
    _must(outcome)
    return outcome


def _must(outcome: Outcome) -> Any:
    if outcome.code is not None or outcome.crash or outcome.hang:
        raise RuntimeError(f"a well-formed call failed: {outcome}")
    return outcome.response


def call_direct(
    servicer: AggregatorServicer, rpc: str, request: Any, timeout_s: float | None = None
) -> Outcome:
    """Call a servicer method as gRPC would; bounded by `timeout_s` on a worker thread (past
    it, a hang), or inline when None (for the world's own well-formed calls).

    PushFragment takes a list of messages (its request stream); PullParams' response stream
    is drained inside the bound.
    """
    if timeout_s is None:
        return _call(servicer, rpc, request)
    global _worker
    if _worker is None:
        _worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fuzz-call")
    future = _worker.submit(_call, servicer, rpc, request)
    try:
        return future.result(timeout=timeout_s)
    except FutureTimeout:
        # The stuck thread keeps its worker; later calls get a fresh one.
        _worker.shutdown(wait=False)
        _worker = None
        return Outcome(hang=True, elapsed_s=timeout_s)


_worker: ThreadPoolExecutor | None = None


def _call(servicer: AggregatorServicer, rpc: str, request: Any) -> Outcome:
    context, started = FakeContext(), time.perf_counter()
    try:
        arg = iter(request) if rpc == "PushFragment" else request
        response = getattr(servicer, rpc)(arg, context)
        if rpc == "PullParams":
            response = list(response)
        outcome = Outcome(response=response)
    except _Aborted as aborted:
        outcome = Outcome(code=aborted.code, details=aborted.details)
    except BaseException:  # noqa: BLE001 - anything else is the crash we hunt for
        outcome = Outcome(crash=traceback.format_exc())
    outcome.elapsed_s = time.perf_counter() - started
    return outcome


# -- state digest ------------------------------------------------------------------------


def _bits(value: Any) -> Any:
    """A comparable, bit-exact form: tensors as (dtype, shape, bytes), floats as their bits."""
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        return (
            "tensor",
            str(t.dtype),
            tuple(t.shape),
            t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"",
        )
    if isinstance(value, float):
        return ("f", struct.pack("<d", value))
    if isinstance(value, (list, tuple)):
        return tuple(_bits(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((str(k), _bits(v)) for k, v in value.items()))
    if isinstance(value, (set, frozenset)):
        return tuple(sorted(_bits(v) for v in value))
    if value is None or isinstance(value, (int, str, bytes, bool)):
        return value
    if hasattr(value, "SerializeToString"):
        return value.SerializeToString(deterministic=True)
    raise TypeError(f"no digest for {type(value).__name__}")


def state_digest(aggregator: Aggregator) -> dict[str, Any]:
    """Everything a push, join or leave could change, bit for bit; leaves out lease deadlines
    (renewed by any authenticated call) and the pull snapshot cache (derived data)."""
    with aggregator._cond:
        fragments = {}
        for f in aggregator._params.fragments:
            rnd = f.round
            fragments[f.fragment_id] = {
                "version": f.version,
                "params": _bits(f.params),
                "outer": _bits(dict(vars(f.outer))),
                "residual": _bits(f._residual),
                "updates": _bits([(start, msg) for start, msg in f._updates]),
                "round": _bits(
                    {
                        "delta_sum": rnd.delta_sum,
                        "weight_sum": rnd.weight_sum,
                        "pushes": rnd.pushes,
                        "tokens": rnd.tokens,
                        "quorum_since": rnd.quorum_since,
                        "opened_at": rnd.opened_at,
                        "abs_bound": rnd.abs_bound,
                    }
                ),
                "contributors": tuple(sorted(rnd.contributors)),
                "excused": tuple(sorted(rnd.excused)),
            }
        sessions = {
            s.session_id: _bits((s.learner_id, s.step, s.tokens, s.loss, s.step_time_s))
            for s in aggregator._learners.live()
        }
        # What pushes leave in each learner's record: weights, bases, last accepted push.
        learners = {
            s.learner_id: _bits((s.last_weight, s.push_bases, s.last_push))
            for s in aggregator._learners.everyone()
        }
        return {
            "fragments": fragments,
            "sessions": _bits(sessions),
            "fingerprint": _bits(
                [(p.name, p.shape, p.dtype) for p in aggregator._params.fingerprint or []]
            ),
            "learners": _bits(learners),
            # An empty guard is what the defaultdict hands out anyway: not a change.
            "norms": _bits(
                {
                    k: list(g.recent)
                    for k, g in aggregator._admission.norm_guards.items()
                    if g.recent
                }
            ),
            "epoch": aggregator.server_epoch,
        }


def state_is_finite(aggregator: Aggregator) -> bool:
    """Parameters, momentum, residual and round sums hold no NaN or infinity."""
    with aggregator._cond:
        tensors: list[torch.Tensor] = []
        for f in aggregator._params.fragments:
            tensors += list(f.params or []) + list(f._residual or [])
            tensors += list(f.round.delta_sum or [])
            for value in vars(f.outer).values():
                if isinstance(value, list):
                    tensors += [v for v in value if isinstance(v, torch.Tensor)]
        weights = [f.round.weight_sum for f in aggregator._params.fragments]
    return all(bool(torch.isfinite(t).all()) for t in tensors) and all(
        w == w and abs(w) != float("inf") for w in weights
    )
