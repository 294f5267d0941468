"""Who may call the aggregator, and as which learner: where it listens and how (TLS), tokens
per learner, and learner ids bound to client certificates.

    diloco-token add tokens.txt dc1-node0              # prints a new token once
    diloco-server --auth-token-file tokens.txt ...     # SIGHUP reloads the file

The token file holds one line per learner, `learner_id sha256$salt$digest`: only a salted
hash of each token, never the token. Learners send `x-diloco-learner-id` and
`authorization: Bearer TOKEN` metadata on every call. The server's interceptor refuses any
call (health checks are exempt; reflection, when on, is not) whose token does not match the
learner id, with UNAUTHENTICATED, and makes the verified id available to the servicer, which
refuses with PERMISSION_DENIED a call that acts for another learner's session. A reload that
removes or replaces a learner's token ends the calls open under the old one (a long-poll, a
push) with UNAUTHENTICATED (calls.py ends them). Tokens are random 256-bit secrets, so one
round of salted SHA-256 is enough (no password stretching).

With mutual TLS alone, any holder of a certificate from the CA may call as any learner id,
and so join under many ids and take many learners' share of a merge. With
`tls_client_id_from_cert` (CertificateIdentity) a call may only act as the learner its client
certificate names: the certificate's Common Name (deploy/make_certs.sh gives each learner's
certificate its id) must equal the call's `x-diloco-learner-id`. The check runs as the call
starts: an interceptor sees no peer certificate, a call's context does.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from common.atomic import atomic_write
from common.metrics_http import check_listen
from common.rpc import LEARNER_ID_HEADER
from common.tls import server_credentials
from server.rpc.calls import (
    HEALTH_METHOD_PREFIX,
    Call,
    around_calls,
    current_call,
    replace_behavior,
)


@dataclass(kw_only=True)
class NetworkConfig:
    """Where the server listens, and who may talk to it (TLS, per-learner tokens)."""

    listen: str = "127.0.0.1:50051"
    """host:port to serve gRPC on; port 0 picks a free port."""
    port_file: str = ""
    """If set, write the bound port to this file once serving (for launchers using port 0)."""
    tls_cert: str = ""
    """PEM certificate chain the server presents (with tls_key): serve over TLS."""
    tls_key: str = ""
    """PEM private key of tls_cert."""
    tls_client_ca: str = ""
    """PEM CA that must have signed every learner's client certificate (mutual TLS)."""
    tls_client_id_from_cert: bool = False
    """With tls_client_ca: a learner may act only as the learner id its client certificate's
    Common Name gives (deploy/make_certs.sh writes it), so one certificate is one learner's
    share of influence."""
    insecure: bool = False
    """Serve in plaintext, without TLS: only on a trusted network (logs a warning)."""
    auth_token_file: str = ""
    """Per-learner tokens (`diloco-token add FILE ID`); SIGHUP reloads. Empty: off."""
    health_listen: str = ""
    """host:port to serve grpc.health.v1 on as well, in plaintext and nothing else, for
    probes that cannot speak TLS (Kubernetes' grpc probe); empty: off. It reveals only that
    the server is up."""
    reflection: bool = False
    """Serve gRPC server reflection (for grpcurl); behind the tokens when auth_token_file is
    set, and the certificate binding when tls_client_id_from_cert is. Off by default: a
    service a deployment does not use is one less to attack."""

    def __post_init__(self) -> None:
        if ":" not in self.listen:
            raise ValueError(f"listen must be host:port, got {self.listen!r}")
        check_listen("health_listen", self.health_listen)
        port = self.listen.rpartition(":")[2]
        if self.health_listen and self.health_listen.rpartition(":")[2] == port != "0":
            raise ValueError("health_listen must have a port of its own, not listen's")
        tls = bool(self.tls_cert or self.tls_key or self.tls_client_ca)
        if self.insecure and tls:
            raise ValueError("insecure and tls_* settings exclude each other: choose one")
        if self.tls_client_id_from_cert and not self.tls_client_ca:
            raise ValueError(
                "tls_client_id_from_cert needs tls_client_ca: without client certificates "
                "there is no name to bind learner ids to"
            )

    def check_tls_chosen(self) -> None:
        """TLS or an explicit insecure: checked by ServerConfig after the training settings,
        so that a bad training setting is reported first."""
        if not self.insecure and not (self.tls_cert and self.tls_key):
            raise ValueError(
                "set tls_cert and tls_key to serve over TLS, or insecure to serve in "
                "plaintext (trusted networks only)"
            )

    def credentials(self) -> grpc.ServerCredentials | None:
        """The TLS credentials to serve with; None when insecure."""
        if self.insecure:
            return None
        return server_credentials(self.tls_cert, self.tls_key, self.tls_client_ca)


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
            ended = self._calls.end(f"{learner_id} {old}", code, reason)
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
        call = _call()
        release = self._calls.add(f"{learner_id} {stored}", call)
        with self._lock:
            current = self._entries.get(learner_id)
        if current != stored:  # revoked between the check and now: reload() missed it
            release()
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid learner token")
        call.learner_id = learner_id
        return release


