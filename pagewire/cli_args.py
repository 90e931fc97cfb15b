"""What the ``pagewire`` parser and its ``bench`` subcommand's both use: the default address and
the numeric argument types. Below both CLIs, so that neither imports the other for them."""

from __future__ import annotations

import argparse

DEFAULT_LISTEN = "127.0.0.1:50051"  # where a server listens, and where a client looks, by default


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def server_address(text: str) -> str:
    """A server to connect to: HOST:PORT (port 1 to 65535) or unix:PATH."""
    if text.startswith("unix:"):
        return text
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"must be HOST:PORT (a port is 1 to 65535) or unix:PATH, got {text!r}")
    return text


def add_connection_arguments(parser) -> None:
    """The flags of a client of a server started with --api-key or TLS (``ServerAccess``)."""
    from pagewire_common import envs

    g = parser.add_argument_group("connection")
    g.add_argument("--api-key", default=envs.api_key(), metavar="KEY",
                   help="send 'authorization: Bearer KEY' with every call, for a server started with --api-key "
                   "(default: $PAGEWIRE_API_KEY, else none)")
    g.add_argument("--tls", action="store_true",
                   help="connect over TLS, trusting the system's certificate authorities")
    g.add_argument("--tls-ca-file", default=None, metavar="PATH",
                   help="connect over TLS, trusting the PEM certificate(s) in PATH (a private CA, or the server's "
                   "self-signed certificate)")
