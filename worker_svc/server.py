"""The worker's gRPC service: ``Info`` and the long-lived ``Execute`` session, whose frame link
carries the step plans and their results (``pagewire_common.framelink``).

It runs on grpc.aio with the event loop on the process's main thread, and executes each plan
inline on that thread: there is one scheduler and one plan at a time, so nothing else needs the
loop during a step, and no step ever crosses a thread. (torch's CPU kernels also run markedly
slower when driven from a thread other than the main one: 1.5x here, as OpenMP sets up a thread
team per calling thread.) gRPC's core keeps answering keepalive pings on the session from its own
poller thread while a step runs. A runner that launches steps ahead (CUDA) has each plan launched
as it arrives and the step before it finished after; while a launched step runs with no plan
come yet, one helper thread waits on its event, so that its result goes as soon as the device is
done (``WorkerServicer._launch_ahead``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import logging
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pagewire_common import eventloop, step_profile, wire
from pagewire_common.addresses import add_port, check_address_free, describe, peer_name
from pagewire_common.framelink import FrameListener, LinkClosed
from pagewire_common.v1 import worker_pb2, worker_pb2_grpc
from pagewire_common.wire import TOKENIZER_FILES
from worker_svc.nvtx import nvtx_range
from worker_svc.parallel.group import GroupFailed

log = logging.getLogger("pagewire.worker")

MAX_MESSAGE_BYTES = 256 * 1024 * 1024
SERVICE_NAME = "pagewire.v1.Worker"


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    """Applies step plans from one scheduler at a time. A new ``Execute`` session means a
    (re)connected scheduler with fresh block accounting, so per-sequence state starts empty;
    a second concurrent session is refused with FAILED_PRECONDITION."""

    def __init__(self, runner, model_name: str, eos_token_ids: tuple[int, ...], on_fatal=None):
        self.runner = runner
        self.model_name = model_name
        self.eos_token_ids = eos_token_ids
        self._connected = False
        self.num_steps = 0
        self.frames = FrameListener()
        # called with a reason when the worker cannot go on (a tensor-parallel rank is gone)
        self.on_fatal = on_fatal or (lambda reason: None)

    def info_response(self) -> worker_pb2.InfoResponse:
        mc = self.runner.model_config
        files = {}
        for name in TOKENIZER_FILES:
            path = Path(self.runner.model_dir) / name
            if path.is_file():
                files[name] = path.read_bytes()
        return worker_pb2.InfoResponse(
            model_name=self.model_name,
            model_type=mc.model_type,
            vocab_size=mc.vocab_size,
            max_model_len=self.runner.max_model_len,
            block_size=self.runner.block_size,
            num_kv_blocks=self.runner.num_kv_blocks,
            eos_token_ids=list(self.eos_token_ids),
            dtype=str(self.runner.dtype).removeprefix("torch."),
            device=str(self.runner.device),
            num_layers=mc.num_layers,
            hidden_size=mc.hidden_size,
            tokenizer_files=files,
            frame_link=self.frames.describe(),
            structured_output=self.runner.structured_output,
        )

    async def Info(self, request, context):
        return self.info_response()

    async def Execute(self, request, context):
        conn = await self.frames.open_session(request, context)
        if self._connected:
            conn.close()
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "another scheduler is already connected")
        self._connected = True
        runner = self.runner
        failed: GroupFailed | None = None
        try:
            runner.reset()
            log.info("scheduler connected (%s)", peer_name(context.peer()))
            # the step's phases around the runner's own (worker_svc.nvtx): the time waiting for
            # the plan (idle included), decoding it, encoding and writing the result
            if getattr(runner, "launch_ahead", False):
                await self._launch_ahead(conn, context)
            else:
                while True:
                    with nvtx_range("wait for plan"):
                        data = await conn.read()
                    if data is None:
                        break
                    plan = self._decode(data)
                    result = await self._run(runner.execute, plan, context)  # inline: nothing else to do
                    self._send(conn, result)
        except LinkClosed as e:  # the scheduler went away mid-step (it stopped, or died): as a disconnect
            log.info("the scheduler's link closed: %s", e)
        except GroupFailed as e:  # as for a dead worker: UNAVAILABLE, and the worker stops
            failed = e
            self.on_fatal(str(e))
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the worker lost a rank: {e}")
        finally:
            conn.close()
            self._connected = False
            if failed is None:
                try:
                    runner.reset()
                except GroupFailed as e:
                    self.on_fatal(str(e))
            log.info("scheduler disconnected")

    @staticmethod
    def _decode(data: bytes):
        with nvtx_range("plan decode"):
            return wire.plan_from_pb(worker_pb2.StepPlan.FromString(data))

    @staticmethod
    async def _run(call, plan, context):
        try:
            return call(plan)
        except (KeyError, ValueError) as e:  # a plan that contradicts our state
            log.error("bad step plan %d: %s", plan.step_id, e)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"step {plan.step_id}: {e}")

    def _send(self, conn, result) -> None:
        self.num_steps += 1
        with nvtx_range("result send"):
            conn.write(wire.result_to_pb(result).SerializeToString())
        step_profile.end_step(len(result.token_ids))

    async def _launch_ahead(self, conn, context) -> None:
        """Steps launched ahead (``ModelRunner.launch``): each plan is launched as it arrives, and
        the step before it is finished (its result sent) only after, so the device runs step N
        while the host reads, decodes and launches plan N+1. A launched step waits for the next
        plan only while the device runs it: if the device is done first, its result goes at
        once (the scheduler may be waiting for it before it sends another plan)."""
        runner = self.runner
        loop = asyncio.get_running_loop()
        waiter = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="step-wait")
        pending = None  # the launched step not yet finished
        reading = None  # the read of the next plan, while a step runs
        try:
            while True:
                if pending is not None and reading is None and not conn.has_frame() and not pending.ready():
                    reading = asyncio.ensure_future(conn.read())
                    with nvtx_range("wait for plan or tokens"):
                        done = loop.run_in_executor(waiter, pending.wait)
                        await asyncio.wait((reading, done), return_when=asyncio.FIRST_COMPLETED)
                plan_here = reading.done() if reading is not None else conn.has_frame()
                if pending is not None and not plan_here:
                    self._send(conn, runner.finish(pending))  # the device finished before the next plan came
                    pending = None
                with nvtx_range("wait for plan"):
                    data = await (reading or conn.read())
                reading = None
                if data is None:
                    break
                launched = await self._run(runner.launch, self._decode(data), context)
                if pending is not None:
                    self._send(conn, runner.finish(pending))
                pending = launched
        finally:
            if reading is not None:
                reading.cancel()
            waiter.shutdown(wait=False)


async def build_server(runner, listen: str, model_name: str, eos_token_ids: tuple[int, ...], on_fatal=None):
    """A started grpc.aio server for ``runner`` on ``listen`` (host:port or unix:PATH), with the
    frame listener of its Execute sessions; returns (server, bound port, servicer, health servicer). Call
    from the event loop that will serve it."""
    server = grpc.aio.server(
        options=[
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),
            # the scheduler pings every 2 s to notice a worker that stops answering
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", 1000),
            ("grpc.http2.max_ping_strikes", 0),
        ],
    )
    servicer = WorkerServicer(runner, model_name, eos_token_ids, on_fatal)
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name, health.SERVICE_NAME, reflection.SERVICE_NAME),
        server,
    )
    port = add_port(server, listen)
    await servicer.frames.start(listen)
    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, port, servicer, health_servicer


def serve(settings, listen: str | None) -> int:
    """``pagewire worker``: load the model (rank 0 of ``--tensor-parallel-size`` ranks: start and join
    the others), size the KV cache, serve until SIGINT/SIGTERM. With ``--rank R`` (R > 0), run that
    rank only: it serves nothing and follows rank 0's plans."""
    if not settings.rank:
        if listen is None:
            raise ValueError("--listen is required (only a rank other than 0 runs without it)")
        check_address_free(listen)  # before torch and the model load: a taken address is one line, at once
    from kvcache.paged import keep_triton_out
    from worker_svc.dtypes import dtype_name
    from worker_svc.parallel.ranks import leave, run_rank, start_runner
    from worker_svc.runner import RunnerConfig, resolve_device
    from worker_svc.weights import model_name, resolve_model_path

    if resolve_device(settings.device).type != "cuda":
        keep_triton_out()
    model_dir = resolve_model_path(settings.model)
    if settings.rank:
        return run_rank(model_dir, settings)
    step_profile.configure("worker", settings.profile_steps)
    if settings.num_threads:
        import torch

        torch.set_num_threads(settings.num_threads)
    t0 = time.monotonic()
    if settings.worker == "null":  # no model math: measures the control plane
        from worker_svc.null_runner import NullRunner

        if settings.num_ranks > 1:
            raise ValueError("--worker null runs no model: it takes no --tensor-parallel-size")
        runner = NullRunner(model_dir, RunnerConfig.from_settings(settings))
    else:
        runner = start_runner(model_dir, settings)
    eos = tuple(runner.model_config.eos_token_ids)
    name = settings.served_model_name or model_name(settings.model, model_dir)
    what = f"{runner.model_config.model_type}, {dtype_name(runner.dtype)} on {runner.device}"
    if settings.worker == "null":
        what = f"null worker, no model math, {runner.model_config.model_type} config"
    num_ranks = getattr(getattr(runner, "tp", None), "size", 1)
    if num_ranks > 1:
        what += f", {num_ranks} tensor-parallel ranks"
    summary = (f"{name} ({what}), {runner.num_kv_blocks} KV blocks x {runner.block_size} tokens, "
               f"max model length {runner.max_model_len}, loaded in {time.monotonic() - t0:.1f} s")
    try:
        code = eventloop.run(_serve_until_signal(runner, listen, name, eos, summary))
    finally:
        if hasattr(runner, "close"):
            runner.close()
    if num_ranks > 1:
        leave(code)  # as the other ranks do: interpreter exit after gloo can abort the process
    return code


