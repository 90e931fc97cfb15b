"""``pagewire serve``: the worker and the scheduler (core + API servers) as supervised children.

This process only starts, watches and stops its children. The worker listens on a private unix
socket, the core on another; the scheduler starts the API servers on the public address. A child
that dies after it was ready is restarted (its calls in flight end UNAVAILABLE; the core
reconnects to a restarted worker by itself); one that dies before it was ever ready, or crashes
again and again, stops serve with a message that says which. SIGINT/SIGTERM: the scheduler drains
(no new calls, running ones finish), then the worker stops.
"""

from __future__ import annotations

import asyncio
import shutil
import signal
import sys
import tempfile

import grpc

from pagewire_common import eventloop
from pagewire_common.settings import API, CORE, PROCESS, WORKER, Settings
from pagewire_common.supervisor import Supervisor
from pagewire_common.v1 import core_pb2, core_pb2_grpc


def _cli(log_level: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "pagewire.cli", "--log-level", log_level, *args]


def serve(settings: Settings, listen: str, log_level: str = "info") -> int:
    from scheduler_svc.main import check_address_free

    listen = check_address_free(listen)  # one clear line, before anything starts
    if settings.http_listen != "off":
        settings = settings.replace(http_listen=check_address_free(settings.http_listen))
    sock_dir = tempfile.mkdtemp(prefix="pagewire-")
    worker_addr = f"unix:{sock_dir}/worker.sock"
    core_addr = f"unix:{sock_dir}/core.sock"
    if settings.model is None:
        print("pagewire: serving the embedded SmolLM2-135M-Instruct (converted once to a cached copy on first use)",
              flush=True)
    try:
        return eventloop.run(_serve(settings, listen, log_level, worker_addr, core_addr))
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)
        print("pagewire: stopped", flush=True)


async def _serve(settings: Settings, listen: str, log_level: str, worker_addr: str, core_addr: str) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    failed: list[str] = []
    supervisor = Supervisor(on_give_up=lambda message: (failed.append(message), stop.set()))
    supervisor.start("worker", _cli(log_level, "worker", "--listen", worker_addr, *settings.to_argv((WORKER,))))
    supervisor.start("scheduler", _cli(log_level, "scheduler", "--worker", worker_addr, "--listen", listen,
                                       "--core-listen", core_addr, *settings.to_argv((CORE, API, PROCESS))))
    watcher = loop.create_task(supervisor.watch())
    try:
        if await _wait_ready(core_addr, settings.api_servers, stop):
            supervisor.mark_ready("worker")
            supervisor.mark_ready("scheduler")
            from scheduler_svc.main import http_url

            print(f"pagewire ready: serving on {listen}{http_url(settings)}", flush=True)
        await stop.wait()
    finally:
        watcher.cancel()
        # the scheduler first (its API servers drain while the worker still computes), then the worker
        await supervisor.stop(timeout=settings.shutdown_timeout + 10, names=["scheduler", "worker"])
    return 1 if failed else 0


async def _wait_ready(core_addr: str, num_api_servers: int, stop: asyncio.Event) -> bool:
    """Until the core reports the worker connected and every API server ready (or ``stop``)."""
    async with grpc.aio.insecure_channel(core_addr) as channel:
        stub = core_pb2_grpc.SchedulerCoreStub(channel)
        while not stop.is_set():
            try:
                info = await stub.CoreInfo(core_pb2.CoreInfoRequest(), timeout=1.0)
                if info.worker_connected and info.num_api_servers_ready >= num_api_servers:
                    return True
            except grpc.RpcError:
                pass
            try:
                await asyncio.wait_for(stop.wait(), 0.1)
            except asyncio.TimeoutError:
                pass
    return False
