"""Per-learner tokens: who may call the aggregator, and as which learner.

    diloco-token add tokens.txt dc1-node0              # prints a new token once
    diloco-server --auth-token-file tokens.txt ...     # SIGHUP reloads the file

The token file holds one line per learner, `learner_id sha256$salt$digest`: only a salted
hash of each token, never the token. Learners send `x-diloco-learner-id` and
`authorization: Bearer TOKEN` metadata on every call. The server's interceptor refuses any
call (health checks are exempt; reflection, when on, is not) whose token does not match the
learner id, with UNAUTHENTICATED, and makes the verified id available to the servicer, which
refuses with PERMISSION_DENIED a call that acts for another learner's session. A reload that
removes or replaces a learner's token ends the calls open under the old one (a long-poll, a
push) with UNAUTHENTICATED. Tokens are random 256-bit secrets, so one round of salted SHA-256
is enough (no password stretching).
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import hmac
import os
import secrets
import sys
import threading
from collections.abc import Callable

import grpc

from common.atomic import atomic_write
from common.rpc import LEARNER_ID_HEADER
from server.calls import OpenCalls

# The one service open to any caller and exempt from limits: orchestrators probe without tokens.
HEALTH_METHOD_PREFIX = "/grpc.health.v1.Health/"

_authenticated: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "authenticated_learner", default=None
)


def authenticated_learner() -> str | None:
    """The learner id the current call proved, or None when authentication is off."""
    return _authenticated.get()


def authenticate(learner_id: str) -> Callable[[], None]:
    """Mark the current call as proven to come from `learner_id` (a token, a certificate);
    returns what undoes it when the call ends."""
    token = _authenticated.set(learner_id)

    def undo() -> None:
        with contextlib.suppress(ValueError):  # a stream closed from another context
            _authenticated.reset(token)

    return undo


def hash_token(token: str, salt: str | None = None) -> str:
    salt = salt or secrets.token_hex(16)
    digest = hashlib.sha256(f"{salt}:{token}".encode()).hexdigest()
    return f"sha256${salt}${digest}"


def parse_token_file(path: str) -> dict[str, str]:
    """learner id -> stored hash; raises ValueError naming the line that is malformed."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError as err:
        raise ValueError(f"cannot read auth_token_file {path}: {err.strerror}") from err
    entries: dict[str, str] = {}
    for number, line in enumerate(lines, start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 2 or parts[1].count("$") != 2 or not parts[1].startswith("sha256$"):
            raise ValueError(f"{path} line {number}: expected 'learner_id sha256$salt$digest'")
        entries[parts[0]] = parts[1]
    return entries


class TokenAuth(grpc.ServerInterceptor):
    """Checks the token of every call but health checks; reload() re-reads the file and
    ends the calls of revoked tokens."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._entries = parse_token_file(path)
        self._calls = OpenCalls()
        self.revoked_calls = 0  # calls ended by a reload, for metrics

    def reload(self) -> int:
        """Re-read the token file; a bad file keeps the old tokens. Calls open under a token
        that is gone or replaced are ended. Returns the count of tokens."""
        entries = parse_token_file(self.path)
        with self._lock:
            revoked = [(lid, old) for lid, old in self._entries.items() if entries.get(lid) != old]
            self._entries = entries
        for learner_id, old in revoked:
            reason = f"the token of learner {learner_id} was revoked"
            code = grpc.StatusCode.UNAUTHENTICATED
            ended = self._calls.cancel(f"{learner_id} {old}", code, reason)
            with self._lock:
                self.revoked_calls += ended
        return len(entries)

    def verify(self, learner_id: str, token: str) -> str | None:
        """The stored hash `token` matches for `learner_id`; None when it matches none."""
        with self._lock:
            stored = self._entries.get(learner_id)
        if stored is None:
            return None
        _, salt, _ = stored.split("$")
        return stored if hmac.compare_digest(hash_token(token, salt), stored) else None

    def intercept_service(self, continuation: Callable, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(HEALTH_METHOD_PREFIX):
            return handler
        metadata = dict(handler_call_details.invocation_metadata)
        learner_id = metadata.get(LEARNER_ID_HEADER, "")
        bearer = metadata.get("authorization", "")
        token = bearer.removeprefix("Bearer ") if bearer.startswith("Bearer ") else ""
        stored = self.verify(learner_id, token) if learner_id and token else None
        if stored is None:
            return _refuse(handler, "missing or invalid learner token")
        return around_calls(handler, lambda context: self._enter(context, learner_id, stored))

    def _enter(self, context, learner_id: str, stored: str) -> Callable[[], None]:
        """Run the call as `learner_id`, tracked so that revoking its token ends it."""
        release = self._calls.add(f"{learner_id} {stored}", context)
        with self._lock:
            current = self._entries.get(learner_id)
        if current != stored:  # revoked between the check and now: reload() missed it
            release()
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid learner token")
        undo = authenticate(learner_id)

        def leave() -> None:
            release()
            undo()

        return leave


def _refuse(handler: grpc.RpcMethodHandler, reason: str) -> grpc.RpcMethodHandler:
    def abort(request_or_iterator, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)

    return replace_behavior(handler, lambda _: abort)


def around_calls(handler: grpc.RpcMethodHandler, enter: Callable) -> grpc.RpcMethodHandler:
    """The same handler with `enter(context)` run as each call starts and the function it
    returns run as the call ends (a streamed answer's end included), for interceptors that
    hold something for the length of a call."""

    def wrap(behavior):
        if handler.response_streaming:

            def streaming(request, context):
                leave = enter(context)
                try:
                    yield from behavior(request, context)
                finally:
                    leave()

            return streaming

        def unary(request_or_iterator, context):
            leave = enter(context)
            try:
                return behavior(request_or_iterator, context)
            finally:
                leave()

        return unary

    return replace_behavior(handler, wrap)


def replace_behavior(handler: grpc.RpcMethodHandler, wrap) -> grpc.RpcMethodHandler:
    """The same handler with its behavior function replaced by wrap(behavior)."""
    kinds = {
        (False, False): ("unary_unary", grpc.unary_unary_rpc_method_handler),
        (True, False): ("stream_unary", grpc.stream_unary_rpc_method_handler),
        (False, True): ("unary_stream", grpc.unary_stream_rpc_method_handler),
        (True, True): ("stream_stream", grpc.stream_stream_rpc_method_handler),
    }
    attr, make = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(
        wrap(getattr(handler, attr)),
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


def add_token(path: str, learner_id: str) -> str:
    """Append a fresh token for `learner_id` to the file (replacing an old one); returns it."""
    if not learner_id or any(c.isspace() for c in learner_id):
        raise ValueError("learner_id must be non-empty and without spaces")
    entries = parse_token_file(path) if os.path.exists(path) else {}
    token = secrets.token_urlsafe(32)
    entries[learner_id] = hash_token(token)
    lines = [f"{lid} {stored}\n" for lid, stored in entries.items()]
    header = "# learner_id sha256$salt$digest (server/auth.py); edit and SIGHUP to revoke\n"
    atomic_write(path, header + "".join(lines), mode=0o600)
    return token


TOKEN_USAGE = "usage: diloco-token add TOKEN_FILE LEARNER_ID   (prints the new token)"


def main() -> None:
    if sys.argv[1:] in (["-h"], ["--help"]):
        print(TOKEN_USAGE)
        return
    if len(sys.argv) != 4 or sys.argv[1] != "add":
        sys.exit(TOKEN_USAGE)
    try:
        print(add_token(sys.argv[2], sys.argv[3]))
    except ValueError as err:  # a bad id, a malformed token file
        sys.exit(f"diloco-token: error: {err}")
    except OSError as err:  # its folder is missing or not writable: name the file, not the temp
        sys.exit(f"diloco-token: error: cannot update {sys.argv[2]}: {err.strerror}")


if __name__ == "__main__":
    main()
