"""CPU per message of an internal link: a grpc.aio bidirectional stream against a frame link
(``pagewire_common.framelink``). Feeds docs/benchmarks.md, section "The internal links".

    python benchmarks/link_cost.py [--messages 20000] [--payload-bytes 1024,16384]

A server process echoes every message it reads; the client in this process sends one and waits
for the echo (a ping-pong, as the core and the worker exchange a plan and its result each step).
Both event loops are the services' own (uvloop where installed), and both links run over a unix
socket. It prints the round trips per second and each side's CPU time per round trip, from
``time.process_time`` in each process.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import sys
import tempfile
import time

import grpc

from pagewire_common import eventloop
from pagewire_common.framelink import FrameListener, LinkSession
from pagewire_common.v1 import core_pb2, core_pb2_grpc


class _Echo(core_pb2_grpc.SchedulerCoreServicer):
    """``Connect`` in two shapes: frames (the session names its frame link) or, for the
    comparison, the messages on the gRPC stream itself (see ``_grpc_echo``)."""

    def __init__(self, frames: FrameListener):
        self.frames = frames

    async def CoreInfo(self, request, context):
        return core_pb2.CoreInfoResponse(frame_link=self.frames.describe())

    async def Connect(self, request, context):
        conn = await self.frames.open_session(request, context)
        while (data := await conn.read()) is not None:
            conn.write(data)


def _grpc_echo_handler():
    async def echo(request_iterator, context):
        async for msg in request_iterator:
            yield msg

    return grpc.stream_stream_rpc_method_handler(echo, request_deserializer=lambda b: b, response_serializer=lambda b: b)


def _serve(address: str, ready, stop, cpu) -> None:
    async def main():
        frames = FrameListener()
        server = grpc.aio.server()
        core_pb2_grpc.add_SchedulerCoreServicer_to_server(_Echo(frames), server)
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("bench.Echo", {"Echo": _grpc_echo_handler()})])
        server.add_insecure_port(address)
        await frames.start(address)
        await server.start()
        ready.set()
        while not stop.is_set():
            await asyncio.sleep(0.02)
            cpu.value = time.process_time()
        await server.stop(None)
        await frames.close()

    eventloop.run(main())


async def _ping_pong(address: str, kind: str, messages: int, payload: bytes) -> tuple[float, float]:
    """(wall seconds, client CPU seconds) for ``messages`` round trips."""
    async with grpc.aio.insecure_channel(address) as channel:
        if kind == "grpc":
            call = channel.stream_stream("/bench.Echo/Echo", request_serializer=lambda b: b,
                                         response_deserializer=lambda b: b)()

            async def round_trip():
                await call.write(payload)
                await call.read()
        else:
            stub = core_pb2_grpc.SchedulerCoreStub(channel)
            info = await stub.CoreInfo(core_pb2.CoreInfoRequest())
            session = await LinkSession.open(address, info.frame_link, stub.Connect)

            async def round_trip():
                session.write(payload)
                await session.read()

        for _ in range(200):  # warm up
            await round_trip()
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(messages):
            await round_trip()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        if kind == "grpc":
            call.cancel()
        else:
            session.close()
        return wall, cpu


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--messages", type=int, default=20000)
    p.add_argument("--payload-bytes", default="1024,16384", help="comma-separated message sizes")
    p.add_argument("--repeat-runs", type=int, default=2)
    args = p.parse_args()
    sizes = [int(s) for s in args.payload_bytes.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        address = f"unix:{tmp}/echo.sock"
        ctx = mp.get_context("spawn")
        ready, stop, cpu = ctx.Event(), ctx.Event(), ctx.Value("d", 0.0)
        server = ctx.Process(target=_serve, args=(address, ready, stop, cpu), daemon=True)
        server.start()
        if not ready.wait(30):
            print("the echo server did not start", file=sys.stderr)
            return 1
        print(f"{args.messages} round trips per run, unix socket, pid {os.getpid()}")
        print(f"{'link':<8} {'bytes':>6} {'round trips/s':>14} {'client us/rt':>13} {'server us/rt':>13}")
        for _ in range(args.repeat_runs):
            for size in sizes:
                for kind in ("grpc", "frames"):
                    s0 = cpu.value
                    wall, client_cpu = eventloop.run(_ping_pong(address, kind, args.messages, b"x" * size))
                    time.sleep(0.1)  # the server's CPU figure is refreshed every 20 ms
                    server_cpu = cpu.value - s0
                    print(f"{kind:<8} {size:>6} {args.messages / wall:>14,.0f} {1e6 * client_cpu / args.messages:>13.1f}"
                          f" {1e6 * server_cpu / args.messages:>13.1f}")
        stop.set()
        server.join(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
