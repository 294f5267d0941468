"""PushFragment's request messages read without copying their chunks.

    interceptors = (..., ChunkViews())      # in the server's chain (server/app.py)
    # PushFragment's request iterator then yields a pb.PushFragmentRequest for the header
    # and a memoryview of the received bytes for each chunk

Why: protobuf's parse copies a message's bytes field, and reading the field copies it again,
so each chunk crossed memory three times before it reached the push's receive buffer
(server/receive.py): 0.7 ms per 8 MB push here against 0.01 ms for the views
(bench/ingest.py server_paths), several percent of all the server spends on a push. A chunk
message is one field and nothing else (tag 2, length-delimited, then the bytes), so it is
recognised by its first bytes and its length adding up; anything else, however unusual
(unknown fields, a repeated field, a header), goes to protobuf's own parser, so what is
accepted and refused is protobuf's rule.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc

from common.codec.framing import parse_push_request
from common.generated.diloco.v1 import aggregator_pb2 as pb

PUSH_METHOD = "/diloco.v1.Aggregator/PushFragment"


def wire_bytes(message: pb.PushFragmentRequest | memoryview) -> int:
    """The serialized size of a request as parse_push_request returned it."""
    if isinstance(message, memoryview):
        return len(message.obj)  # type: ignore[arg-type]  # the whole received message
    return message.ByteSize()


class ChunkViews(grpc.ServerInterceptor):
    """Gives PushFragment parse_push_request as its request deserializer."""

    def intercept_service(self, continuation: Callable, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method != PUSH_METHOD:
            return handler
        return grpc.stream_unary_rpc_method_handler(
            handler.stream_unary,
            request_deserializer=parse_push_request,
            response_serializer=handler.response_serializer,
        )
