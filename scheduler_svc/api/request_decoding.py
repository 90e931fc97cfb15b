"""Requests whose bytes do not decode (a string field that is not UTF-8, a truncated message) end
with INVALID_ARGUMENT saying so, where grpc.aio would answer UNKNOWN with the decoder's exception.

``DecodeErrorInterceptor`` wraps each unary-request handler of the public service: its
deserializer returns an ``Undecodable`` instead of raising, and the call then ends at once.
"""

from __future__ import annotations

import inspect

import grpc
from google.protobuf.message import DecodeError

SERVICE_PREFIX = "/pagewire.v1.Generation/"


class Undecodable:
    __slots__ = ("message",)

    def __init__(self, message: str):
        self.message = message


def _deserializer(decode):
    def deserialize(data: bytes):
        try:
            return decode(data)
        except DecodeError as e:  # its message names the type and the fault
            return Undecodable(f"the request does not decode: {e}")

    return deserialize


def _refusing(behavior):
    """``behavior``, ending the call with INVALID_ARGUMENT when its request did not decode."""
    if inspect.isasyncgenfunction(behavior):
        async def stream(request, context):
            if isinstance(request, Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            responses = behavior(request, context)
            try:
                async for item in responses:
                    yield item
            finally:  # closed with this one (a cancelled call): its own cleanup runs now, not at collection
                await responses.aclose()

        return stream

    async def unary(request, context):
        if isinstance(request, Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        return await behavior(request, context)

    return unary


class DecodeErrorInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self):
        self._handlers: dict[str, grpc.RpcMethodHandler] = {}  # each method's wrapped handler, made once

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        wrapped = self._handlers.get(method)
        if wrapped is not None:
            return wrapped
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming or not method.startswith(SERVICE_PREFIX):
            return handler
        kind = "unary_stream" if handler.response_streaming else "unary_unary"
        wrapped = handler._replace(request_deserializer=_deserializer(handler.request_deserializer),
                                   **{kind: _refusing(getattr(handler, kind))})
        self._handlers[method] = wrapped
        return wrapped
