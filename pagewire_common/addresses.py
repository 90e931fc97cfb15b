"""Listen addresses (``host:port`` or ``unix:PATH``): checked before a server starts, bound with a
clear error, and named the same way in every log line. Torch-free: every process uses it."""

from __future__ import annotations

import os
import socket
import time


def check_address_free(listen: str, wait_s: float = 0.0) -> str:
    """Fail with one clear ``OSError`` when ``listen`` is taken; returns the address to use, with
    port 0 resolved to a free port.

    A TCP port is tried with a bind that has SO_REUSEADDR, as the servers' own (connections in
    TIME_WAIT do not hold it), and not SO_REUSEPORT (the API servers' sharing), which would let a
    second server share it silently. A unix socket is taken when something answers on it: gRPC
    removes the file of an existing socket before it binds, which would cut off the server
    listening there without a word. ``wait_s``: keep trying that long first (a
    restarted scheduler's old API servers may still be letting go of the port)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return _try_address(listen)
        except OSError:
            if time.monotonic() >= deadline:
                raise
        time.sleep(0.1)


def _try_address(listen: str) -> str:
    if listen.startswith("unix:"):
        path = listen.removeprefix("unix:").removeprefix("//")
        folder = os.path.dirname(path) or "."
        if not os.path.isdir(folder):
            raise OSError(f"cannot listen on {listen}: the folder {folder} does not exist")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            try:
                s.connect(path)
            except OSError:
                return listen  # nothing answers there: free (a stale file is replaced)
        raise OSError(f"cannot listen on {listen}: another server is listening there")
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"not an address: {listen!r} (host:port or unix:PATH)")
    if int(port) > 65535:
        raise ValueError(f"not an address: {listen!r} (a port is 0 to 65535)")
    host = host.strip("[]") or "0.0.0.0"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        # as every server binds (gRPC, aiohttp): connections in TIME_WAIT, left by a server that
        # stopped with clients connected, do not hold the port, but a socket listening there does
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, int(port)))
        except OSError as e:
            raise OSError(f"cannot listen on {listen}: {e.strerror} (is another server running there?)") from None
        bound = s.getsockname()[1]
    return f"{listen.rpartition(':')[0]}:{bound}"


def add_port(server, listen: str, credentials=None) -> int:
    """Bind a gRPC server (sync or aio) to ``listen``, over TLS when ``credentials`` are given;
    returns the bound port (1 for a unix socket). A failure is an ``OSError`` naming the address,
    not gRPC's RuntimeError."""
    try:
        if credentials is None:
            port = server.add_insecure_port(listen)
        else:
            port = server.add_secure_port(listen, credentials)
    except RuntimeError:
        port = 0
    if port == 0 and not listen.startswith("unix:"):
        raise OSError(f"cannot listen on {listen} (is another server running there?)")
    return port


def describe(listen: str, port: int | None = None) -> str:
    """The address as logs name it: ``unix:PATH`` as given, ``host:port`` with a port 0 replaced by
    the ``port`` that was bound."""
    if listen.startswith("unix:") or not port:
        return listen
    host, _, given = listen.rpartition(":")
    return listen if given != "0" else f"{host}:{port}"


def peer_name(peer: str | None) -> str:
    """A gRPC peer (``ipv4:10.0.0.2:5555``, ``ipv6:[::1]:5555``, ``unix:`` with no path) as logs
    name it."""
    if not peer:
        return "in process"
    kind, _, rest = peer.partition(":")
    if kind == "unix":
        return f"unix:{rest}" if rest else "a unix socket"
    return rest if kind in ("ipv4", "ipv6") else peer


def http_url(http_listen: str, tls: bool = False) -> str:
    """How a ready line names the OpenAI door (empty when it is off); ``tls``: it speaks HTTPS only."""
    return "" if http_listen == "off" else f", OpenAI HTTP on {'https' if tls else 'http'}://{http_listen}"


def check_api_servers(listen: str, api_servers: int) -> None:
    """``ValueError`` for several API servers on a unix socket: they share a TCP port with
    SO_REUSEPORT, which spreads the clients over them; on a socket path the last one bound would
    take every client and the others none."""
    if api_servers > 1 and listen.startswith("unix:"):
        raise ValueError(f"--listen {listen}: several API servers (--api-servers {api_servers}) share a host:port, not "
                         "a unix socket; give --api-servers 1 or a host:port")


def check_distinct(listen: str, http_listen: str) -> None:
    """``ValueError`` when the gRPC and the HTTP door would share a TCP port: both servers bind it
    (the API servers share theirs with SO_REUSEPORT), and each would get the other's clients."""
    if http_listen == "off" or listen.startswith("unix:"):
        return
    host, _, port = listen.rpartition(":")
    http_host, _, http_port = http_listen.rpartition(":")
    if port != http_port or port == "0":
        return
    wildcards = ("", "0.0.0.0", "[::]", "::")
    if host == http_host or host in wildcards or http_host in wildcards:
        raise ValueError(f"--listen {listen} and --http-listen {http_listen} are the same port: "
                         "the gRPC and the HTTP door each need their own")
