"""One API-server process: ``pagewire api-server``, which the core starts (``--api-servers N``, all
on the public address with SO_REUSEPORT; serve starts them itself with ``--data-parallel-size``)
and which talks to each engine core over one ``Connect`` stream.
SIGTERM: it refuses new calls, lets its running ones finish for up to ``--shutdown-timeout``
seconds, and stops.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import time

from grpc_health.v1 import health_pb2

from pagewire_common import step_profile
from pagewire_common.addresses import check_address_free, check_distinct, describe, http_url
from pagewire_common.chat_template import load_chat_template
from pagewire_common.settings import Settings
from pagewire_common.tls import TlsFiles
from scheduler_svc.api.http_server import start_http
from scheduler_svc.api.metrics import RequestMetrics
from scheduler_svc.api.server import SERVICE_NAME, ApiServer, build_server, stop_servers

api_log = logging.getLogger("pagewire.api")


async def run_api_server(core_address: str, listen: str, settings: Settings, *, reuse_port: bool = False,
                         primary_cores: int | None = None, stop_event: asyncio.Event | None = None) -> int:
    """One API-server process: serve until SIGINT/SIGTERM, then refuse new calls, let running
    ones finish for up to ``--shutdown-timeout`` seconds, and stop."""
    loop = asyncio.get_running_loop()
    health_holder: list = []

    def on_health(serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING

        async def _set():
            for name in ("", SERVICE_NAME):
                await health_holder[0].set(name, status)

        if health_holder and not api.draining:
            loop.create_task(_set())

    check_distinct(listen, settings.http_listen)
    if not reuse_port:
        check_address_free(listen)
        if settings.http_listen != "off":
            check_address_free(settings.http_listen)
    tls = TlsFiles.load(settings.tls_cert_file, settings.tls_key_file)
    step_profile.configure("api-server", settings.profile_steps)
    api = ApiServer(core_address, settings.stream_interval, on_health=on_health, metrics=RequestMetrics(),
                    routing=settings.data_parallel_routing,
                    balance_threshold=settings.data_parallel_balance_threshold,
                    chat_template=load_chat_template(settings.chat_template) if settings.chat_template else None,
                    primary_cores=primary_cores)
    servers, port, servicer, health_servicer = await build_server(api, listen, reuse_port,
                                                                  listeners=settings.grpc_listeners,
                                                                  api_key=settings.api_key, tls=tls)
    health_holder.append(health_servicer)
    http_runner = None
    if settings.http_listen != "off":
        try:
            http_runner, http_port = await start_http(api, settings.http_listen, reuse_port, api_key=settings.api_key,
                                                      ssl_context=tls.ssl_context() if tls is not None else None)
        except OSError:
            await stop_servers(servers, grace=None)
            raise
        settings = settings.replace(http_listen=f"{settings.http_listen.rpartition(':')[0]}:{http_port}")
    api.start()
    stop = stop_event or asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass
    while not api.connected.is_set() and not stop.is_set():
        await asyncio.sleep(0.05)
    if not stop.is_set():
        gc.collect()
        gc.freeze()
        api_log.info("api-server ready on %s%s (pid %d), engine core(s) %s", describe(listen, port),
                     http_url(settings.http_listen, settings.tls_cert_file is not None), os.getpid(), core_address)
    await stop.wait()
    api.draining = True
    api_log.info("api-server (pid %d) shutting down: new requests are refused, running ones finish (within %g s)",
                 os.getpid(), settings.shutdown_timeout)
    await health_servicer.enter_graceful_shutdown()
    deadline = time.monotonic() + settings.shutdown_timeout
    while api.num_pending and time.monotonic() < deadline and api.core_connected:
        await asyncio.sleep(0.05)
    if api.num_pending:
        api_log.warning("%d requests still running after %.0fs; cancelling them", api.num_pending, settings.shutdown_timeout)
        # each call ends with this, within the servers' grace below, rather than gRPC's "Cancelling all calls"
        api.fail_pending(f"the server is shutting down: the request did not finish within --shutdown-timeout "
                         f"({settings.shutdown_timeout:g} s)")
    if http_runner is not None:
        await http_runner.cleanup()
    await stop_servers(servers, grace=1.0)
    await api.stop()
    return 0
