"""Sessions of the two internal links (core -> worker, API server -> core): a frame link for the
messages, a gRPC stream for status and liveness (``protos/pagewire/v1/link.proto``).

A message on a grpc.aio stream costs each side some 70 µs of CPU; a length-prefixed frame on a
plain socket costs a few (``docs/benchmarks.md`` section 3). The two links carry a few messages
per step, so the frames keep the core's cost per token low. The gRPC stream that pairs with each
frame link carries no messages: the server ends it with a status (FAILED_PRECONDITION, a bad
plan...), and HTTP/2 keepalive on it, answered by gRPC's own threads even while the peer's event
loop runs a long step, notices a peer that stops answering. Either ending ends both.

Server side: :class:`FrameListener` takes frame-link connections beside a gRPC server and hands
each to the session that names its token (:meth:`FrameListener.claim`). Client side:
:class:`LinkSession` connects, opens the session and reads and writes frames.
"""

from __future__ import annotations

import asyncio
import collections
import os
import secrets
import socket
import struct
import time

import grpc

from pagewire_common.v1 import link_pb2

MAX_MESSAGE_BYTES = 256 * 1024 * 1024
# the gRPC channel options of both internal links (core -> worker, API server -> core)
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # a peer that stops answering (not just one that closes its socket) is noticed in seconds
    ("grpc.keepalive_time_ms", 2000),
    ("grpc.keepalive_timeout_ms", 3000),
    # without it grpcio 1.85 never times out a ping the client sent: a frozen peer went unnoticed
    ("grpc.http2.ping_timeout_ms", 3000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # reconnect quickly when a restarted peer comes back
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
]

HEADER = struct.Struct("<I")
MAX_FRAME_BYTES = 256 * 1024 * 1024
TOKEN_BYTES = 16
# a connection whose session does not claim it within this long is closed
CLAIM_TIMEOUT_S = 10.0


class LinkClosed(ConnectionError):
    """The frame link or its session ended; the message says why."""


class FrameConnection(asyncio.Protocol):
    """One end of a frame link: ``write`` queues a message on the socket without waiting (the
    links' own flow control, one plan in flight and the API servers' acknowledgements, bounds
    what can pile up), ``read`` returns the next whole message or None once the peer closed."""

    def __init__(self) -> None:
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._frames: collections.deque[bytes] = collections.deque()
        self._waiter: asyncio.Future | None = None
        self.closed = False
        self.on_first_frame = None  # server side: called with the first frame (the token)

    # ---- asyncio.Protocol -------------------------------------------------------------------

    def connection_made(self, transport) -> None:
        self._transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        start, end = 0, len(buffer)
        while end - start >= HEADER.size:
            (size,) = HEADER.unpack_from(buffer, start)
            if size > MAX_FRAME_BYTES:
                self.close()
                return
            if end - start - HEADER.size < size:
                break
            start += HEADER.size
            frame = bytes(buffer[start:start + size])
            start += size
            if self.on_first_frame is not None:
                callback, self.on_first_frame = self.on_first_frame, None
                callback(self, frame)
            else:
                self._frames.append(frame)
        if start:
            del buffer[:start]
        self._wake()

    def connection_lost(self, exc) -> None:
        self.closed = True
        self._wake()

    # ---- use ------------------------------------------------------------------------------

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and (self._frames or self.closed):
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def write(self, payload: bytes) -> None:
        if self.closed or self._transport is None or self._transport.is_closing():
            raise LinkClosed("the frame link is closed")
        self._transport.write(HEADER.pack(len(payload)) + payload)

    def has_frame(self) -> bool:
        """Whether a message is here: ``read`` would return it without waiting."""
        return bool(self._frames)

    async def read(self) -> bytes | None:
        """The next message, or None once the link is closed and every message was read."""
        while not self._frames:
            if self.closed:
                return None
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        return self._frames.popleft()

    def close(self) -> None:
        self.closed = True
        if self._transport is not None:
            self._transport.close()
        self._wake()