class OpenCalls:
    """The calls open now, by key (a learner id and its token), so that they can be ended
    together."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[str, dict[int, Call]] = {}

    def add(self, key: str, call: Call) -> Callable[[], None]:
        """Track the call; returns the function that forgets it (safe to call twice). It also
        runs when the call ends, in case its handler is never resumed."""
        with self._lock:
            self._open.setdefault(key, {})[id(call)] = call

        def release() -> None:
            with self._lock:
                calls = self._open.get(key, {})
                calls.pop(id(call), None)
                if not calls:
                    self._open.pop(key, None)

        if not call.context.add_callback(release):
            release()
        return release

    def count(self, key: str) -> int:
        with self._lock:
            return len(self._open.get(key, {}))

    def end(self, key: str, code: grpc.StatusCode, details: str) -> int:
        """Ask every call open under `key` to end; returns how many were open."""
        with self._lock:
            calls = list(self._open.pop(key, {}).values())
        for call in calls:
            call.end(code, details)
        return len(calls)


COMMON_NAME = "x509_common_name"  # gRPC's auth-context property of the peer's certificate


def certificate_learner(auth_context: dict[str, list[bytes]]) -> str | None:
    """The learner id a peer's certificate names (its one Common Name), or None."""
    names = auth_context.get(COMMON_NAME, [])
    return names[0].decode(errors="replace") if len(names) == 1 else None


class CertificateIdentity(grpc.ServerInterceptor):
    """Refuses a call whose claimed learner id is not its client certificate's."""

    def intercept_service(self, continuation: Callable, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(HEALTH_METHOD_PREFIX):
            return handler
        claimed = dict(handler_call_details.invocation_metadata).get(LEARNER_ID_HEADER, "")
        return around_calls(handler, lambda context: self._enter(context, claimed))

    @staticmethod
    def _enter(context, claimed: str) -> Callable[[], None]:
        named = certificate_learner(context.auth_context())
        if not claimed or named != claimed:
            context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                f"the client certificate names learner {named!r}, not {claimed!r}",
            )
        _call().learner_id = claimed
        return lambda: None


def _call() -> Call:
    """The current call (auth runs inside EndableCalls, which makes it)."""
    call = current_call()
    if call is None:
        raise RuntimeError("authentication must run inside EndableCalls (server/rpc/calls.py)")
    return call


def _refuse(handler: grpc.RpcMethodHandler, reason: str) -> grpc.RpcMethodHandler:
    def abort(request_or_iterator, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)

    return replace_behavior(handler, lambda _: abort)


def add_token(path: str, learner_id: str) -> str:
    """Append a fresh token for `learner_id` to the file (replacing an old one); returns it."""
    if not learner_id or any(c.isspace() for c in learner_id):
        raise ValueError("learner_id must be non-empty and without spaces")
    entries = parse_token_file(path) if os.path.exists(path) else {}
    token = secrets.token_urlsafe(32)
    entries[learner_id] = hash_token(token)
    lines = [f"{lid} {stored}\n" for lid, stored in entries.items()]
    header = "# learner_id sha256$salt$digest (server/rpc/auth.py); edit and SIGHUP to revoke\n"
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
