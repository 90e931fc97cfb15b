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
import logging
import os
import shutil
import signal
import sys
import tempfile

import grpc

from pagewire_common import eventloop
from pagewire_common.addresses import check_address_free, http_url
from pagewire_common.settings import API, CORE, PROCESS, PUBLIC, WORKER, Settings
from pagewire_common.supervisor import Supervisor
from pagewire_common.v1 import core_pb2, core_pb2_grpc

log = logging.getLogger("pagewire.serve")


def _cli(log_level: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "pagewire.cli", "--log-level", log_level, *args]


def serve(settings: Settings, listen: str, log_level: str = "info") -> int:
    from pagewire_common.tls import TlsFiles

    # one clear line, before anything starts
    listen = check_address_free(listen)
    if settings.http_listen != "off":
        settings = settings.replace(http_listen=check_address_free(settings.http_listen))
    TlsFiles.load(settings.tls_cert_file, settings.tls_key_file)
    # the sockets' folder: removed here at the end, or by a child that outlives a hard kill of serve
    run_dir = tempfile.mkdtemp(prefix="pagewire-")
    try:
        return eventloop.run(_serve(settings, listen, log_level, run_dir))
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
        log.info("stopped")


async def _serve(settings: Settings, listen: str, log_level: str, run_dir: str) -> int:
    worker_addr = f"unix:{run_dir}/worker.sock"
    core_addr = f"unix:{run_dir}/core.sock"
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    failed: list[str] = []
    supervisor = Supervisor(on_give_up=lambda message: (failed.append(message), stop.set()), run_dir=run_dir,
                            env={**os.environ, **settings.to_env((PUBLIC,))})
    supervisor.start("worker", _cli(log_level, "worker", "--listen", worker_addr, *settings.to_argv((WORKER,))))
    supervisor.start("scheduler", _cli(log_level, "scheduler", "--worker", worker_addr, "--listen", listen,
                                       "--core-listen", core_addr, *settings.to_argv((CORE, API, PROCESS, PUBLIC))))
    watcher = loop.create_task(supervisor.watch())
    try:
        model_name = await _wait_ready(core_addr, settings.api_servers, stop)
        if model_name is not None:
            supervisor.mark_ready("worker")
            supervisor.mark_ready("scheduler")
            log.info("pagewire ready: serving %s on %s%s", model_name, listen, http_url(settings.http_listen))
        await stop.wait()
    finally:
        watcher.cancel()
        # the scheduler first (its API servers drain while the worker still computes), then the worker
        await supervisor.stop(timeout=settings.shutdown_timeout + 10, names=["scheduler", "worker"])
    return 1 if failed else 0


async def _wait_ready(core_addr: str, num_api_servers: int, stop: asyncio.Event) -> str | None:
    """Until the scheduler reports itself ready (the worker connected, every API server ready): the
    served model's name (None when ``stop`` came first)."""
    async with grpc.aio.insecure_channel(core_addr) as channel:
        stub = core_pb2_grpc.SchedulerCoreStub(channel)
        while not stop.is_set():
            try:
                info = await stub.CoreInfo(core_pb2.CoreInfoRequest(), timeout=1.0)
                if info.scheduler_ready and info.worker_connected and info.num_api_servers_ready >= num_api_servers:
                    return info.model_name
            except grpc.RpcError:
                pass
            try:
                await asyncio.wait_for(stop.wait(), 0.1)
            except asyncio.TimeoutError:
                pass
    return None
