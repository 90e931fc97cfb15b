"""The TLS files of the public address (``--tls-cert-file``/``--tls-key-file``): read and checked
once, by the process that starts the services (a bad file stops it there) and by each API server,
which turns them into gRPC credentials or an ``ssl.SSLContext`` for its doors."""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field
from pathlib import Path

import grpc


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
