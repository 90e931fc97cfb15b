"""Running the scheduler service: ``pagewire scheduler`` and the scheduler half of ``pagewire serve``."""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import time

from grpc_health.v1 import health_pb2

from scheduler_svc.engine_loop import EngineOptions, EngineService
from scheduler_svc.server import SERVICE_NAME, build_server

log = logging.getLogger("pagewire.scheduler")


def options_from_args(args) -> EngineOptions:
    return EngineOptions(
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        enable_prefix_caching=not args.no_prefix_cache,
        max_queued_requests=args.max_queued_requests,
        max_model_len=args.max_model_len,
        overlap=not args.no_overlap,
        stream_interval=args.stream_interval,
        admission_turns=args.admission_turns,
        prefill_pacing_steps=args.prefill_pacing_steps,
    )


async def run_scheduler(
    worker_address: str,
    listen: str,
    options: EngineOptions,
    shutdown_timeout: float = 30.0,
    ready_message: str | None = None,
    stop_event: asyncio.Event | None = None,
) -> int:
    """Serve until SIGINT/SIGTERM (or ``stop_event``): then refuse new requests, let running ones
    finish for up to ``shutdown_timeout`` seconds, and stop."""
    loop = asyncio.get_running_loop()
    health_servicer = None

    def on_health(serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING

        async def _set():
            for name in ("", SERVICE_NAME):
                await health_servicer.set(name, status)

        if health_servicer is not None:
            loop.create_task(_set())

    service = EngineService(worker_address, options, on_health=on_health)
    server, port, servicer, health_servicer = await build_server(service, listen)
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    service.start()

    stop = stop_event or asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread
            pass

    # wait for the worker before saying we are ready
    while not service.connected.is_set() and not stop.is_set():
        await asyncio.sleep(0.05)
    if not stop.is_set():
        # what exists now (tokenizer tables, gRPC and protobuf machinery) lives as long as the
        # process: move it out of the collector's view, so full collections while serving
        # only walk per-request objects
        gc.collect()
        gc.freeze()
        for name in ("", SERVICE_NAME):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        info = service.worker_info
        print(
            ready_message
            or f"pagewire scheduler ready on {listen} (port {port}), worker {worker_address}: {info.model_name}",
            flush=True,
        )
    await stop.wait()

    print("pagewire: shutting down: no new requests, letting running ones finish...", flush=True)
    servicer.draining = True
    await health_servicer.enter_graceful_shutdown()
    deadline = time.monotonic() + shutdown_timeout
    while service.num_in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if service.num_in_flight:
        log.warning("%d requests still running after %.0fs; cancelling them", service.num_in_flight, shutdown_timeout)
    await server.stop(grace=1.0)
    await service.stop()
    return 0
