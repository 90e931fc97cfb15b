"""Who may call the public address, and over what: the API key and TLS (``--api-key``,
``--tls-cert-file``/``--tls-key-file``), for every door the API servers open.

The checks are door-neutral: ``check_authorization`` takes the value of an ``authorization``
header or metadata entry, ``TlsFiles`` gives gRPC server credentials or an ``ssl.SSLContext``
for an HTTP server. ``ApiKeyInterceptor`` applies the key to the gRPC door: every method but
gRPC health and reflection answers UNAUTHENTICATED without it.
"""

from __future__ import annotations

import hmac
import ssl
from dataclasses import dataclass, field
from pathlib import Path

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
    return hmac.compare_digest(token.strip().encode(), key.encode())


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """A server's PEM certificate (chain) and private key, read and checked once at start: a
    missing file or a key that does not match the certificate is a ``ValueError`` then, not a
    failed handshake with the first client."""

    cert_file: str
    key_file: str
    cert: bytes = field(repr=False)
    key: bytes = field(repr=False)

    @classmethod
    def load(cls, cert_file: str | None, key_file: str | None) -> "TlsFiles | None":
        """None when neither is given (plaintext)."""
        if cert_file is None and key_file is None:
            return None
        if cert_file is None or key_file is None:
            raise ValueError("--tls-cert-file and --tls-key-file go together: give both or neither")
        try:
            cert, key = Path(cert_file).read_bytes(), Path(key_file).read_bytes()
        except OSError as e:
            raise ValueError(f"cannot read the TLS files: {e.strerror}: {e.filename}") from None
        files = cls(cert_file, key_file, cert, key)
        files.ssl_context()  # the check: parses both and matches the key to the certificate
        return files

    def ssl_context(self) -> ssl.SSLContext:
        """A server-side context for an HTTP door (TLS 1.2 or newer)."""
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            context.load_cert_chain(self.cert_file, self.key_file)
        except ssl.SSLError as e:
            raise ValueError(f"--tls-cert-file {self.cert_file} and --tls-key-file {self.key_file} are not a PEM "
                             f"certificate and its private key ({e.reason or e})") from None
        return context

    def grpc_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key, self.cert)])


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
