"""One fuzz case and its properties, for the servicer and for the decoders.

A servicer case: a fresh world (world.py), then 1-6 hostile calls with time passing
between them, then the good learner pushes every fragment and pulls one back. Properties,
checked after every call:

- no crash (an exception other than the servicer's abort) and no hang (CALL_TIMEOUT_S);
- a refusal carries one of REFUSALS; while every earlier call of the case was refused (so the
  world is still as built), a `mutated_push` gets exactly the status its defect names;
- a refused call leaves the aggregator's state bit-identical (state_digest). One refusal has a
  designed side effect (Aggregator.push): a push refused by the norm guard excuses its learner
  from the round, so the round does not wait for it (and a round in which every live learner
  was refused ends without a step); for those the digest must differ by exactly that
  bookkeeping and nothing else;
- an accepted call leaves parameters, momentum, residual and round sums finite;
- afterwards the good learner's pushes are accepted and its pull returns the fragment, and a
  pull one version behind returns an update chain (in the scenario's pull codec, sparse ones
  included) that decodes as a learner decodes it.

Decoder cases are in decoders.py.
"""

from __future__ import annotations

import collections
import copy
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import torch
from hypothesis import strategies as st

from common.codec.fragment import apply_updates, encode_fragment, params_crc32
from common.errors import DilocoError
from common.generated.diloco.v1 import aggregator_pb2 as pb
from tests.support.fuzz.garbage import garbage_push, other_rpc
from tests.support.fuzz.strategies import ANY, Call, mutated_push, scenarios
from tests.support.fuzz.world import (
    CALL_TIMEOUT_S,
    GOOD,
    Outcome,
    World,
    build_world,
    call_direct,
    small_delta,
    state_digest,
    state_is_finite,
)

Code = grpc.StatusCode
REFUSALS = frozenset(
    {
        Code.INVALID_ARGUMENT,
        Code.FAILED_PRECONDITION,
        Code.NOT_FOUND,
        Code.ALREADY_EXISTS,
        Code.RESOURCE_EXHAUSTED,
        Code.PERMISSION_DENIED,
    }
)
# A caller runs one call against the world: in-process (call_direct) or over real gRPC.
Caller = Callable[[World, str, Any], Outcome]


def direct_caller(world: World, rpc: str, request: Any) -> Outcome:
    return call_direct(world.servicer, rpc, request, timeout_s=CALL_TIMEOUT_S)


@dataclass
class CaseReport:
    labels: list[str] = field(default_factory=list)
    codes: list[str] = field(default_factory=list)  # "accepted" or the status name, per call
    violations: list[str] = field(default_factory=list)  # "kind: detail"
    max_call_s: float = 0.0


def run_servicer_case(draw: Callable, caller: Caller = direct_caller) -> CaseReport:
    """Build a world, send it hostile calls, check every property; see the module docstring."""
    world = build_world(draw(scenarios))
    report = CaseReport()
    fresh = True  # no call changed the world yet: mutated pushes' expected codes hold
    for n in range(draw(st.integers(1, 6))):
        before = state_digest(world.aggregator)
        world.advance(draw(st.sampled_from([0.0, 0.0, 0.001, 0.3, 2.0, 7.0])))
        fresh = fresh and state_digest(world.aggregator) == before  # the tick did nothing
        family = (
            mutated_push
            if n == 0
            else draw(st.sampled_from([mutated_push, garbage_push, other_rpc, other_rpc]))
        )
        call = draw(family(world))
        outcome = check_call(world, call, caller, exact=fresh, report=report)
        if outcome is None:
            return report  # a crash or hang: the world is not to be trusted any more
        fresh = fresh and outcome.code is not None and not _norm_refusal(outcome)
        _learn_session(world, call, outcome)
    for fid in range(world.scenario.fragments):
        outcome = _good_push(world, caller, fid)
        if outcome.code is not None or outcome.crash or outcome.hang:
            report.violations.append(f"good_push_failed: fragment {fid}: {_describe(outcome)}")
    _check_good_pull(world, caller, report)
    return report


def _check_good_pull(world: World, caller: Caller, report: CaseReport) -> None:
    request = pb.PullParamsRequest(session_id=world.sessions[GOOD], fragment_id=0, have_version=-1)
    pulled = caller(world, "PullParams", request)
    if pulled.code is not None or pulled.crash or pulled.hang:
        report.violations.append(f"good_pull_failed: {_describe(pulled)}")
    elif pulled.response[0].header.params_crc32 != params_crc32(world.aggregator.params(0)):
        report.violations.append("good_pull_failed: checksum differs from the server's params")
    version = world.version(0)
    if version < 1:
        return
    # One version behind: the update in the scenario's pull codec (sparse ones included),
    # decoded as a learner does.
    request.have_version = version - 1
    pulled = caller(world, "PullParams", request)
    if pulled.code is not None or pulled.crash or pulled.hang:
        report.violations.append(f"good_pull_failed: updates: {_describe(pulled)}")
        return
    header = pulled.response[0].header
    if header.kind != pb.PULL_KIND_UPDATES:
        return  # the chain would be larger than a snapshot: a snapshot was sent instead
    data = b"".join(part.chunk for part in pulled.response[1:])
    replica = [torch.zeros(p.shape) for p in world.aggregator.params(0)]
    try:
        reached = apply_updates(replica, data, version - 1)
    except DilocoError as err:
        report.violations.append(f"good_pull_failed: the update chain does not decode: {err}")
        return
    if reached != header.version:
        report.violations.append(f"good_pull_failed: updates reach {reached}, not {version}")


