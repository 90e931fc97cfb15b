"""The engine core: token-level requests in, sampled tokens out, one step plan at a time.

It owns the batching policy (``Scheduler``) and the block allocator, and hands each step plan to
the worker: in this process (``pagewire.LLM``, tests) or over gRPC (the scheduler core process).
Text does not exist here: prompts arrive as token ids, and tokens go back to whoever turns them
into text and finds stop strings (``scheduler_svc.api.text_stream``), which calls ``finish`` when it finds
one. It never imports torch.

Both drivers use the same calls: ``add_request``/``abort``/``finish``, then ``next_plan`` /
``should_receive`` / ``on_result`` (the pipeline, up to two plans in flight), and ``drain`` to
tell the worker to drop the sequences that ended. ``step`` is the one-plan-at-a-time form.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from kvcache.allocator import BlockAllocator
from pagewire_common.plan import StepPlan, StepResult
from pagewire_common.requests import FinishReason, RequestOutput, Usage, validate_prompt_tokens
from pagewire_common.sampling import SamplingParams
from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.running_batch import StepTokens
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.core.sequence import Sequence


class Executor(Protocol):
    def execute(self, plan: StepPlan) -> StepResult: ...


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
              has_tokenizer: bool = True) -> "WorkerInfo":
        """The one place that assembles a worker's info: the tokenizer's EOS token ends
        generation too when the model config does not list it."""
        eos = tuple(int(t) for t in eos_token_ids)
        if tokenizer_eos_token_id is not None and tokenizer_eos_token_id not in eos:
            eos += (tokenizer_eos_token_id,)
        return cls(model_name, int(vocab_size), int(max_model_len), int(block_size), int(num_kv_blocks), eos,
                   dtype, device, has_tokenizer)


class EngineCore:
    """Schedule, execute, apply results. Single-threaded: the caller drives it."""

    def __init__(self, config: SchedulerConfig, worker_info: WorkerInfo, executor: Executor | None = None):
        # A sequence must fit in the cache on its own, or preemption could never make room.
        capacity = worker_info.num_kv_blocks * worker_info.block_size
        max_model_len = min(config.max_model_len, worker_info.max_model_len, capacity)
        if max_model_len != config.max_model_len:
            config = dataclasses.replace(config, max_model_len=max_model_len)
        self.config = config
        self.worker_info = worker_info
        self.executor = executor
        self.allocator = BlockAllocator(
            worker_info.num_kv_blocks, worker_info.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(config, self.allocator, worker_info.eos_token_ids)
        self._requests: dict[str, Sequence] = {}
        self._seq_ids = itertools.count()
        self.num_finished = 0
        self.num_aborted = 0
        self._in_flight: deque[int] = deque()  # step ids sent and not yet answered

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    # ---- requests -----------------------------------------------------------------------

    def validate(self, prompt_token_ids: list[int] | None, sampling: SamplingParams, *,
                 strict_length: bool = False) -> list[int]:
        """Check a request and return its prompt token ids (``ValueError`` says what is wrong)."""
        if prompt_token_ids is None:
            raise ValueError("a request needs a prompt (the engine core takes token ids)")
        token_ids = [int(t) for t in prompt_token_ids]
        if sampling.structured_output is not None and not self.worker_info.structured_output:
            raise ValueError("structured output needs the model's tokenizer.json, which this model lacks")
        validate_prompt_tokens(token_ids, sampling, vocab_size=self.worker_info.vocab_size,
                               max_model_len=self.max_model_len, strict_length=strict_length,
                               max_num_seqs=self.config.max_num_seqs)
        return token_ids

    def add_request(self, request_id: str, prompt_token_ids: list[int] | None = None,
                    sampling: SamplingParams | None = None, *, strict_length: bool = False,
                    validated: bool = False) -> Sequence:
        """Queue a request (``validated``: the caller already ran ``validate`` on these ids)."""
        sampling = sampling or SamplingParams()
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in flight")
        token_ids = prompt_token_ids if validated else self.validate(prompt_token_ids, sampling,
                                                                     strict_length=strict_length)
        seq = Sequence(seq_id=next(self._seq_ids), request_id=request_id, prompt_token_ids=token_ids,
                       sampling=sampling)
        # n > 1: the other samples wait on sample 0, which forks them once its prompt is computed
        for index in range(1, sampling.n):
            sample_id = sample_request_id(request_id, index)
            if sample_id in self._requests:
                raise ValueError(f"request id {sample_id!r} is already in flight")
            sample = Sequence(seq_id=next(self._seq_ids), request_id=sample_id, prompt_token_ids=token_ids,
                              sampling=dataclasses.replace(sampling, seed=sample_seed(sampling.seed, index)),
                              sample_index=index)
            seq.unforked_samples.append(sample)
        self.scheduler.add(seq)
        self._requests[request_id] = seq
        for sample in seq.unforked_samples:
            self._requests[sample.request_id] = sample
        return seq

    def abort(self, request_id: str) -> bool:
        """Cancel a request: its blocks are freed now and the worker drops it in the next step."""
        return self._end(request_id, FinishReason.ABORT)

    def finish(self, request_id: str, reason: FinishReason = FinishReason.STOP) -> bool:
        """End a request that its reader decided is complete (a stop string): counted as
        finished, blocks freed (or cached) now; tokens already in flight for it are dropped."""
        return self._end(request_id, reason)

    def _end(self, request_id: str, reason: FinishReason) -> bool:
        seq = self._requests.pop(request_id, None)
        if seq is None:
            return False
        for sample in seq.unforked_samples:  # aborted before its prompt was computed
            self._end(sample.request_id, reason)
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

    def schedule(self) -> StepPlan | None:
        """Build the next plan, or None when there is nothing to tell the worker."""
        if not self.scheduler.has_unfinished() and not self.scheduler.has_pending_drops():
            return None
        plan = self.scheduler.schedule()
        if plan.is_empty and not plan.finished_seq_ids and not plan.block_copies:
            return None
        return plan

    def process_result(self, result: StepResult) -> list[Sequence]:
        """Apply a step result: the sequences that received a token (each exactly one, the last
        of ``token_ids``), finished ones included with ``finish_reason`` set."""
        return self.process_step(result).sequences()

    def process_step(self, result: StepResult) -> StepTokens:
        """``process_result`` with the plain decodes' tokens left as arrays."""
        step = self.scheduler.apply_result(result)
        requests = self._requests
        for seq in step.others:  # a plain decode does not finish
            if seq.finish_reason is not None and requests.pop(seq.request_id, None) is not None:
                self.num_finished += 1
        return step

    def step(self) -> list[RequestOutput]:
        """Schedule one step, execute it, and return one token delta per sequence that got one."""
        plan = self.schedule()
        if plan is None:
            return []
        return self.outputs(self.process_result(self.executor.execute(plan)))

    def drain(self) -> None:
        """Send the plans that only drop ended sequences from the worker (nothing runs)."""
        while (plan := self.schedule()) is not None:
            self.process_result(self.executor.execute(plan))

    @staticmethod
    def outputs(touched: list[Sequence]) -> list[RequestOutput]:
        """Token deltas for ``touched`` sequences (one token each), with usage on the last."""
        outs = []
        for seq in touched:
            out = RequestOutput(seq.request_id, [seq.token_ids[-1]], "", seq.finish_reason,
                                [seq.logprobs[-1]] if seq.sampling.logprobs else None, index=seq.sample_index)
            if seq.sampling.top_logprobs:
                out.top_logprobs = [seq.top_logprobs[-1]]
            if seq.finish_reason is not None:
                out.usage = usage_of(seq)
            if len(seq.token_ids) - seq.num_prompt_tokens == 1:
                out.num_cached_prompt_tokens = seq.num_cached_prompt_tokens or 0
            outs.append(out)
        return outs

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def pipeline_step(self, link: PlanLink, max_in_flight: int = 2) -> list[RequestOutput]:
        """Advance with up to ``max_in_flight`` plans sent ahead of their results.

        With 2 (overlap), plan N+1 is built and sent before result N is read: its decodes use
        the tokens step N samples, which the worker already holds, so the worker never waits for
        a round trip. Stop conditions are then learned one step late; a token sampled past a
        stop is dropped in ``update``. With 1, each plan waits for its result. (The scheduler
        core drives the same three calls from an asyncio task.)"""
        plan = self.next_plan(max_in_flight)
        if plan is not None:
            link.send(plan)
        if self.should_receive(plan is not None, max_in_flight):
            return self.outputs(self.on_result(link.receive()).sequences())
        return []

    def next_plan(self, max_in_flight: int) -> StepPlan | None:
        """The next plan to send, if fewer than ``max_in_flight`` are outstanding and there is
        work; it is counted as in flight."""
        if len(self._in_flight) >= max_in_flight:
            return None
        plan = self.schedule()
        if plan is not None:
            self._in_flight.append(plan.step_id)
        return plan

    def should_receive(self, sent: bool, max_in_flight: int) -> bool:
        """Read a result now: the pipeline is full, or nothing new was sent."""
        return bool(self._in_flight) and (not sent or len(self._in_flight) >= max_in_flight)

    def on_result(self, result: StepResult) -> StepTokens:
        expected = self._in_flight.popleft()
        if result.step_id != expected:
            raise RuntimeError(f"worker answered step {result.step_id}, expected {expected}")
        return self.process_step(result)

    def is_idle(self) -> bool:
        """Nothing to schedule, nothing in flight, nothing to tell the worker."""
        return not self.scheduler.has_unfinished() and not self._in_flight and not self.scheduler.has_pending_drops()

    def reset(self) -> list[str]:
        """The worker was lost: forget all sequences and block accounting. Returns the ids of the
        requests that were in flight (the caller fails them)."""
        self.scheduler.reset()
        self._in_flight.clear()
        lost = list(self._requests)
        self._requests.clear()
        return lost


def sample_request_id(request_id: str, index: int) -> str:
    """The engine's id of sample ``index`` of a request with n > 1 (sample 0 keeps the request's)."""
    return request_id if index == 0 else f"{request_id}#{index}"


def sample_seed(seed: int | None, index: int) -> int | None:
    """Sample ``index``'s seed: distinct per sample, the same in every run."""
    if seed is None or index == 0:
        return seed
    return (seed + index * 0x9E3779B97F4A7C15) % 2**64


def usage_of(seq: Sequence) -> Usage:
    return Usage(seq.num_prompt_tokens, seq.num_output_tokens, seq.num_cached_prompt_tokens or 0)
