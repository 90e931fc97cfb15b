"""``pagewire serve``: the worker and the scheduler (core + API servers) as supervised children;
``pagewire core``: a worker and a core alone, for the API servers of another machine.

This process only starts, watches and stops its children. The worker listens on a private unix
socket, the core on another; the scheduler starts the API servers on the public address. A child
that dies after it was ready is restarted (its calls in flight end UNAVAILABLE; the core
reconnects to a restarted worker by itself); one that dies before it was ever ready, or crashes
again and again, stops serve with a message that says which. SIGINT/SIGTERM: the scheduler drains
(no new calls, running ones finish), then the worker stops.

With ``--data-parallel-size N`` (or ``--data-parallel-cores``) serve starts N workers and N engine
cores (``pagewire scheduler --core-only``), and the API servers itself, each connected to every
core, the local ones and those named; a core that dies fails only its own calls and is restarted.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import tempfile

import grpc

from pagewire_common import eventloop
from pagewire_common.addresses import check_address_free, check_api_servers, check_distinct, http_url
from pagewire_common.envs import METRICS_MULTIPROC_ENV, metrics_multiprocess_dir
from pagewire_common.settings import (
    API,
    CORE,
    PROCESS,
    PUBLIC,
    WORKER,
    Settings,
    check_host_port,
)
from pagewire_common.supervisor import Supervisor, cli_argv, remove_run_dir
from pagewire_common.v1 import core_pb2, core_pb2_grpc
from scheduler_svc.api.server import split_core_addresses
from scheduler_svc.core.main import api_server_argv

log = logging.getLogger("pagewire.serve")


def serve(settings: Settings, listen: str, log_level: str = "info") -> int:
    from pagewire_common.tls import TlsFiles

    # one clear line, before anything starts
    _check_rank(settings)
    check_distinct(listen, settings.http_listen)
    check_api_servers(listen, settings.api_servers)
    if settings.data_parallel_cores is not None:
        for address in split_core_addresses(settings.data_parallel_cores):
            if address in (listen, settings.http_listen):
                raise ValueError(f"--data-parallel-cores names {address}, this server's own "
                                 f"{'--listen' if address == listen else '--http-listen'}: give the addresses that "
                                 "`pagewire core --listen` takes on the other machines")
    listen = check_address_free(listen)
    if settings.http_listen != "off":
        settings = settings.replace(http_listen=check_address_free(settings.http_listen))
    TlsFiles.load(settings.tls_cert_file, settings.tls_key_file)
    data_parallel = settings.data_parallel_size > 1 or settings.data_parallel_cores is not None
    workers = worker_settings(settings) if data_parallel else []
    # the sockets' folder: removed here at the end, or by a child that outlives a hard kill of serve
    run_dir = tempfile.mkdtemp(prefix="pagewire-")
    try:
        if data_parallel:
            return eventloop.run(_serve_data_parallel(settings, listen, log_level, run_dir, workers))
        return eventloop.run(_serve(settings, listen, log_level, run_dir))
    finally:
        remove_run_dir(run_dir)
        log.info("stopped")


def serve_core(settings: Settings, listen: str, log_level: str = "info") -> int:
    """``pagewire core``: a worker and an engine core listening on ``listen`` (host:port), with no
    API servers: those of ``serve --data-parallel-cores`` on another machine connect to it."""
    _check_rank(settings)
    problem = check_host_port(listen)
    if problem:
        raise ValueError(f"--listen {problem}")
    listen = check_address_free(listen)
    run_dir = tempfile.mkdtemp(prefix="pagewire-core-")
    try:
        return eventloop.run(_serve_core(settings, listen, log_level, run_dir))
    finally:
        remove_run_dir(run_dir)
        log.info("stopped")


def _check_rank(settings: Settings) -> None:
    """serve and core run rank 0, the one the scheduler talks to; a rank of its own has no server."""
    if settings.rank:
        raise ValueError(f"--rank {settings.rank}: serve and core run rank 0 of the ranks, which the scheduler "
                         f"talks to; start rank {settings.rank} on its machine with `pagewire worker --rank "
                         f"{settings.rank} --world-size N --distributed-init ADDR`")


def worker_settings(settings: Settings) -> list[Settings]:
    """The settings of each of the ``--data-parallel-size`` workers. On CUDA worker i takes
    cuda:i*T (its T tensor-parallel ranks the GPUs from there); ``ValueError`` when the machine has
    too few GPUs or ``--device`` pins one. On CPU the workers split the machine's cores (cores / N
    threads each, unless ``--num-threads``), as tensor-parallel ranks do."""
    n, per_worker = settings.data_parallel_size, settings.num_ranks
    device = settings.device
    if device is not None and device.startswith("cuda:"):
        raise ValueError(f"--device {device} pins one GPU; with --data-parallel-size {n} give --device cuda "
                         "(worker i takes cuda:i) or leave it unset")
    on_cuda = False
    if device in (None, "cuda"):
        import torch  # only here: a serve with one core never loads torch

        on_cuda = torch.cuda.is_available()
        if device == "cuda" and not on_cuda:
            raise ValueError("--device cuda: this machine has no CUDA device")
    if on_cuda:
        count = torch.cuda.device_count()
        if n * per_worker > count:
            raise ValueError(f"--data-parallel-size {n} x {per_worker} tensor-parallel rank(s) needs "
                             f"{n * per_worker} CUDA devices; this machine has {count}")
        return [settings.replace(device=f"cuda:{i * per_worker}") for i in range(n)]
    threads = settings.num_threads or max(1, (os.cpu_count() or 1) // (n * per_worker))
    return [settings.replace(num_threads=threads if device in (None, "cpu") else settings.num_threads)] * n


async def _serve_data_parallel(settings: Settings, listen: str, log_level: str, run_dir: str,
                               workers: list[Settings]) -> int:
    env = {**os.environ, **settings.to_env((PUBLIC,))}
    if not metrics_multiprocess_dir():
        # the API servers write their request metrics here, so any of them reports all of them
        os.mkdir(f"{run_dir}/metrics")
        env[METRICS_MULTIPROC_ENV] = f"{run_dir}/metrics"
    stop, failed, supervisor = _supervision(run_dir, env)
    local_cores = []
    for i, worker in enumerate(workers):
        worker_addr, core_addr = f"unix:{run_dir}/worker{i}.sock", f"unix:{run_dir}/core{i}.sock"
        supervisor.start(f"worker {i}", cli_argv(log_level, "worker", "--listen", worker_addr,
                                                 *worker.to_argv((WORKER,))))
        supervisor.start(f"engine core {i}", _core_argv(log_level, worker_addr, core_addr, settings))
        local_cores.append(core_addr)
    remote_cores = split_core_addresses(settings.data_parallel_cores) if settings.data_parallel_cores else []
    cores = ",".join(local_cores + remote_cores)
    for j in range(settings.api_servers):
        # serve's own cores say which model is served; one elsewhere serving another is refused
        supervisor.start(f"API server {j + 1}", api_server_argv(cores, listen, settings, log_level,
                                                                 len(local_cores) if remote_cores else None))
    watcher = asyncio.get_running_loop().create_task(supervisor.watch())
    try:
        # ready: every local core has its worker and all the API servers (cores elsewhere join when they can)
        names = await asyncio.gather(*(_wait_ready(core, settings.api_servers, stop) for core in local_cores))
        if names and all(name is not None for name in names):
            for name in list(supervisor.children):
                supervisor.mark_ready(name)
            log.info("pagewire ready: serving %s on %s%s with %d local engine core(s)%s", names[0], listen,
                     http_url(settings.http_listen, settings.tls_cert_file is not None), len(local_cores),
                     f" and {len(remote_cores)} elsewhere ({settings.data_parallel_cores})" if remote_cores else "")
        await stop.wait()
    finally:
        watcher.cancel()
        # the API servers first, all at once (they drain while the cores and workers still compute,
        # and none takes new requests meanwhile), then the cores, then the workers
        api_servers = [name for name in supervisor.children if name.startswith("API server")]
        await supervisor.stop(timeout=settings.shutdown_timeout + 10,
                              order=[api_servers, [f"engine core {i}" for i in range(len(workers))],
                                     [f"worker {i}" for i in range(len(workers))]])
    return supervisor.exit_code if failed else 0


def _supervision(run_dir: str, env: dict[str, str] | None = None) -> tuple[asyncio.Event, list[str], Supervisor]:
    """What every layout of serve starts with: ``stop``, set by SIGINT/SIGTERM or when the
    supervisor gives up on a child, whose message goes into ``failed``; and the supervisor."""
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    failed: list[str] = []
    supervisor = Supervisor(on_give_up=lambda message: (failed.append(message), stop.set()), run_dir=run_dir, env=env)
    return stop, failed, supervisor


def _core_argv(log_level: str, worker_addr: str, core_addr: str, settings: Settings) -> list[str]:
    return cli_argv(log_level, "scheduler", "--worker", worker_addr, "--core-only", "--core-listen", core_addr,
                    "--shutdown-timeout", str(settings.shutdown_timeout), *settings.to_argv((CORE,)))


async def _serve_core(settings: Settings, listen: str, log_level: str, run_dir: str) -> int:
    worker_addr = f"unix:{run_dir}/worker.sock"
    stop, failed, supervisor = _supervision(run_dir)
    supervisor.start("worker", cli_argv(log_level, "worker", "--listen", worker_addr, *settings.to_argv((WORKER,))))
    supervisor.start("engine core", _core_argv(log_level, worker_addr, listen, settings))
    watcher = asyncio.get_running_loop().create_task(supervisor.watch())
    try:
        model_name = await _wait_ready(listen, 0, stop)
        if model_name is not None:
            supervisor.mark_ready("worker")
            supervisor.mark_ready("engine core")
            log.info("pagewire engine core ready: serving %s on %s for the API servers that name it", model_name,
                     listen)
        await stop.wait()
    finally:
        watcher.cancel()
        await supervisor.stop(timeout=settings.shutdown_timeout + 10, order=[["engine core"], ["worker"]])
    return supervisor.exit_code if failed else 0


async def _serve(settings: Settings, listen: str, log_level: str, run_dir: str) -> int:
    worker_addr = f"unix:{run_dir}/worker.sock"
    core_addr = f"unix:{run_dir}/core.sock"
    stop, failed, supervisor = _supervision(run_dir, {**os.environ, **settings.to_env((PUBLIC,))})
    supervisor.start("worker", cli_argv(log_level, "worker", "--listen", worker_addr, *settings.to_argv((WORKER,))))
    supervisor.start("scheduler", cli_argv(log_level, "scheduler", "--worker", worker_addr, "--listen", listen,
                                           "--core-listen", core_addr, *settings.to_argv((CORE, API, PROCESS, PUBLIC))))
    watcher = asyncio.get_running_loop().create_task(supervisor.watch())
    try:
        model_name = await _wait_ready(core_addr, settings.api_servers, stop)
        if model_name is not None:
            supervisor.mark_ready("worker")
            supervisor.mark_ready("scheduler")
            log.info("pagewire ready: serving %s on %s%s", model_name, listen,
                     http_url(settings.http_listen, settings.tls_cert_file is not None))
        await stop.wait()
    finally:
        watcher.cancel()
        # the scheduler first (its API servers drain while the worker still computes), then the worker
        await supervisor.stop(timeout=settings.shutdown_timeout + 10, order=[["scheduler"], ["worker"]])
    return supervisor.exit_code if failed else 0


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