def run_concurrent_case(draw: Callable, threads: int = 4, calls_each: int = 3) -> CaseReport:
    """Hostile calls from several threads at once while the good learner pushes: no crash,
    no hang, only refusal codes, a finite state, the good push accepted and its pull served.

    (Bit-identity of refused calls is the sequential cases' job: with calls interleaving
    there is no "before" to compare with.)"""
    world = build_world(draw(scenarios))
    families = st.sampled_from([mutated_push, garbage_push, other_rpc])
    plans = [[draw(draw(families)(world)) for _ in range(calls_each)] for _ in range(threads)]
    good = [_good_push_call(world, fid) for fid in range(world.scenario.fragments)]
    plans.append(good)
    results: list[list[tuple[Call, Outcome]]] = [[] for _ in plans]

    def work(plan: list[Call], out: list[tuple[Call, Outcome]]) -> None:
        for call in plan:
            out.append((call, call_direct(world.servicer, call.rpc, call.request)))

    workers = [
        threading.Thread(target=work, args=(plan, out), daemon=True)
        for plan, out in zip(plans, results, strict=True)
    ]
    for worker in workers:
        worker.start()
    deadline = time.monotonic() + CALL_TIMEOUT_S * calls_each
    report = CaseReport()
    for worker in workers:
        worker.join(max(0.0, deadline - time.monotonic()))
        if worker.is_alive():
            report.violations.append("hang: concurrent calls did not finish")
            return report
    for out in results:
        for call, outcome in out:
            report.labels.append(call.label)
            report.codes.append(_outcome_name(outcome))
            report.max_call_s = max(report.max_call_s, outcome.elapsed_s)
            where = f"{call.label} {call.rpc}({_short(call.request)})"
            if outcome.crash or (outcome.code is not None and outcome.code not in REFUSALS):
                report.violations.append(f"crash: concurrent {where}: {_describe(outcome)}")
    for call, outcome in results[-1]:
        initial = call.request[0].header.kind == pb.PUSH_KIND_INITIAL
        if initial and outcome.code == Code.ALREADY_EXISTS:
            continue  # mallory's initial parameters got there first: a fair race
        if outcome.code is not None or outcome.crash:
            report.violations.append(f"good_push_failed: concurrent: {_describe(outcome)}")
    if not state_is_finite(world.aggregator):
        report.violations.append("nonfinite_state: after concurrent calls")
    _check_good_pull(world, direct_caller, report)
    return report


def check_call(
    world: World, call: Call, caller: Caller, exact: bool, report: CaseReport
) -> Outcome | None:
    before = state_digest(world.aggregator)
    outcome = caller(world, call.rpc, call.request)
    report.labels.append(call.label)
    report.codes.append(_outcome_name(outcome))
    report.max_call_s = max(report.max_call_s, outcome.elapsed_s)
    where = f"{call.label} {call.rpc}({_short(call.request)})"
    if outcome.hang:
        report.violations.append(f"hang: {where}")
        return None
    if outcome.crash:
        report.violations.append(f"crash: {where}: {outcome.crash}")
        return None
    if outcome.code is not None and outcome.code not in REFUSALS:
        report.violations.append(f"crash: {where}: status {outcome.code.name} {outcome.details}")
        return None
    wanted = call.expect if isinstance(call.expect, set) else {call.expect}
    if exact and call.expect is not ANY and outcome.code not in wanted:
        want = " or ".join(sorted("accepted" if c is None else c.name for c in wanted))
        report.violations.append(f"wrong_status: {where}: want {want}, got {_describe(outcome)}")
    if outcome.code is None:
        if not state_is_finite(world.aggregator):
            report.violations.append(f"nonfinite_state: accepted {where}")
        return outcome
    expected = _after_norm_refusal(world, call, before) if _norm_refusal(outcome) else before
    after = state_digest(world.aggregator)
    if after != expected:
        report.violations.append(
            f"state_change: refused {where} ({_describe(outcome)}) changed {_diff(expected, after)}"
        )
    return outcome


def _outcome_name(outcome: Outcome) -> str:
    if outcome.hang or outcome.crash:
        return "hang" if outcome.hang else "crash"
    if outcome.code is None:
        return "accepted"
    return outcome.code.name + (" (norm guard)" if _norm_refusal(outcome) else "")