class FrameListener:
    """Frame-link connections for the sessions of one gRPC server. For a gRPC address
    ``unix:PATH`` it listens on ``PATH.frames``; for ``host:port``, on an ephemeral port of the
    same host. :meth:`describe` is what the server's info reply names."""

    def __init__(self) -> None:
        self._server: asyncio.AbstractServer | None = None
        self._description = link_pb2.FrameLink()
        self._arrived: dict[bytes, tuple[FrameConnection, float]] = {}
        self._claims: dict[bytes, asyncio.Future] = {}

    async def start(self, grpc_listen: str) -> None:
        loop = asyncio.get_running_loop()
        if grpc_listen.startswith("unix:"):
            path = os.path.abspath(grpc_listen.removeprefix("unix:").removeprefix("//") + ".frames")
            if os.path.exists(path):
                os.unlink(path)  # a stale socket file (the gRPC address was checked to be free)
            self._server = await loop.create_unix_server(self._protocol, path)
            self._description = link_pb2.FrameLink(unix_path=path)
            return
        host = grpc_listen.rpartition(":")[0].strip("[]") or "0.0.0.0"
        family, kind, proto, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.bind(address)
        except OSError:
            sock.close()
            raise
        self._server = await loop.create_server(self._protocol, sock=sock)
        self._description = link_pb2.FrameLink(port=sock.getsockname()[1])

    def describe(self) -> link_pb2.FrameLink:
        return self._description

    def _protocol(self) -> FrameConnection:
        conn = FrameConnection()
        conn.on_first_frame = self._on_token
        return conn

    def _on_token(self, conn: FrameConnection, token: bytes) -> None:
        claim = self._claims.pop(token, None)
        if claim is not None and not claim.done():
            claim.set_result(conn)
            return
        now = time.monotonic()
        for old, (stale, since) in list(self._arrived.items()):  # never claimed: close them
            if now - since > CLAIM_TIMEOUT_S:
                del self._arrived[old]
                stale.close()
        self._arrived[token] = (conn, now)

    async def claim(self, token: bytes, timeout: float = CLAIM_TIMEOUT_S) -> FrameConnection | None:
        """The connection whose first frame was ``token`` (it may arrive after the session);
        None if none does within ``timeout``."""
        arrived = self._arrived.pop(token, None)
        if arrived is not None:
            return arrived[0]
        future = asyncio.get_running_loop().create_future()
        self._claims[token] = future
        try:
            return await asyncio.wait_for(future, timeout)
        except TimeoutError:
            return None
        finally:
            self._claims.pop(token, None)

    async def open_session(self, request: link_pb2.LinkOpen, context) -> FrameConnection:
        """In a session's handler: its frame link, or the call ends FAILED_PRECONDITION."""
        conn = await self.claim(request.token) if len(request.token) == TOKEN_BYTES else None
        if conn is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "no frame link with this session's token (connect to the frame link the info reply names first)")
        return conn

    async def close(self) -> None:
        for conn, _ in self._arrived.values():
            conn.close()
        self._arrived.clear()
        if self._server is not None:
            self._server.close()
            path = self._description.unix_path
            if path and os.path.exists(path):
                os.unlink(path)


async def connect_frames(target: str, where: link_pb2.FrameLink) -> tuple[FrameConnection, bytes]:
    """Connect to the frame link ``where`` of the server at gRPC address ``target``; returns the
    connection and the token it sent."""
    loop = asyncio.get_running_loop()
    if where.unix_path:
        _, conn = await loop.create_unix_connection(FrameConnection, where.unix_path)
    elif where.port:
        if target.startswith("unix:"):
            raise LinkClosed(f"{target} named a TCP frame link")
        host = target.removeprefix("dns:///").rpartition(":")[0].strip("[]")
        _, conn = await loop.create_connection(FrameConnection, host, where.port)
    else:
        raise LinkClosed(f"{target} names no frame link (a server older than this client?)")
    token = secrets.token_bytes(TOKEN_BYTES)
    conn.write(token)
    return conn, token


class LinkSession:
    """Client side of a session: a frame link and the gRPC stream that pairs with it.

    ``open_call(LinkOpen)`` starts the server's session RPC (``stub.Execute`` or
    ``stub.Connect``). :meth:`read` raises :class:`LinkClosed` with the server's status when the
    session ends."""

    def __init__(self, target: str, conn: FrameConnection, call):
        self.target = target
        self._conn = conn
        self._call = call
        self._watch = asyncio.get_running_loop().create_task(self._watch_call())
        self._reason: str | None = None

    @classmethod
    async def open(cls, target: str, where: link_pb2.FrameLink, open_call) -> LinkSession:
        try:
            conn, token = await connect_frames(target, where)
        except OSError as e:
            raise LinkClosed(f"{target}: cannot connect to its frame link: {e}") from None
        return cls(target, conn, open_call(link_pb2.LinkOpen(token=token)))

    async def _watch_call(self) -> None:
        try:
            async for _ in self._call:
                pass
            self._reason = "the server ended the session"
        except grpc.RpcError as e:
            self._reason = f"{e.code().name}: {e.details()}"
        except asyncio.CancelledError:
            self._reason = "the session was closed"
        finally:
            self._conn.close()

    @property
    def ended(self) -> asyncio.Task:
        """Done once the session's call ended: the server ended it or went away (``reason``)."""
        return self._watch

    @property
    def reason(self) -> str:
        return self._reason or "the session ended"

    def write(self, payload: bytes) -> None:
        try:
            self._conn.write(payload)
        except LinkClosed:
            raise LinkClosed(f"{self.target}: {self._reason or 'the frame link is closed'}") from None

    async def read(self) -> bytes:
        data = await self._conn.read()
        if data is not None:
            return data
        # the frame link closed: the session's status says why (it may trail the socket's end)
        try:
            await asyncio.wait_for(asyncio.shield(self._watch), 2.0)
        except TimeoutError:
            self._call.cancel()
        raise LinkClosed(f"{self.target}: {self._reason or 'the frame link closed'}")

    def close(self) -> None:
        self._call.cancel()
        self._conn.close()
