"""Ending a call from outside its handler, and the calls open under each key.

    cancel_call(context, grpc.StatusCode.DEADLINE_EXCEEDED, "no message for 30 s")
    calls = OpenCalls()
    release = calls.add("learner-a", context)   # as the call starts; release() as it ends
    calls.cancel("learner-a", grpc.StatusCode.UNAUTHENTICATED, "token revoked")

A handler blocked on its peer (waiting for a push's next chunk, or for gRPC to send a pull's
next message to a reader that stopped reading) cannot abort itself: another thread ends it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import grpc
from grpc import _common

log = logging.getLogger(__name__)


def cancel_call(context: grpc.ServicerContext, code: grpc.StatusCode, details: str) -> None:
    """End the call now with `code` and `details` (sent to the client); from any thread. The
    handler's next read from the request stream raises grpc.RpcError, which gRPC ends quietly;
    a send in progress fails. Safe on a call that has already ended.

    grpc's public `context.cancel()` can only say CANCELLED; the call object underneath
    takes a status, so the client learns why. Should a grpc release hide that object, the call
    is still ended, with CANCELLED, and a warning says why the message is lost."""
    call = getattr(getattr(context, "_rpc_event", None), "call", None)
    if call is None:
        log.warning("grpc hides the call object: ending a call with CANCELLED, not %s", code.name)
        context.cancel()
        return
    call.cancel(_common.STATUS_CODE_TO_CYGRPC_STATUS_CODE[code], details)


class OpenCalls:
    """The contexts of the calls open now, by key (a learner id), so that they can be ended
    together."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[str, dict[int, grpc.ServicerContext]] = {}

    def add(self, key: str, context: grpc.ServicerContext) -> Callable[[], None]:
        """Track the call; returns the function that forgets it (safe to call twice). It is
        also run when the call ends, in case its handler is never resumed."""
        with self._lock:
            self._open.setdefault(key, {})[id(context)] = context

        def release() -> None:
            with self._lock:
                calls = self._open.get(key, {})
                calls.pop(id(context), None)
                if not calls:
                    self._open.pop(key, None)

        if not context.add_callback(release):
            release()
        return release

    def count(self, key: str) -> int:
        with self._lock:
            return len(self._open.get(key, {}))

    def cancel(self, key: str, code: grpc.StatusCode, details: str) -> int:
        """End every call open under `key`; returns how many were open."""
        with self._lock:
            contexts = list(self._open.pop(key, {}).values())
        for context in contexts:
            cancel_call(context, code, details)
        return len(contexts)
