"""The scheduler core process: ``pagewire scheduler``, which starts and supervises its API servers.

The core serves ``pagewire.v1.SchedulerCore`` on a private address (a unix socket in a temp
folder unless ``--core-listen`` names one) and starts ``--api-servers N`` processes running
``pagewire api-server --scheduler CORE --listen PUBLIC``, which all listen on the public address
with SO_REUSEPORT. It is ready once the worker is connected and every API server has said it is
ready. SIGTERM: the API servers stop taking requests and let theirs finish, then the core stops.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import shutil
import signal
import tempfile

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pagewire_common import step_profile
from pagewire_common.addresses import add_port, check_address_free, check_api_servers, check_distinct, http_url
from pagewire_common.envs import METRICS_MULTIPROC_ENV, metrics_multiprocess_dir
from pagewire_common.settings import API, PUBLIC, Settings
from pagewire_common.supervisor import Supervisor, cli_argv, parent_run_dir
from pagewire_common.tls import TlsFiles
from pagewire_common.v1 import core_pb2_grpc
from scheduler_svc.core.service import CoreService

log = logging.getLogger("pagewire.scheduler")
CORE_SERVICE_NAME = "pagewire.v1.SchedulerCore"


def api_server_argv(core_address: str, listen: str, settings: Settings, log_level: str,
                    primary_cores: int | None = None) -> list[str]:
    """The command line of an API server (the API key travels in its environment: ``to_env``)."""
    primary = ["--primary-cores", str(primary_cores)] if primary_cores is not None else []
    return cli_argv(log_level, "api-server", "--scheduler", core_address, "--listen", listen, "--reuse-port",
                    "--http-listen", settings.http_listen, "--shutdown-timeout", str(settings.shutdown_timeout),
                    *primary, *settings.to_argv((API, PUBLIC)))


async def run_scheduler(worker_address: str, listen: str | None, settings: Settings, *, core_listen: str | None = None,
                        log_level: str = "info", stop_event: asyncio.Event | None = None) -> int:
    """The core process: serve until SIGINT/SIGTERM (or ``stop_event``), then drain and stop.
    ``listen`` None: the core only, on ``core_listen``, with no API servers of its own (those of
    ``serve --data-parallel-size`` or of another machine connect to it)."""
    num_api_servers = settings.api_servers if listen is not None else 0
    if listen is None:
        if core_listen is None:
            raise ValueError("a core without API servers (--core-only) needs --core-listen, the address they connect to")
        listen = "(none)"
    else:
        check_distinct(listen, settings.http_listen)
        check_api_servers(listen, settings.api_servers)
        listen = check_address_free(listen, wait_s=5.0)
        if settings.http_listen != "off":
            settings = settings.replace(http_listen=check_address_free(settings.http_listen, wait_s=5.0))
        TlsFiles.load(settings.tls_cert_file, settings.tls_key_file)  # a bad file stops us here, not each API server
    step_profile.configure("core", settings.profile_steps)
    loop = asyncio.get_running_loop()
    if core_listen is not None:
        check_address_free(core_listen)
    # inside serve's own temp folder when serve started us: a core killed outright leaves nothing
    tmpdir = tempfile.mkdtemp(prefix="pagewire-core-", dir=parent_run_dir())
    if core_listen is None:
        core_listen = f"unix:{tmpdir}/core.sock"
    if not metrics_multiprocess_dir():
        # the API servers write their request metrics here, so any of them reports all of them
        os.mkdir(f"{tmpdir}/metrics")
        os.environ[METRICS_MULTIPROC_ENV] = f"{tmpdir}/metrics"
    stop = stop_event or asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread
            pass

    health_servicer = health.aio.HealthServicer()

    def on_health(serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        loop.create_task(health_servicer.set(CORE_SERVICE_NAME, status))

    core = CoreService(worker_address, settings, on_health=on_health)
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 256 * 1024 * 1024),
                                      ("grpc.max_send_message_length", 256 * 1024 * 1024),
                                      ("grpc.so_reuseport", 0),
                                      ("grpc.keepalive_permit_without_calls", 1),
                                      ("grpc.http2.min_ping_interval_without_data_ms", 1000),
                                      ("grpc.http2.max_ping_strikes", 0),
                                      # an API server that stops answering (frozen, not just gone) is
                                      # dropped in seconds: the core waits for every API server
                                      # (backpressure), so a silent one must not hold the others
                                      ("grpc.keepalive_time_ms", 2000),
                                      ("grpc.keepalive_timeout_ms", 3000),
                                      # keep pinging while the stream is quiet (the core waits on it)
                                      ("grpc.http2.max_pings_without_data", 0)])
    core_pb2_grpc.add_SchedulerCoreServicer_to_server(core, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    try:
        add_port(server, core_listen)
        await core.frames.start(core_listen)
    except OSError:
        if tmpdir:
            shutil.rmtree(tmpdir, ignore_errors=True)
        raise
    await server.start()
    await health_servicer.set(CORE_SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
    core.start()

    failed: list[str] = []
    supervisor = Supervisor(on_give_up=lambda message: (failed.append(message), stop.set()),
                            env={**os.environ, **settings.to_env((PUBLIC,))})
    for i in range(num_api_servers):
        supervisor.start(f"API server {i + 1}", api_server_argv(core_listen, listen, settings, log_level))
    watcher = loop.create_task(supervisor.watch())
    try:
        # ready: the worker is connected and every API server said it is ready
        # (woken by the change itself, not by a poll)
        while not stop.is_set() and not (core.connected.is_set() and core.num_ready_clients >= num_api_servers):
            core.readiness_changed.clear()
            waits = {loop.create_task(core.readiness_changed.wait()), loop.create_task(stop.wait())}
            _, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for task in pending:
                task.cancel()
        if not stop.is_set():
            for name in supervisor.children:
                supervisor.mark_ready(name)
            gc.collect()
            gc.freeze()  # what exists now lives as long as the process: keep it out of full collections
            if num_api_servers:
                log.info("scheduler ready on %s%s with %d API server(s), worker %s: %s", listen,
                         http_url(settings.http_listen, settings.tls_cert_file is not None), num_api_servers,
                         worker_address, core.worker_info.model_name)
            else:
                log.info("engine core ready on %s, worker %s: %s", core_listen, worker_address,
                         core.worker_info.model_name)
            core.scheduler_ready = True  # CoreInfo says so from now on (serve waits for it)
        await stop.wait()
        log.info("shutting down: no new requests, letting running ones finish")
        # the API servers drain: they refuse new calls and wait for theirs, which the core keeps stepping
        await supervisor.stop(timeout=settings.shutdown_timeout + 5)
        if not num_api_servers:  # theirs are elsewhere: the core refuses new requests and waits here
            await core.drain(settings.shutdown_timeout)
        watcher.cancel()
        if core.num_in_flight:
            log.warning("%d requests were still running; cancelled", core.num_in_flight)
    finally:
        if not supervisor.stopping:
            await supervisor.stop(timeout=5)
        watcher.cancel()
        await server.stop(grace=1.0)
        await core.stop()
        shutil.rmtree(tmpdir, ignore_errors=True)
    return 1 if failed else 0
