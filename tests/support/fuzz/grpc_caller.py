"""The fuzz cases over a real gRPC server on 127.0.0.1 port 0 instead of direct calls.

    with GrpcCaller() as caller:
        report = run_servicer_case(draw, caller)

One server serves every case: a forwarding servicer hands each call to the current case's
AggregatorServicer, so cases stay independent while every message crosses the real transport
(serialization, the request stream, deadlines, status codes). An exception that escapes the
servicer reaches the client as UNKNOWN, which the case counts as a crash; a call past its
deadline counts as a hang.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import grpc

from common.generated.diloco.v1 import aggregator_pb2 as pb
from common.generated.diloco.v1 import aggregator_pb2_grpc as pb_grpc
from common.rpc import LEARNER_ID_HEADER, create_channel, create_server
from server.rpc.auth import TokenAuth, add_token
from server.rpc.calls import EndableCalls
from server.rpc.servicer import AggregatorServicer
from tests.support.fuzz.world import CALL_TIMEOUT_S, GOOD, MALLORY, Outcome, World

RPCS = ("Join", "PushFragment", "PullParams", "Heartbeat", "Leave")


class _Forwarder(pb_grpc.AggregatorServicer):
    """Sends every RPC to `current`, the servicer of the case being run."""

    current: AggregatorServicer | None = None

    def Join(self, request, context):
        return self.current.Join(request, context)

    def PushFragment(self, request_iterator, context):
        return self.current.PushFragment(request_iterator, context)

    def PullParams(self, request, context):
        return self.current.PullParams(request, context)

    def Heartbeat(self, request, context):
        return self.current.Heartbeat(request, context)

    def Leave(self, request, context):
        return self.current.Leave(request, context)


class GrpcCaller:
    """A Caller (cases.py) that sends each call through a loopback gRPC server."""

    def __init__(self, timeout_s: float = CALL_TIMEOUT_S, token_dir: str | None = None) -> None:
        """With `token_dir`, the server checks per-learner tokens (server/rpc/auth.py): calls on
        the good learner's session carry its token, every other call mallory's, so acting
        for anyone else must be refused with PERMISSION_DENIED."""
        self.timeout_s = timeout_s
        self._forwarder = _Forwarder()
        self._metadata: dict[str, tuple[tuple[str, str], ...]] = {}
        interceptors: tuple[grpc.ServerInterceptor, ...] = ()
        if token_dir is not None:
            path = str(Path(token_dir) / "tokens.txt")
            for learner in (GOOD, MALLORY):
                token = add_token(path, learner)
                self._metadata[learner] = (
                    (LEARNER_ID_HEADER, learner),
                    ("authorization", f"Bearer {token}"),
                )
            interceptors = (EndableCalls(), TokenAuth(path))
        self._server, port = create_server("127.0.0.1:0", max_workers=8, interceptors=interceptors)
        pb_grpc.add_AggregatorServicer_to_server(self._forwarder, self._server)
        self._channel = create_channel(f"127.0.0.1:{port}")
        self._stub = pb_grpc.AggregatorStub(self._channel)

    def __enter__(self) -> GrpcCaller:
        self._server.start()
        grpc.channel_ready_future(self._channel).result(timeout=30)
        return self

    def __exit__(self, *exc: object) -> None:
        self._channel.close()
        self._server.stop(grace=0).wait()

    def __call__(
        self, world: World, rpc: str, request: Any, as_learner: str | None = None
    ) -> Outcome:
        """Send one call; with tokens on, signed as `as_learner` (default: see __init__)."""
        if rpc not in RPCS:
            raise ValueError(f"unknown rpc {rpc!r}")
        self._forwarder.current = world.servicer
        method = getattr(self._stub, rpc)
        metadata = self._caller_metadata(world, request)
        if as_learner is not None:
            metadata = self._metadata[as_learner]
        kwargs = {"timeout": self.timeout_s, "metadata": metadata}
        started = time.perf_counter()
        try:
            if rpc == "PushFragment":
                response = method(iter(request), **kwargs)
            elif rpc == "PullParams":
                response = list(method(request, **kwargs))
            else:
                response = method(request, **kwargs)
            outcome = Outcome(response=response)
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                outcome = Outcome(hang=True)
            else:
                outcome = Outcome(code=err.code(), details=err.details() or "")
        outcome.elapsed_s = time.perf_counter() - started
        return outcome

    def _caller_metadata(self, world: World, request: Any) -> tuple[tuple[str, str], ...] | None:
        if not self._metadata:
            return None
        first = request[0] if isinstance(request, list) and request else request
        if isinstance(first, pb.PushFragmentRequest):
            first = first.header
        session = getattr(first, "session_id", None)
        is_good = session == world.sessions[GOOD] or getattr(first, "learner_id", None) == GOOD
        return self._metadata[GOOD if is_good else MALLORY]
