"""The worker's grpc.aio server, in process: one scheduler stream at a time, and steps that run
inline on the server's loop without starving gRPC's keepalive."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest

from pagewire.plan import NewSequence, RunningSequence, StepPlan
from pagewire.sampling import SamplingParams
from scheduler_svc.worker_client import CHANNEL_OPTIONS, WorkerLink, WorkerLinkError
from worker_svc import server as worker_server
from worker_svc.null_runner import NullRunner
from worker_svc.runner import RunnerConfig


class SlowRunner(NullRunner):
    """Blocks the worker's loop for ``delay`` seconds on the steps in ``slow_steps``."""

    delay = 0.0
    slow_steps: frozenset[int] = frozenset()

    def execute(self, plan):
        if plan.step_id in self.slow_steps:
            time.sleep(self.delay)
        return super().execute(plan)


@pytest.fixture()
def worker(tiny_model_dir, tmp_path):
    """A worker server on its own event loop thread; yields (address, runner)."""
    runner = SlowRunner(tiny_model_dir("llama-gqa"), RunnerConfig(block_size=4, num_kv_blocks=64))
    address = f"unix:{tmp_path}/worker.sock"
    loop = asyncio.new_event_loop()
    started = threading.Event()
    holder = {}

    async def serve():
        holder["server"], _, _ = await worker_server.build_server(runner, address, "tiny", (0,))
        started.set()

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(serve(), loop).result(10)
    assert started.wait(10)
    yield address, runner
    asyncio.run_coroutine_threadsafe(holder["server"].stop(None), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def first_step(step_id=0):
    return StepPlan(step_id, new_seqs=[NewSequence(1, [5, 6, 7], [0], 0, 3, SamplingParams(temperature=0))])


def test_a_second_scheduler_stream_is_refused_and_the_next_one_starts_clean(worker):
    address, runner = worker

    async def main():
        first, second = WorkerLink(address), WorkerLink(address)
        first.open()
        await first.send(first_step())
        assert len((await first.receive()).token_ids) == 1
        assert runner.num_seqs == 1
        second.open()
        await second.send(first_step())
        with pytest.raises(WorkerLinkError, match="FAILED_PRECONDITION.*another scheduler"):
            await second.receive()
        first.close_stream()
        for _ in range(100):  # the first stream's cleanup runs on the server's loop
            if runner.num_seqs == 0:
                break
            await asyncio.sleep(0.02)
        assert runner.num_seqs == 0
        second.open()  # the same sequence id is new again: per-stream state was dropped
        await second.send(first_step())
        assert (await second.receive()).step_id == 0
        await first.close()
        await second.close()

    asyncio.run(main())


def test_a_step_longer_than_the_keepalive_timeout_keeps_the_link(worker):
    """Steps run inline on the worker's loop. The scheduler pings every 2 s and gives up after 3 s
    without an answer; gRPC's core must keep answering while a 6 s step blocks the loop."""
    address, runner = worker
    keepalive = dict(CHANNEL_OPTIONS)
    runner.delay = (keepalive["grpc.keepalive_time_ms"] + keepalive["grpc.keepalive_timeout_ms"]) / 1000 + 1
    runner.slow_steps = frozenset({1})

    async def main():
        link = WorkerLink(address)
        link.open()
        await link.send(first_step(0))
        await link.receive()
        t0 = time.monotonic()
        await link.send(StepPlan(1, running_seqs=[RunningSequence(1, 1)]))
        result = await link.receive()
        assert time.monotonic() - t0 >= runner.delay
        assert result.step_id == 1 and result.seq_ids == [1]
        await link.send(StepPlan(2, running_seqs=[RunningSequence(1, 1, block_table_start=1, block_ids=[1])]))
        assert (await link.receive()).step_id == 2  # the stream is still the same, healthy one
        await link.close()

    asyncio.run(main())


def test_a_plan_that_contradicts_the_worker_state_ends_the_stream_with_invalid_argument(worker):
    address, _ = worker

    async def main():
        link = WorkerLink(address)
        link.open()
        await link.send(StepPlan(0, running_seqs=[RunningSequence(42, 1)]))
        with pytest.raises(WorkerLinkError, match="INVALID_ARGUMENT.*not known"):
            await link.receive()
        await link.close()

    asyncio.run(main())


def test_info_over_grpc(worker):
    from pagewire.v1 import worker_pb2, worker_pb2_grpc

    address, _ = worker
    with grpc.insecure_channel(address) as channel:
        info = worker_pb2_grpc.WorkerStub(channel).Info(worker_pb2.InfoRequest(), timeout=5)
    assert (info.model_name, info.block_size, info.num_kv_blocks) == ("tiny", 4, 64)
    assert "tokenizer.json" in info.tokenizer_files
