"""The engine core: token-level requests in, sampled tokens out, one step plan at a time.

It owns the batching policy (``Scheduler``) and the block allocator, and hands each step plan to
the worker: over gRPC in the scheduler core process (``core.service``), or in the same process
for the offline ``pagewire.LLM``. Text does not exist here: prompts arrive as token ids, and
tokens go back (``core.delivery``) to whoever turns them into text and finds stop strings, which
calls ``finish`` when it finds one. It never imports torch.

It is driven one way, by three calls, whatever carries the plans: ``next_plan(depth)`` (the next
plan, while fewer than ``depth`` are in flight), ``should_receive`` (whether to wait for a result
now) and ``on_result`` (apply it). With ``depth`` 2 (overlap) plan N+1 is built and sent before
result N is read: its decodes use the tokens step N samples, which the worker already holds, so
it never waits for a round trip; stop conditions are then learned one step late and a token
sampled past a stop is dropped. ``run_step`` makes the three calls over a link in this process.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from kvcache.allocator import BlockAllocator
from pagewire_common import step_profile
from pagewire_common.plan import StepPlan, StepResult
from pagewire_common.requests import FinishReason, validate_prompt_tokens
from pagewire_common.sampling import SamplingParams
from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.running_batch import StepTokens
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.core.sequence import Sequence


class PlanLink(Protocol):
    """A worker that takes plans and returns results in order, possibly some steps behind."""

    def send(self, plan: StepPlan) -> None: ...

    def receive(self) -> StepResult: ...


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """What the worker reports at start (sizes learned at run time)."""

    model_name: str
    vocab_size: int
    max_model_len: int
    block_size: int
    num_kv_blocks: int
    eos_token_ids: tuple[int, ...]
    dtype: str = "float32"
    device: str = "cpu"
    # whether the worker can constrain outputs to a grammar: it builds its matchers from the
    # model's tokenizer.json
    structured_output: bool = True

    @classmethod
    def build(cls, *, model_name: str, vocab_size: int, max_model_len: int, block_size: int, num_kv_blocks: int,
              eos_token_ids, dtype: str, device: str, tokenizer_eos_token_id: int | None,
              structured_output: bool = True) -> "WorkerInfo":
        """The one place that assembles a worker's info: the tokenizer's EOS token ends
        generation too when the model config does not list it."""
        eos = tuple(int(t) for t in eos_token_ids)
        if tokenizer_eos_token_id is not None and tokenizer_eos_token_id not in eos:
            eos += (tokenizer_eos_token_id,)
        return cls(model_name, int(vocab_size), int(max_model_len), int(block_size), int(num_kv_blocks), eos,
                   dtype, device, structured_output)


class EngineCore:
    """Requests, the batching policy and the block allocator. Single-threaded: the caller drives
    it (module docstring). A request's id is the caller's (an int, unique while it runs), and it
    is the sequence id in the plans; sample ``i`` of ``n`` is ``request_id + i``."""

    def __init__(self, config: SchedulerConfig, worker_info: WorkerInfo):
        # A sequence must fit in the cache on its own, or preemption could never make room.
        capacity = worker_info.num_kv_blocks * worker_info.block_size
        max_model_len = min(config.max_model_len, worker_info.max_model_len, capacity)
        if max_model_len != config.max_model_len:
            config = dataclasses.replace(config, max_model_len=max_model_len)
        self.config = config
        self.worker_info = worker_info
        self.allocator = BlockAllocator(
            worker_info.num_kv_blocks, worker_info.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(config, self.allocator, worker_info.eos_token_ids)
        self._requests: dict[int, Sequence] = {}  # request id -> its sequence (samples included)
        self.num_finished = 0
        self.num_aborted = 0
        self._in_flight: deque[int] = deque()  # step ids sent and not yet answered

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    # ---- requests -----------------------------------------------------------------------

    def validate(self, prompt_token_ids: list[int] | None, sampling: SamplingParams, *,
                 strict_length: bool = False, decoded: bool = False) -> list[int]:
        """Check a request and return its prompt token ids (``ValueError`` says what is wrong).
        ``decoded``: the ids are a list of Python ints of the caller's own (decoded from the
        wire), returned as they are instead of converted one by one into a new list."""
        if prompt_token_ids is None:
            raise ValueError("a request needs a prompt (the engine core takes token ids)")
        token_ids = prompt_token_ids if decoded else [int(t) for t in prompt_token_ids]
        if sampling.structured_output is not None and not self.worker_info.structured_output:
            raise ValueError("this model serves no structured output: it has no tokenizer.json, or the grammar engine refuses its tokenizer (the worker's log says why)")
        validate_prompt_tokens(token_ids, sampling, vocab_size=self.worker_info.vocab_size,
                               max_model_len=self.max_model_len, strict_length=strict_length,
                               max_num_seqs=self.config.max_num_seqs)
        return token_ids

    def add_request(self, request_id: int, prompt_token_ids: list[int] | None = None,
                    sampling: SamplingParams | None = None, *, strict_length: bool = False,
                    validated: bool = False) -> Sequence:
        """Queue a request (``validated``: the caller already ran ``validate`` on these ids).
        ``ValueError`` when one of its ids (``request_id`` .. ``request_id + n - 1``) is in flight."""
        sampling = sampling or SamplingParams()
        taken = next((i for i in range(request_id, request_id + sampling.n) if i in self._requests), None)
        if taken is not None:
            raise ValueError(f"request id {taken} is already in flight")
        token_ids = prompt_token_ids if validated else self.validate(prompt_token_ids, sampling,
                                                                     strict_length=strict_length)
        seq = Sequence(seq_id=request_id, prompt_token_ids=token_ids, sampling=sampling)
        # n > 1: the other samples wait on sample 0, which forks them once its prompt is computed
        for index in range(1, sampling.n):
            sample = Sequence(seq_id=request_id + index, prompt_token_ids=token_ids,
                              sampling=dataclasses.replace(sampling, seed=sample_seed(sampling.seed, index)),
                              sample_index=index)
            seq.unforked_samples.append(sample)
        self.scheduler.add(seq)
        self._requests[request_id] = seq
        for sample in seq.unforked_samples:
            self._requests[sample.seq_id] = sample
        return seq

    def abort(self, request_id: int) -> bool:
        """Cancel a request: its blocks are freed now and the worker drops it in the next step."""
        return self._end(request_id, FinishReason.ABORT)

    def finish(self, request_id: int, reason: FinishReason = FinishReason.STOP) -> bool:
        """End a request that its reader decided is complete (a stop string): counted as
        finished, blocks freed (or cached) now; tokens already in flight for it are dropped."""
        return self._end(request_id, reason)

    def _end(self, request_id: int, reason: FinishReason) -> bool:
        seq = self._requests.pop(request_id, None)
        if seq is None:
            return False
        # the samples it has not forked yet are requests of their own: each ends when its id does
        # (the API servers abort every sample's id), and until then runs alone (Scheduler.finish)
        self.scheduler.finish(seq, reason)
        if reason is FinishReason.ABORT:
            self.num_aborted += 1
        else:
            self.num_finished += 1
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    # ---- steps --------------------------------------------------------------------------

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def next_plan(self, max_in_flight: int) -> StepPlan | None:
        """The next plan to send, if fewer than ``max_in_flight`` are outstanding and there is
        something to tell the worker (work, or sequences to drop); it is counted as in flight."""
        if len(self._in_flight) >= max_in_flight:
            return None
        if not self.scheduler.has_unfinished() and not self.scheduler.has_pending_drops():
            return None
        plan = self.scheduler.schedule()
        if plan.is_empty and not plan.finished_seq_ids and not plan.block_copies:
            return None
        self._in_flight.append(plan.step_id)
        return plan

    def should_receive(self, sent: bool, max_in_flight: int) -> bool:
        """Read a result now: the pipeline is full, or nothing new was sent."""
        return bool(self._in_flight) and (not sent or len(self._in_flight) >= max_in_flight)

    def on_result(self, result: StepResult) -> StepTokens:
        """Apply a step's sampled tokens: the sequences that received one (each exactly one, the
        last of its ``token_ids``), finished ones included with ``finish_reason`` set."""
        expected = self._in_flight.popleft()
        if result.step_id != expected:
            raise RuntimeError(f"worker answered step {result.step_id}, expected {expected}")
        step = self.scheduler.apply_result(result)
        requests = self._requests
        for seq in step.others:  # a plain decode does not finish
            if seq.finish_reason is not None and requests.pop(seq.seq_id, None) is not None:
                self.num_finished += 1
        return step

    def is_idle(self) -> bool:
        """Nothing to schedule, nothing in flight, nothing to tell the worker."""
        return not self.scheduler.has_unfinished() and not self._in_flight and not self.scheduler.has_pending_drops()

    def reset(self) -> list[int]:
        """The worker was lost: forget all sequences and block accounting. Returns the ids of the
        requests that were in flight (the caller fails them)."""
        self.scheduler.reset()
        self._in_flight.clear()
        lost = list(self._requests)
        self._requests.clear()
        return lost


def plans_in_flight(settings, device: str) -> int:
    """The pipeline depth of the core's loop: 1 without overlap, else ``--plans-in-flight`` (by
    default 3 for a worker on CUDA, whose steps are launched ahead, else 2)."""
    if not settings.overlap:
        return 1
    if settings.plans_in_flight is not None:
        return settings.plans_in_flight
    return 3 if device.startswith("cuda") else 2


def run_step(engine: EngineCore, link: PlanLink, depth: int = 1) -> StepTokens | None:
    """One turn of the driver over a link in this process (the offline ``LLM``, tests): send the
    next plan if there is one, and apply a result when one is due. The core service makes the same
    three calls on its event loop, in step profile phases of the same names."""
    with step_profile.phase("schedule"):
        plan = engine.next_plan(depth)
    if plan is not None:
        link.send(plan)
    if engine.should_receive(plan is not None, depth):
        result = link.receive()  # an in-process worker runs the plan now, in phases of its own
        with step_profile.phase("apply result"):
            return engine.on_result(result)
    return None


class InProcessLink:
    """A worker in this process as a ``PlanLink``: each plan runs when its result is read, so
    with two in flight the second was built before the first ran, as over the worker's stream.
    A runner that launches steps ahead (``ModelRunner.launch``) launches each plan as it is sent
    and finishes it when its result is read: with two in flight, step N+1 is queued on the device
    before step N's tokens are read back."""

    def __init__(self, executor):
        self.executor = executor  # has execute(plan) -> StepResult; launch and finish when it launches ahead
        self._ahead = getattr(executor, "launch_ahead", False)
        self._sent: deque = deque()  # plans, or launched steps

    def send(self, plan: StepPlan) -> None:
        self._sent.append(self.executor.launch(plan) if self._ahead else plan)

    def receive(self) -> StepResult:
        if self._ahead:
            return self.executor.finish(self._sent.popleft())
        return self.executor.execute(self._sent.popleft())


def sample_seed(seed: int | None, index: int) -> int | None:
    """Sample ``index``'s seed: distinct per sample, the same in every run."""
    if seed is None or index == 0:
        return seed
    return (seed + index * 0x9E3779B97F4A7C15) % 2**64
