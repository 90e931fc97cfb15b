"""The transport's own ceiling: grpc.aio streaming with no engine behind it. Feeds
docs/benchmarks.md, section "What the transport alone can do".

    python benchmarks/grpc_ceiling.py [--requests 2048] [--concurrency 256]
        [--tokens-per-request 64] [--tokens-per-message 1,4,16]

A server process answers pagewire.v1.Generation/Generate by streaming prebuilt responses as fast
as the client reads them (``tokens-per-request / tokens-per-message`` messages per call, each
carrying that many token ids and their text), and a client in this process opens ``--requests``
calls, ``--concurrency`` at a time, and drains them: the same shape as ``pagewire bench --worker
null`` minus scheduling, detokenization and the worker. It prints requests/s, messages/s,
tokens/s and both processes' CPU use, which says how many tokens/s any Python gRPC scheduler
could stream on this machine at a given number of tokens per message.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import socket
import time

import grpc

from pagewire_common.v1 import generation_pb2 as pb
from pagewire_common.v1 import generation_pb2_grpc as pb_grpc


class _Streamer(pb_grpc.GenerationServicer):
    def __init__(self, messages: int, tokens_per_message: int):
        self.response = pb.GenerateResponse(token_ids=[1234] * tokens_per_message, text=" the" * tokens_per_message)
        self.last = pb.GenerateResponse(
            token_ids=[1234] * tokens_per_message, text=" the" * tokens_per_message, finish_reason=pb.LENGTH
        )
        self.messages = messages

    async def Generate(self, request, context):
        for _ in range(self.messages - 1):
            yield self.response
            await asyncio.sleep(0)  # let other streams write, as the engine's delivery does
        yield self.last


def _serve(port: int, messages: int, tokens_per_message: int, ready, stop) -> None:
    async def main():
        server = grpc.aio.server()
        pb_grpc.add_GenerationServicer_to_server(_Streamer(messages, tokens_per_message), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        ready.set()
        while not stop.is_set():
            await asyncio.sleep(0.05)
        await server.stop(None)

    asyncio.run(main())


async def _client(port: int, requests: int, concurrency: int) -> tuple[float, float, int, int]:
    """(wall seconds, client CPU seconds, messages, tokens) of the timed run, after a short warmup."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.GenerationStub(channel)
        queue = list(range(8))
        counts = [0, 0]  # messages, tokens

        async def worker():
            while queue:
                i = queue.pop()
                async for resp in stub.Generate(pb.GenerateRequest(request_id=str(i), prompt_token_ids=list(range(16)))):
                    counts[0] += 1
                    counts[1] += len(resp.token_ids)

        await asyncio.gather(*(worker() for _ in range(min(4, concurrency))))  # warm the channel
        queue.extend(range(requests))
        counts[:] = [0, 0]
        start, cpu = time.perf_counter(), time.process_time()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - start, time.process_time() - cpu, counts[0], counts[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_one(requests: int, concurrency: int, tokens_per_request: int, tokens_per_message: int) -> dict:
    if tokens_per_request % tokens_per_message:
        raise SystemExit(f"--tokens-per-request {tokens_per_request} is not a multiple of {tokens_per_message}")
    ctx = mp.get_context("spawn")
    port = _free_port()
    ready, stop = ctx.Event(), ctx.Event()
    server = ctx.Process(
        target=_serve, args=(port, tokens_per_request // tokens_per_message, tokens_per_message, ready, stop), daemon=True
    )
    server.start()
    try:
        if not ready.wait(30):
            raise SystemExit("the server process did not start")
        server_cpu_start = _process_cpu(server.pid)
        wall, client_cpu, messages, tokens = asyncio.run(_client(port, requests, concurrency))
        server_cpu = _process_cpu(server.pid) - server_cpu_start  # includes the short warmup
    finally:
        stop.set()
        server.join(10)
        if server.is_alive():
            server.kill()
    return {
        "tokens_per_message": tokens_per_message,
        "requests_per_s": requests / wall,
        "messages_per_s": messages / wall,
        "tokens_per_s": tokens / wall,
        "client_cpu": client_cpu / wall,
        "server_cpu": server_cpu / wall,
    }


def _process_cpu(pid: int) -> float:
    """User + system CPU seconds of a live process (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=2048)
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--tokens-per-request", type=int, default=64)
    ap.add_argument("--tokens-per-message", default="1,4,16", help="comma-separated; one run each")
    args = ap.parse_args()
    print(f"{'tokens/msg':>10} {'req/s':>8} {'msg/s':>9} {'tokens/s':>9} {'client CPU':>10} {'server CPU':>10}")
    for n in (int(x) for x in args.tokens_per_message.split(",")):
        r = run_one(args.requests, args.concurrency, args.tokens_per_request, n)
        print(
            f"{n:>10} {r['requests_per_s']:>8.0f} {r['messages_per_s']:>9.0f} {r['tokens_per_s']:>9.0f}"
            f" {r['client_cpu']:>10.0%} {r['server_cpu']:>10.0%}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