def _norm_refusal(outcome: Outcome) -> bool:
    return outcome.code == Code.FAILED_PRECONDITION and outcome.details.startswith("push refused")


def _after_norm_refusal(world: World, call: Call, before: dict) -> dict:
    """The designed bookkeeping of a norm-guard refusal: the learner is excused from the
    round; a round with no accepted push that then waits for no one ends, excuses and all."""
    header = call.request[0].header
    learner = next(lid for lid, sid in world.sessions.items() if sid == header.session_id)
    expected = copy.deepcopy(before)
    fragment = expected["fragments"][header.fragment_id]
    excused = {*fragment["excused"], learner}
    live = set(world.aggregator.live_learners())
    if not fragment["contributors"] and live <= excused:
        excused = set()
    fragment["excused"] = tuple(sorted(excused))
    return expected


def _learn_session(world: World, call: Call, outcome: Outcome) -> None:
    """An accepted Join gives the fuzzer one more session to use (and replaces a rejoiner's)."""
    if call.rpc == "Join" and outcome.code is None:
        world.sessions[call.request.learner_id] = outcome.response.session_id


def _good_push(world: World, caller: Caller, fid: int) -> Outcome:
    call = _good_push_call(world, fid)
    return caller(world, call.rpc, call.request)


def _good_push_call(world: World, fid: int) -> Call:
    """The good learner's pseudo-gradient, or its initial parameters if there are none yet."""
    initial = world.version(fid) == -1
    payload = encode_fragment(small_delta(world.shapes[fid], seed=7 + fid), "fp4_e2m1")
    header = pb.PushHeader(
        session_id=world.sessions[GOOD],
        fragment_id=fid,
        base_version=world.version(fid),
        inner_steps=10,
        tokens=1000,
        kind=pb.PUSH_KIND_INITIAL if initial else pb.PUSH_KIND_DELTA,
        payload_bytes=len(payload),
    )
    messages = [pb.PushFragmentRequest(header=header), pb.PushFragmentRequest(chunk=payload)]
    return Call("PushFragment", messages, None, "good:push")


def _describe(outcome: Outcome) -> str:
    if outcome.hang:
        return "hang"
    if outcome.crash:
        return "crash " + outcome.crash.strip().splitlines()[-1]
    return "accepted" if outcome.code is None else f"{outcome.code.name} ({outcome.details})"


def _short(request: Any, limit: int = 300) -> str:
    text = repr(request)
    return text if len(text) <= limit else text[:limit] + "..."


def _diff(a: dict, b: dict, prefix: str = "") -> str:
    keys = [k for k in a.keys() | b.keys() if a.get(k) != b.get(k)]
    parts = []
    for k in sorted(keys, key=str):
        if isinstance(a.get(k), dict) and isinstance(b.get(k), dict):
            parts.append(_diff(a[k], b[k], f"{prefix}{k}."))
        else:
            parts.append(f"{prefix}{k}")
    return ", ".join(parts)


@dataclass
class Tally:
    """Counts over many cases, for the long run's report."""

    cases: int = 0
    calls: int = 0
    outcomes: collections.Counter = field(default_factory=collections.Counter)
    by_label: collections.defaultdict = field(
        default_factory=lambda: collections.defaultdict(collections.Counter)
    )  # label -> outcome -> count
    violations: collections.Counter = field(default_factory=collections.Counter)
    examples: list[str] = field(default_factory=list)
    max_call_s: float = 0.0

    def add(self, report: CaseReport, keep_examples: int = 5) -> None:
        self.cases += 1
        self.calls += len(report.codes)
        self.outcomes.update(report.codes)
        for label, code in zip(report.labels, report.codes, strict=False):
            self.by_label[label][code] += 1
        self.max_call_s = max(self.max_call_s, report.max_call_s)
        for violation in report.violations:
            self.violations[violation.split(":", 1)[0]] += 1
            if len(self.examples) < keep_examples:
                self.examples.append(violation[:3000])

    def summary(self) -> dict[str, Any]:
        counted = {
            "crash": "crashes",
            "hang": "hangs",
            "state_change": "state_changes",
            "wrong_status": "wrong_statuses",
            "nonfinite_state": "nonfinite_states",
        }
        good = ("good_push_failed", "good_pull_failed")
        return {
            "cases": self.cases,
            "calls": self.calls,
            **{plural: self.violations.get(kind, 0) for kind, plural in counted.items()},
            "good_learner_failures": sum(self.violations.get(k, 0) for k in good),
            "other_violations": sum(
                n for k, n in self.violations.items() if k not in counted and k not in good
            ),
            "outcomes": dict(self.outcomes.most_common()),
            "by_label": {k: dict(v.most_common()) for k, v in sorted(self.by_label.items())},
            "max_call_s": round(self.max_call_s, 4),
            "examples": self.examples,
        }
