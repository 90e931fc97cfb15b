"""Frame links (``pagewire_common.framelink``): framing, pairing with a session's token, and the
listener's addresses. Sessions across processes are in test_worker_server.py."""

from __future__ import annotations

import asyncio

import pytest

from pagewire_common.framelink import HEADER, TOKEN_BYTES, FrameConnection, FrameListener, connect_frames


class _Transport:
    def __init__(self):
        self.written = bytearray()
        self.closed = False

    def get_extra_info(self, name):
        return None

    def write(self, data):
        self.written += data

    def is_closing(self):
        return self.closed

    def close(self):
        self.closed = True


def _frame(payload: bytes) -> bytes:
    return HEADER.pack(len(payload)) + payload


def test_frames_split_and_joined_across_reads_come_out_whole_and_in_order():
    async def main():
        conn = FrameConnection()
        conn.connection_made(_Transport())
        stream = _frame(b"first") + _frame(b"") + _frame(b"x" * 1000) + _frame(b"last")
        for i in range(0, len(stream), 7):  # byte runs that cut headers and payloads anywhere
            conn.data_received(stream[i:i + 7])
        got = [await conn.read() for _ in range(4)]
        assert got == [b"first", b"", b"x" * 1000, b"last"]
        conn.connection_lost(None)
        assert await conn.read() is None

    asyncio.run(main())


def test_write_frames_the_payload_and_fails_once_closed():
    conn = FrameConnection()
    transport = _Transport()
    conn.connection_made(transport)
    conn.write(b"abc")
    assert bytes(transport.written) == _frame(b"abc")
    conn.close()
    assert transport.closed
    with pytest.raises(ConnectionError, match="closed"):
        conn.write(b"more")


def test_a_reader_waiting_wakes_on_the_frame_and_on_the_close():
    async def main():
        conn = FrameConnection()
        conn.connection_made(_Transport())
        reader = asyncio.get_running_loop().create_task(conn.read())
        await asyncio.sleep(0)
        conn.data_received(_frame(b"hello"))
        assert await reader == b"hello"
        reader = asyncio.get_running_loop().create_task(conn.read())
        await asyncio.sleep(0)
        conn.connection_lost(None)
        assert await reader is None

    asyncio.run(main())


@pytest.mark.parametrize("kind", ["unix", "tcp"])
def test_the_listener_hands_each_connection_to_the_session_naming_its_token(kind, tmp_path):
    async def main():
        listener = FrameListener()
        grpc_address = f"unix:{tmp_path}/server.sock" if kind == "unix" else "127.0.0.1:0"
        await listener.start(grpc_address)
        where = listener.describe()
        if kind == "unix":
            assert where.unix_path == f"{tmp_path}/server.sock.frames" and not where.port
        else:
            assert where.port > 0 and not where.unix_path
        target = grpc_address if kind == "unix" else "127.0.0.1:50051"  # the client's host, our port
        early, early_token = await connect_frames(target, where)
        late, late_token = await connect_frames(target, where)
        assert len(early_token) == TOKEN_BYTES and early_token != late_token
        await asyncio.sleep(0.05)  # both tokens arrived before anyone claims them
        server_late = await listener.claim(late_token)
        server_early = await listener.claim(early_token)
        server_late.write(b"to late")
        server_early.write(b"to early")
        assert await late.read() == b"to late" and await early.read() == b"to early"
        early.write(b"from early")
        assert await server_early.read() == b"from early"
        assert await listener.claim(b"x" * TOKEN_BYTES, timeout=0.1) is None  # nobody sent it
        late.close()
        assert await server_late.read() is None  # the peer's close reaches the reader
        early.close()
        await listener.close()
        if kind == "unix":
            assert not (tmp_path / "server.sock.frames").exists()

    asyncio.run(main())
