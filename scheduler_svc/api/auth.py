"""Who may call the public address, and over what: the API key and TLS (``--api-key``,
``--tls-cert-file``/``--tls-key-file``), for every door the API servers open.

The checks are door-neutral: ``check_authorization`` takes the value of an ``authorization``
header or metadata entry, ``TlsFiles`` gives gRPC server credentials or an ``ssl.SSLContext``
for an HTTP server. ``ApiKeyInterceptor`` applies the key to the gRPC door: every method but
gRPC health and reflection answers UNAUTHENTICATED without it.
"""

from __future__ import annotations

import hmac

import grpc

UNAUTHENTICATED_MESSAGE = "missing or wrong API key: send 'authorization: Bearer KEY'"
# methods any client may call: load balancers and grpcurl need them without a key
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


def check_authorization(header_value: str | None, key: str | None) -> bool:
    """Whether an ``authorization`` value admits a caller: always when no key is set, else only
    ``Bearer KEY`` (the scheme in any case), compared in constant time."""
    if key is None:
        return True
    if not header_value:
        return False
    scheme, _, token = header_value.strip().partition(" ")
    if scheme.lower() != "bearer":
        return False
    # an HTTP header's bytes that are not UTF-8 arrive as surrogate escapes: compared as those bytes
    return hmac.compare_digest(token.strip().encode("utf-8", "surrogateescape"), key.encode())


async def _refuse(request_or_iterator, context) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)


def _refusing_handler(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that ends the call with UNAUTHENTICATED."""
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(_refuse)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(_refuse)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(_refuse)
    return grpc.unary_unary_rpc_method_handler(_refuse)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Lets a call through when its ``authorization`` metadata carries the key; health and
    reflection always."""

    def __init__(self, key: str):
        self.key = key

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(OPEN_METHOD_PREFIXES):
            return handler
        value = next((v for k, v in handler_call_details.invocation_metadata or () if k == "authorization"), None)
        if isinstance(value, bytes):
            value = value.decode(errors="replace")
        return handler if check_authorization(value, self.key) else _refusing_handler(handler)
