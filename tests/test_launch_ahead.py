"""Steps launched ahead (``--launch-ahead``): step N+1 is queued before step N's tokens reach the
host, its input ids taken from step N's token tensor on the device.

On CPU the kernels run as they are called, so nothing overlaps here, but every part of the path
runs: placeholders in the sequences' token lists, input ids from the device (all of them in a run
of decodes, some of them in a mixed step), the tokens filled in when the step is finished, steps
with a grammar that wait for their tokens among steps that do not, and the worker server's loop
that launches each plan before finishing the step before it.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest

from pagewire import LLM, SamplingParams
from pagewire_common.plan import StepResult
from tests.service_utils import REPO
from tests.test_parity import assert_all_free, reference
from tests.test_structured_output import check_output, random_model_dir, structured  # noqa: F401 (a fixture)
from tests.tiny_models import sample_prompts
from worker_svc.server import WorkerServicer


def _mixed_params(n: int) -> list[SamplingParams]:
    """Greedy, seeded draws with penalties, logprobs and top logprobs, n = 2, prompt logprobs."""
    out = []
    for i in range(n):
        kind = i % 5
        if kind == 0:
            out.append(SamplingParams(temperature=0, max_tokens=14, ignore_eos=True))
        elif kind == 1:
            out.append(SamplingParams(temperature=0.9, seed=7 + i, max_tokens=12, repetition_penalty=1.3,
                                      frequency_penalty=0.4, logprobs=True, top_logprobs=3))
        elif kind == 2:
            out.append(SamplingParams(temperature=0.8, seed=11 + i, n=2, max_tokens=9, top_k=20, top_p=0.9))
        elif kind == 3:
            out.append(SamplingParams(temperature=0, max_tokens=10, prompt_logprobs=2, min_tokens=4))
        else:
            out.append(SamplingParams(temperature=0, max_tokens=16, logit_bias={5: 2.0}, logprobs=True))
    return out


def _outputs(llm: LLM, prompts, params):
    outs = llm.generate(prompts, params)
    flat = []
    for out in outs:
        for sample in out.samples or [out]:
            flat.append((sample.token_ids, sample.logprobs, sample.prompt_logprobs))
    return flat


@pytest.mark.parametrize("kind", ["llama-gqa", "gpt2"])
def test_launched_ahead_equals_waiting_for_each_step(kind, tiny_model_dir):
    model_dir = tiny_model_dir(kind)
    prompts = sample_prompts(model_dir, n=15)
    params = _mixed_params(len(prompts))
    # 4-token blocks, too few for every sequence at once, a small budget: chunked prefill,
    # preemption, decodes beside prefill chunks
    small = {"block_size": 4, "max_num_batched_tokens": 40, "num_kv_blocks": 60}
    waiting = LLM(model_dir, launch_ahead="off", **small)
    ahead = LLM(model_dir, launch_ahead="on", **small)
    assert not waiting.runner.launch_ahead and ahead.runner.launch_ahead
    assert _outputs(ahead, prompts, params) == _outputs(waiting, prompts, params)
    runner = ahead.runner
    assert ahead.engine.scheduler.num_preemptions > 0
    # steps took input ids from the device: whole decode runs and mixed steps
    assert runner.num_steps_fed_from_device > 10 and waiting.runner.num_steps_fed_from_device == 0
    assert runner._num_unfinished == 0 and runner._ahead is None
    for state in runner.seqs._seqs.values():
        assert min(state.token_ids) >= 0
    assert_all_free(ahead)


def test_greedy_launched_ahead_matches_transformers(tiny_model_dir):
    model_dir = tiny_model_dir("llama-gqa")
    llm = LLM(model_dir, block_size=4, max_num_batched_tokens=32, num_kv_blocks=512, launch_ahead="on")
    prompts = sample_prompts(model_dir, n=6)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12))
    assert [o.token_ids for o in outs] == reference(model_dir, llm, prompts, max_tokens=12)
    assert llm.runner.num_steps_fed_from_device > 0


def test_grammar_steps_wait_among_steps_launched_ahead(random_model_dir):  # noqa: F811 (the fixture)
    prompts = sample_prompts(random_model_dir, n=10)
    params = [structured(i) for i in range(len(prompts))]
    waiting = LLM(random_model_dir, block_size=16, num_kv_blocks=400, launch_ahead="off")
    ahead = LLM(random_model_dir, block_size=16, num_kv_blocks=400, launch_ahead="on")
    want = waiting.generate(prompts, params)
    got = ahead.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for out, sp in zip(got, params):
        if sp.structured_output is not None:
            check_output(out, sp, ahead)
    # the unconstrained requests that outlive the constrained ones decode launched ahead
    plain = [(p, sp) for p, sp in zip(prompts, params) if sp.structured_output is None]
    before = ahead.runner.num_steps_fed_from_device
    ahead.generate([p for p, _ in plain], [sp for _, sp in plain])
    assert ahead.runner.num_steps_fed_from_device > before
    assert_all_free(ahead)


# ---- the worker server's loop ----------------------------------------------------------------


class _Launched:
    def __init__(self, step_id: int, done: asyncio.Event | None):
        self.step_id = step_id
        self.done = done  # None: finished on the device at once

    def ready(self) -> bool:
        return self.done is None or self.done.is_set()

    def wait(self) -> None:
        # the server waits on a thread: poll the event set by the test's loop
        import time

        while not self.ready():
            time.sleep(0.001)


class _Runner:
    """Records the order of launches and finishes; step ``hold`` stays unfinished on the
    'device' until the test releases it."""

    launch_ahead = True

    def __init__(self, hold: set[int]):
        self.hold = hold
        self.events: list[str] = []
        self.gates: dict[int, asyncio.Event] = {}

    def reset(self) -> None:
        pass

    def launch(self, plan):
        self.events.append(f"launch {plan.step_id}")
        gate = None
        if plan.step_id in self.hold:
            gate = self.gates[plan.step_id] = asyncio.Event()
        return _Launched(plan.step_id, gate)

    def finish(self, launched):
        self.events.append(f"finish {launched.step_id}")
        return StepResult(step_id=launched.step_id)


class _Conn:
    def __init__(self):
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.sent: list[int] = []

    def has_frame(self) -> bool:
        return not self.inbox.empty()

    async def read(self):
        return await self.inbox.get()

    def write(self, payload: bytes) -> None:
        from pagewire_common.v1 import worker_pb2

        self.sent.append(worker_pb2.StepResult.FromString(payload).step_id)


def _plan(step_id: int) -> bytes:
    from pagewire_common import wire
    from pagewire_common.plan import StepPlan

    return wire.plan_to_pb(StepPlan(step_id=step_id)).SerializeToString()


def test_worker_launches_the_next_plan_before_finishing_and_never_holds_a_done_step():
    async def scenario():
        runner = _Runner(hold={1, 2})
        servicer = WorkerServicer(runner, "m", ())
        conn = _Conn()
        loop_task = asyncio.ensure_future(servicer._launch_ahead(conn, context=None))
        await conn.inbox.put(_plan(1))
        await asyncio.sleep(0.05)
        # step 1 runs on the device and no plan came: nothing finished yet
        assert runner.events == ["launch 1"] and conn.sent == []
        await conn.inbox.put(_plan(2))
        await asyncio.sleep(0.05)
        # plan 2 is launched before step 1 is finished (finishing waits for step 1's tokens)
        assert runner.events == ["launch 1", "launch 2", "finish 1"], runner.events
        assert conn.sent == [1]
        # step 2 stays on the device with no plan after it: once it is done, its result goes at
        # once (the scheduler may wait for it before sending another plan); the device finishes
        # its steps in order
        runner.gates[1].set()
        await asyncio.sleep(0.05)
        assert conn.sent == [1]
        runner.gates[2].set()
        for _ in range(100):
            if conn.sent == [1, 2]:
                break
            await asyncio.sleep(0.01)
        assert conn.sent == [1, 2] and runner.events[-1] == "finish 2"
        await conn.inbox.put(None)  # the scheduler closed the link
        await asyncio.wait_for(loop_task, 5)

    asyncio.run(scenario())


@pytest.mark.slow
def test_feature_suites_pass_with_steps_launched_ahead():
    """The parity, sampling-control, prompt-logprobs and structured-output suites, every engine
    they build launching its steps ahead."""
    env = {**os.environ, "PAGEWIRE_LAUNCH_AHEAD": "on"}
    suites = ["tests/test_parity.py", "tests/test_sampling_controls.py", "tests/test_prompt_logprobs.py",
              "tests/test_structured_output.py"]
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow", *suites],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert " passed" in out.stdout and "failed" not in out.stdout


@pytest.mark.slow
def test_served_with_three_plans_in_flight_and_steps_launched_ahead(tiny_model_dir, tmp_path):
    """The worker launching ahead as on CUDA, the core keeping three plans in flight (its CUDA
    default): 20 concurrent streams give the offline engine's tokens, stops included, and every
    block comes back."""
    from concurrent.futures import ThreadPoolExecutor

    from pagewire_common.v1 import generation_pb2 as pb
    from tests.service_utils import sampling, start_scheduler, start_worker, stub
    from tests.test_services import assert_all_blocks_free, collect

    model_dir = tiny_model_dir("llama-gqa")
    worker, worker_addr = start_worker(model_dir, tmp_path, extra=["--block-size", "4", "--num-kv-blocks", "600",
                                                                    "--launch-ahead", "on"])
    sched, addr = start_scheduler(worker_addr, tmp_path, extra=["--max-num-batched-tokens", "64",
                                                                "--plans-in-flight", "3"])
    try:
        offline = LLM(model_dir, block_size=4, num_kv_blocks=600, max_num_batched_tokens=64)
        prompts = (sample_prompts(model_dir, n=8) * 3)[:20]
        greedy = [o.token_ids for o in offline.generate(prompts, SamplingParams(temperature=0, max_tokens=24))]
        # a stop token that the greedy run of prompt 0 meets early: the tokens in flight past it are dropped
        at = next(i for i, t in enumerate(greedy[0]) if i >= 3 and greedy[0].index(t) == i)
        stop = greedy[0][at]
        stopped = offline.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop]))
        s = stub(addr)

        def one(i):
            extra = {"stop_token_ids": [stop]} if i == 0 else {}
            return collect(s.Generate(pb.GenerateRequest(prompt_token_ids=prompts[i],
                                                         sampling=sampling(max_tokens=24, **extra))))

        with ThreadPoolExecutor(20) as pool:
            results = list(pool.map(one, range(len(prompts))))
        assert results[0][0] == stopped[0].token_ids == greedy[0][: at + 1]
        assert [r[0] for r in results[1:]] == greedy[1:]
        assert_all_blocks_free(addr)
    finally:
        sched.stop()
        worker.stop()


def test_a_link_closed_mid_step_ends_execute_as_a_disconnect(caplog):
    """The scheduler goes away while the worker writes a step's result (a shutdown with requests
    running): Execute ends as on a disconnect, logged at info, not as an error, and the worker
    takes the next scheduler."""
    from types import SimpleNamespace

    from pagewire_common.framelink import LinkClosed

    class ClosedConn(_Conn):
        closed = False

        def write(self, payload: bytes) -> None:
            raise LinkClosed("the frame link is closed")

        def close(self) -> None:
            self.closed = True

    class Runner(_Runner):
        launch_ahead = False
        resets = 0

        def reset(self) -> None:
            self.resets += 1

        def execute(self, plan):
            return StepResult(step_id=plan.step_id)

    async def scenario():
        runner = Runner(hold=set())
        servicer = WorkerServicer(runner, "m", ())
        conn = ClosedConn()

        async def open_session(request, context):
            return conn

        servicer.frames = SimpleNamespace(open_session=open_session)
        await conn.inbox.put(_plan(1))
        with caplog.at_level("INFO", logger="pagewire.worker"):
            await asyncio.wait_for(servicer.Execute(None, SimpleNamespace(peer=lambda: "unix:")), 5)
        assert conn.closed and runner.resets == 2 and not servicer._connected

    asyncio.run(scenario())
    assert "the scheduler's link closed: the frame link is closed" in caplog.text
    assert not [r for r in caplog.records if r.levelname == "ERROR"]
