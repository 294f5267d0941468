"""TokenAuth.reload ends the calls open under a token that was removed or replaced, and
only those."""

from __future__ import annotations

import contextvars
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest

from common.rpc import LEARNER_ID_HEADER
from server.rpc.auth import TokenAuth, add_token
from server.rpc.calls import EndableCalls
from tests.support.fakes import FakeServicerContext

PULL = "/diloco.v1.Aggregator/PullParams"


def open_call(auth: TokenAuth, learner_id: str, token: str) -> FakeServicerContext:
    """A streaming call of `learner_id` with `token` (inside EndableCalls, as the service
    chains them), started and left open between its two messages (its answer is kept: a
    dropped one would end the call)."""
    metadata = ((LEARNER_ID_HEADER, learner_id), ("authorization", f"Bearer {token}"))
    details = SimpleNamespace(method=PULL, invocation_metadata=metadata)
    handler = grpc.unary_stream_rpc_method_handler(lambda request, ctx: iter([b"head", b"tail"]))
    context = FakeServicerContext()
    chain = lambda d: auth.intercept_service(lambda _: handler, d)  # noqa: E731
    answer = EndableCalls().intercept_service(chain, details).unary_stream(None, context)
    # Each call runs in a context of its own, as on gRPC's threads: the current call is set
    # in it, not in the test's.
    context.own_context = contextvars.Context()
    assert context.own_context.run(next, answer) == b"head"  # open, between its two messages
    context.answer = answer
    return context


def rest(context: FakeServicerContext) -> list[bytes]:
    """The call's remaining messages (it ends itself at its next one if asked to)."""
    try:
        return context.own_context.run(list, context.answer)
    except RuntimeError:  # the fake context's abort
        return []


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "tokens.txt"


def test_a_removed_or_replaced_token_ends_its_calls_only(path: Path) -> None:
    tokens = {learner: add_token(str(path), learner) for learner in ("a", "b", "c")}
    auth = TokenAuth(str(path))
    calls = {learner: open_call(auth, learner, token) for learner, token in tokens.items()}
    add_token(str(path), "b")  # b's token replaced
    kept = [line for line in path.read_text().splitlines() if not line.startswith("a ")]
    path.write_text("\n".join(kept) + "\n")  # a's removed
    assert auth.reload() == 2
    assert [rest(calls[learner]) for learner in ("a", "b", "c")] == [[], [], [b"tail"]]
    for learner in ("a", "b"):
        [(code, details)] = calls[learner].ended
        assert code == grpc.StatusCode.UNAUTHENTICATED and "revoked" in details
    assert calls["c"].ended == []
    assert auth.revoked_calls == 2


def test_a_bad_file_keeps_the_tokens_and_the_calls(path: Path) -> None:
    token = add_token(str(path), "a")
    auth = TokenAuth(str(path))
    call = open_call(auth, "a", token)
    path.write_text("a not-a-hash\n")
    with pytest.raises(ValueError, match="line 1"):
        auth.reload()
    assert rest(call) == [b"tail"] and call.ended == []
    assert auth.verify("a", token) is not None
