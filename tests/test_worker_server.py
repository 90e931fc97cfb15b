"""The worker's grpc.aio server: one scheduler stream at a time, and steps that run inline on the
server's loop without starving gRPC's keepalive.

The worker runs in its own process, as in production (the module's ``__main__`` serves a
NullRunner that can block its loop on chosen steps), so each process has one event loop."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import grpc
import pytest

from pagewire_common.framelink import CHANNEL_OPTIONS
from pagewire_common.plan import NewSequence, RunningSequence, StepPlan
from pagewire_common.sampling import SamplingParams
from scheduler_svc.core.worker_client import WorkerLink, WorkerLinkError
from tests.service_utils import REPO, free_port

KEEPALIVE = dict(CHANNEL_OPTIONS)
# longer than the scheduler's keepalive interval plus its timeout: a link that needed the worker's
# loop to answer pings would be declared dead during such a step
SLOW_STEP_SECONDS = (KEEPALIVE["grpc.keepalive_time_ms"] + KEEPALIVE["grpc.keepalive_timeout_ms"]) / 1000 + 1


def _serve(model_dir: str, address: str, delay: str, slow_steps: str) -> None:
    """Subprocess entry (arguments from argv): a worker server whose runner sleeps ``delay``
    seconds on the comma-separated ``slow_steps``."""
    from worker_svc import server as worker_server
    from worker_svc.null_runner import NullRunner
    from worker_svc.runner import RunnerConfig

    seconds = float(delay)
    slow = {int(s) for s in slow_steps.split(",") if s}

    class SlowRunner(NullRunner):
        def execute(self, plan):
            if plan.step_id in slow:
                time.sleep(seconds)  # blocks the server's event loop, as a long model step does
            return super().execute(plan)

    runner = SlowRunner(model_dir, RunnerConfig(block_size=4, num_kv_blocks=64))

    async def main():
        server, _, _, _ = await worker_server.build_server(runner, address, "tiny", (0,))
        print("worker ready", flush=True)
        await server.wait_for_termination()

    asyncio.run(main())


@pytest.fixture()
def start_worker(tiny_model_dir, tmp_path):
    """start_worker(delay=0, slow_steps=()) -> address of a worker process."""
    procs = []

    def start(delay: float = 0.0, slow_steps=(), tcp: bool = False) -> str:
        address = f"127.0.0.1:{free_port()}" if tcp else f"unix:{tmp_path}/worker-{len(procs)}.sock"
        args = [str(tiny_model_dir("llama-gqa")), address, str(delay), ",".join(map(str, slow_steps))]
        proc = subprocess.Popen(
            [sys.executable, "-c", "import sys; from tests.test_worker_server import _serve; _serve(*sys.argv[1:])", *args],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        procs.append(proc)
        start.pids.append(proc.pid)
        for line in proc.stdout:
            if "worker ready" in line:
                return address
        raise RuntimeError(f"the worker exited with {proc.wait()} before it was ready")

    start.pids = []
    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def first_step(step_id=0):
    return StepPlan(step_id, new_seqs=[NewSequence(1, [5, 6, 7], [0], 0, 3, SamplingParams(temperature=0))])


async def open_when_free(address: str, timeout: float = 10.0) -> tuple[WorkerLink, object]:
    """Open a stream and run the first step; retry while an old stream still holds the worker
    (it lets go once it notices that stream's end). Returns (link, first result)."""
    deadline = time.monotonic() + timeout
    while True:
        link = WorkerLink(address)
        await link.open()
        try:
            await link.send(first_step())
            return link, await link.receive()
        except WorkerLinkError as e:
            await link.close()
            if "FAILED_PRECONDITION" not in str(e) or time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


def test_a_second_scheduler_stream_is_refused_and_the_next_one_starts_clean(start_worker):
    address = start_worker()

    async def main():
        first, second = WorkerLink(address), WorkerLink(address)
        await first.open()
        await first.send(first_step())
        assert len((await first.receive()).token_ids) == 1
        await second.open()
        await second.send(first_step())
        with pytest.raises(WorkerLinkError, match="FAILED_PRECONDITION.*another scheduler"):
            await second.receive()
        await second.close()
        await first.close()
        # Sequence 1 is new again on the next stream: the worker dropped the old stream's state
        # (a worker that kept it would refuse the plan as naming a known sequence).
        third, result = await open_when_free(address)
        assert result.step_id == 0 and result.seq_ids == [1]
        await third.close()

    asyncio.run(main())


def test_a_step_longer_than_the_keepalive_timeout_keeps_the_link(start_worker):
    """Steps run inline on the worker's loop. The scheduler pings every 2 s and gives up after 3 s
    without an answer; gRPC's core must keep answering while a long step blocks the loop."""
    address = start_worker(delay=SLOW_STEP_SECONDS, slow_steps=[1])

    async def main():
        link = WorkerLink(address)
        await link.open()
        await link.send(first_step(0))
        await link.receive()
        t0 = time.monotonic()
        await link.send(StepPlan(1, running_seqs=[RunningSequence(1, 1)]))
        result = await link.receive()
        assert time.monotonic() - t0 >= SLOW_STEP_SECONDS
        assert result.step_id == 1 and result.seq_ids == [1]
        await link.send(StepPlan(2, running_seqs=[RunningSequence(1, 1, block_table_start=1, block_ids=[1])]))
        assert (await link.receive()).step_id == 2  # the same stream, still healthy
        await link.close()

    asyncio.run(main())


def test_a_plan_that_contradicts_the_worker_state_ends_the_stream_with_invalid_argument(start_worker):
    address = start_worker()

    async def main():
        link = WorkerLink(address)
        await link.open()
        await link.send(StepPlan(0, running_seqs=[RunningSequence(42, 1)]))
        with pytest.raises(WorkerLinkError, match="INVALID_ARGUMENT.*not known"):
            await link.receive()
        await link.close()

    asyncio.run(main())


def test_info_over_grpc(start_worker):
    from pagewire_common.v1 import worker_pb2, worker_pb2_grpc

    address = start_worker()
    with grpc.insecure_channel(address) as channel:
        info = worker_pb2_grpc.WorkerStub(channel).Info(worker_pb2.InfoRequest(), timeout=5)
    assert (info.model_name, info.block_size, info.num_kv_blocks) == ("tiny", 4, 64)
    assert "tokenizer.json" in info.tokenizer_files
    assert info.structured_output  # its tokenizer fits its vocabulary: the grammar engine takes it


def test_a_session_over_tcp_takes_its_frame_link_on_the_workers_host(start_worker):
    address = start_worker(tcp=True)

    async def main():
        link, result = await open_when_free(address)
        assert result.seq_ids == [1] and len(result.token_ids) == 1
        await link.send(StepPlan(1, running_seqs=[RunningSequence(1, 1)]))
        assert (await link.receive()).step_id == 1
        await link.close()

    asyncio.run(main())


def test_a_session_without_its_frame_link_is_refused(start_worker):
    from pagewire_common.v1 import link_pb2, worker_pb2_grpc

    address = start_worker()
    with grpc.insecure_channel(address) as channel:
        call = worker_pb2_grpc.WorkerStub(channel).Execute(link_pb2.LinkOpen(token=b"0" * 16), timeout=30)
        with pytest.raises(grpc.RpcError) as e:
            list(call)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "no frame link" in e.value.details()


def test_a_worker_that_stops_answering_ends_the_session_within_the_keepalive_timeout(start_worker):
    """The frame link alone cannot tell a frozen worker from a long step; the session's keepalive
    can, because gRPC answers pings from its own thread, which a stopped process does not run."""
    address = start_worker()

    async def main():
        link, _ = await open_when_free(address)
        os.kill(start_worker.pids[-1], signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            await link.send(StepPlan(1, running_seqs=[RunningSequence(1, 1)]))
            with pytest.raises(WorkerLinkError, match="UNAVAILABLE"):
                await asyncio.wait_for(link.receive(), SLOW_STEP_SECONDS + 5)
            assert time.monotonic() - t0 < SLOW_STEP_SECONDS + 2
        finally:
            os.kill(start_worker.pids[-1], signal.SIGCONT)
            await link.close()

    asyncio.run(main())
