"""Learner ids bound to client certificates (mutual TLS, `tls_client_id_from_cert`).

With mutual TLS alone, any holder of a certificate from the CA may call as any learner id,
and so join under many ids and take many learners' share of a merge. With this interceptor
a call may only act as the learner its client certificate names: the certificate's Common
Name (deploy/make_certs.sh gives each learner's certificate its id) must equal the call's
`x-diloco-learner-id`, or the call is refused with UNAUTHENTICATED; the servicer then lets
it act only for that learner's sessions (server/auth.py's authenticated_learner). Health
checks are exempt. The check runs as the call starts: an interceptor sees no peer
certificate, a call's context does.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc

from common.rpc import LEARNER_ID_HEADER
from server.auth import HEALTH_METHOD_PREFIX, around_calls, authenticate

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
        return authenticate(claimed)
