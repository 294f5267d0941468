"""Wrapping a gRPC method handler: the same handler with its behavior function replaced,
for interceptors that run something around each call or serve it differently."""

from __future__ import annotations

from collections.abc import Callable

import grpc


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


def behavior_from(run: Callable, response_streaming: bool) -> Callable:
    """A handler behavior from the generator function `run`: itself for a streamed answer,
    else a function that returns what `run` returns (it yields nothing)."""

    def unary(request_or_iterator, context):
        try:
            next(run(request_or_iterator, context))
        except StopIteration as done:
            return done.value
        raise RuntimeError("a unary answer yielded a message")

    return run if response_streaming else unary
