"""Server CPU per streamed SSE chunk for the HTTP stacks the OpenAI door could use.

Feeds docs/benchmarks.md, section "5. The OpenAI HTTP door" (why aiohttp). Each stack runs in a
child process that streams ``--chunks`` server-sent events per request to ``--clients``
concurrent readers; the figure is the server process's CPU time (user + system) per chunk, which
is what a busy API server spends, independent of how loaded the machine is. Stacks are run in
turn, ``--rounds`` times, and the median is reported.

    python benchmarks/http_sse_cost.py --chunks 5000 --clients 8 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import socket
import statistics
import time

CHUNK = b'data: {"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":" token","finish_reason":null}]}\n\n'


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve_aiohttp(port: int, chunks: int) -> None:
    from aiohttp import web

    async def handler(request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(chunks):
            await resp.write(CHUNK)
            await asyncio.sleep(0)  # a real door waits for the next step's tokens
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/cpu", _cpu_aiohttp)
    app.router.add_post("/stream", handler)

    async def run():
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        await asyncio.Event().wait()

    _run_loop(run)


async def _cpu_aiohttp(request):
    from aiohttp import web

    t = os.times()
    return web.json_response({"cpu": t.user + t.system})


def _serve_starlette(port: int, chunks: int) -> None:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    async def gen():
        for _ in range(chunks):
            yield CHUNK
            await asyncio.sleep(0)

    async def stream(request):
        return StreamingResponse(gen(), media_type="text/event-stream")

    async def cpu(request):
        t = os.times()
        return JSONResponse({"cpu": t.user + t.system})

    app = Starlette(routes=[Route("/stream", stream, methods=["POST"]), Route("/cpu", cpu)])
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error", access_log=False)
    _run_loop(lambda: uvicorn.Server(config).serve())


def _run_loop(main) -> None:
    try:
        import uvloop

        uvloop.run(main())
    except ImportError:
        asyncio.run(main())


STACKS = {"aiohttp": _serve_aiohttp, "starlette+uvicorn": _serve_starlette}


async def _measure(port: int, clients: int, chunks: int) -> float:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        for _ in range(100):  # wait for the server
            try:
                async with session.get(f"http://127.0.0.1:{port}/cpu") as r:
                    before = (await r.json())["cpu"]
                break
            except aiohttp.ClientConnectionError:
                await asyncio.sleep(0.1)

        async def one():
            n = 0
            async with session.post(f"http://127.0.0.1:{port}/stream") as r:
                async for _ in r.content:
                    n += 1
            return n

        await asyncio.gather(*(one() for _ in range(clients)))
        async with session.get(f"http://127.0.0.1:{port}/cpu") as r:
            after = (await r.json())["cpu"]
    return (after - before) / (clients * chunks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunks", type=int, default=5000, help="SSE chunks per request")
    ap.add_argument("--clients", type=int, default=8, help="concurrent streaming requests")
    ap.add_argument("--rounds", type=int, default=3, help="runs of each stack (median reported)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    results: dict[str, list[float]] = {name: [] for name in STACKS}
    for _ in range(args.rounds):
        for name, serve in STACKS.items():
            port = _free_port()
            proc = mp.get_context("spawn").Process(target=serve, args=(port, args.chunks), daemon=True)
            proc.start()
            try:
                results[name].append(asyncio.run(_measure(port, args.clients, args.chunks)))
            finally:
                proc.terminate()
                proc.join()
    summary = {name: round(statistics.median(v) * 1e6, 2) for name, v in results.items()}
    if args.json:
        from pagewire.bench.report import environment

        print(json.dumps({"cpu_us_per_chunk": summary, "chunks": args.chunks, "clients": args.clients,
                          "rounds": args.rounds, "date": time.strftime("%Y-%m-%d"), "environment": environment()},
                         indent=1))
    else:
        for name, us in summary.items():
            print(f"{name:20s} {us:8.2f} us of server CPU per chunk")


if __name__ == "__main__":
    main()