async def _serve_until_signal(runner, listen: str, model_name: str, eos, summary: str) -> int:
    import signal

    stop = asyncio.Event()
    fatal: list[str] = []

    def on_fatal(reason: str) -> None:
        if not fatal:
            log.error("stopping the worker: %s", reason)
        fatal.append(reason)
        stop.set()

    server, port, servicer, health_servicer = await build_server(runner, listen, model_name, eos, on_fatal)
    gc.collect()  # the model and its modules live as long as the process: keep them out of
    gc.freeze()  # the collector's full collections while serving
    log.info("worker ready on %s: %s", describe(listen, port), summary)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    watch = loop.create_task(_watch_ranks(runner, on_fatal)) if hasattr(runner, "lost_rank") else None
    await stop.wait()
    if watch is not None:
        watch.cancel()
    await health_servicer.enter_graceful_shutdown()
    await server.stop(grace=0 if fatal else 5)
    await servicer.frames.close()
    if fatal:
        log.error("worker stopped: %s", fatal[0])
    else:
        log.info("worker stopped")
    return 1 if fatal else 0


async def _watch_ranks(runner, on_fatal, interval: float = 0.2) -> None:
    """Stop the worker when a rank started here exits while no step runs (during a step, the
    step's collectives fail and ``Execute`` reports it)."""
    while True:
        await asyncio.sleep(interval)
        lost = runner.lost_rank()
        if lost:
            on_fatal(lost)
            return
