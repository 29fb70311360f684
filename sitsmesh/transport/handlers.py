"""Wrapping a grpc method handler: which of its four behaviours it has, and how to
build a handler of the same kind around a new one."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

Factory = Callable[..., "grpc.RpcMethodHandler[Any, Any]"]


def behaviour(handler: grpc.RpcMethodHandler[Any, Any]) -> tuple[Callable[..., Any], Factory]:
    """(the handler's behaviour, the grpc factory that makes a handler of its kind)."""
    request_streaming = handler.unary_unary is None and handler.unary_stream is None
    if handler.unary_unary or handler.stream_unary:
        inner = handler.stream_unary if request_streaming else handler.unary_unary
        factory = (grpc.stream_unary_rpc_method_handler if request_streaming
                   else grpc.unary_unary_rpc_method_handler)
    else:
        inner = handler.stream_stream if request_streaming else handler.unary_stream
        factory = (grpc.stream_stream_rpc_method_handler if request_streaming
                   else grpc.unary_stream_rpc_method_handler)
    assert inner is not None  # one of the four behaviours is always set
    made: Factory = factory
    return inner, made
