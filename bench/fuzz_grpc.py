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
from typing import Any

import grpc

from bench.fuzz_world import CALL_TIMEOUT_S, Outcome, World
from common.generated.diloco.v1 import aggregator_pb2_grpc as pb_grpc
from common.rpc import create_channel, create_server
from server.servicer import AggregatorServicer

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
    """A Caller (bench/fuzz_cases.py) that sends each call through a loopback gRPC server."""

    def __init__(self, timeout_s: float = CALL_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self._forwarder = _Forwarder()
        self._server, port = create_server("127.0.0.1:0", max_workers=8)
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

    def __call__(self, world: World, rpc: str, request: Any) -> Outcome:
        if rpc not in RPCS:
            raise ValueError(f"unknown rpc {rpc!r}")
        self._forwarder.current = world.servicer
        method = getattr(self._stub, rpc)
        started = time.perf_counter()
        try:
            if rpc == "PushFragment":
                response = method(iter(request), timeout=self.timeout_s)
            elif rpc == "PullParams":
                response = list(method(request, timeout=self.timeout_s))
            else:
                response = method(request, timeout=self.timeout_s)
            outcome = Outcome(response=response)
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                outcome = Outcome(hang=True)
            else:
                outcome = Outcome(code=err.code(), details=err.details() or "")
        outcome.elapsed_s = time.perf_counter() - started
        return outcome
