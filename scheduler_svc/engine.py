"""The scheduler's engine: requests in, token/text deltas out, one step at a time.

It validates and tokenizes requests, runs the batching policy, hands each step plan to an
executor (the worker in this process, or the worker over gRPC), and turns sampled tokens into
streamed text with stop strings applied. It never imports torch.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from kvcache.allocator import BlockAllocator
from pagewire_common.plan import StepPlan, StepResult
from pagewire_common.sampling import SamplingParams
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.scheduler import Scheduler
from scheduler_svc.sequence import FinishReason, Sequence, SequenceStatus
from scheduler_svc.tokenizer import IncrementalDetokenizer, Tokenizer


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


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int


@dataclass(slots=True)
class RequestOutput:
    """A delta for one request: the tokens and text produced since its last output."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None = None
    logprobs: list[float] | None = None
    usage: Usage | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class _Request:
    request_id: str
    seq: Sequence
    detokenizer: IncrementalDetokenizer | None
    # stop strings are looked for as each token arrives; other requests are detokenized only
    # when a delta goes out
    detokenize_each_token: bool = False
    num_streamed_tokens: int = 0
    held_text: str = ""  # text decoded token by token and not yet in a delta


class EngineCore:
    """Validate, schedule, execute, detokenize. Single-threaded: the caller drives ``step()``."""

    def __init__(
        self,
        config: SchedulerConfig,
        worker_info: WorkerInfo,
        executor: Executor,
        tokenizer: Tokenizer | None = None,
        *,
        stream_interval: int = 1,
    ):
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {stream_interval}")
        # A sequence must fit in the cache on its own, or preemption could never make room.
        capacity = worker_info.num_kv_blocks * worker_info.block_size
        max_model_len = min(config.max_model_len, worker_info.max_model_len, capacity)
        if max_model_len != config.max_model_len:
            config = dataclasses.replace(config, max_model_len=max_model_len)
        self.config = config
        self.worker_info = worker_info
        self.executor = executor
        self.tokenizer = tokenizer
        # after a request's first delta, the next one waits until this many tokens are ready
        # (or the request ends): fewer, larger messages for streaming clients
        self.stream_interval = stream_interval
        self.allocator = BlockAllocator(
            worker_info.num_kv_blocks, worker_info.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(config, self.allocator, worker_info.eos_token_ids)
        self._requests: dict[str, _Request] = {}
        self._by_seq: dict[int, _Request] = {}
        self._seq_ids = itertools.count()
        self.num_finished = 0
        self.num_aborted = 0
        self._in_flight: deque[int] = deque()  # step ids sent and not yet answered

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    # ---- requests -----------------------------------------------------------------------

    def validate(
        self,
        prompt: str | None,
        prompt_token_ids: list[int] | None,
        sampling: SamplingParams,
        *,
        strict_length: bool = False,
    ) -> list[int]:
        """Check a request and return its prompt token ids. ``ValueError`` says what is wrong.

        ``strict_length`` rejects prompt + max_tokens beyond the model length (the gRPC
        contract); without it generation simply stops at the model length ("length")."""
        if prompt is not None and prompt_token_ids:
            raise ValueError("give either prompt or prompt_token_ids, not both")
        if prompt is None and prompt_token_ids is None:
            raise ValueError("a request needs a prompt or prompt_token_ids")
        if prompt is not None:
            if not isinstance(prompt, str):
                raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
            if not prompt:
                raise ValueError("prompt is empty")
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer; send prompt_token_ids")
            token_ids = self.tokenizer.encode(prompt)
            if not token_ids:
                raise ValueError("prompt encodes to no tokens")
        else:
            token_ids = [int(t) for t in prompt_token_ids]
            if not token_ids:
                raise ValueError("prompt_token_ids is empty")
            vocab = self.worker_info.vocab_size
            bad = next((t for t in token_ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        sampling.validate()
        n = len(token_ids)
        if n >= self.max_model_len:
            raise ValueError(
                f"prompt has {n} tokens; the maximum model length is {self.max_model_len} "
                "(prompt plus at least one generated token)"
            )
        if strict_length and n + sampling.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({n} tokens) + max_tokens ({sampling.max_tokens}) = {n + sampling.max_tokens} "
                f"exceeds the maximum model length {self.max_model_len}"
            )
        return token_ids

    def add_request(
        self,
        request_id: str,
        prompt: str | None = None,
        prompt_token_ids: list[int] | None = None,
        sampling: SamplingParams | None = None,
        *,
        strict_length: bool = False,
    ) -> Sequence:
        sampling = sampling or SamplingParams()
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in flight")
        token_ids = self.validate(prompt, prompt_token_ids, sampling, strict_length=strict_length)
        seq = Sequence(
            seq_id=next(self._seq_ids),
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling=sampling,
        )
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer.for_prompt(self.tokenizer, len(token_ids), sampling.stop)
        req = _Request(request_id, seq, detok, detokenize_each_token=detok is not None and bool(sampling.stop))
        self.scheduler.add(seq)
        self._requests[request_id] = req
        self._by_seq[seq.seq_id] = req
        return seq

    def abort(self, request_id: str) -> bool:
        """Cancel a request: its blocks are freed now and the worker drops it in the next step."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return False
        del self._by_seq[req.seq.seq_id]
        self.scheduler.finish(req.seq, FinishReason.ABORT)
        self.num_aborted += 1
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

    def process_result(self, result: StepResult) -> list[RequestOutput]:
        """Apply a step result: stop checks, detokenization, and a delta for each request that
        got its first token, finished, or has ``stream_interval`` tokens not yet streamed."""
        outputs: list[RequestOutput] = []
        by_seq = self._by_seq
        interval = self.stream_interval
        for seq in self.scheduler.update(result):
            req = by_seq.get(seq.seq_id)
            if req is None:
                continue
            if req.detokenize_each_token:
                req.held_text += req.detokenizer.update(seq.token_ids, is_final=seq.is_finished)
                if req.detokenizer.stopped and not seq.is_finished:
                    self.scheduler.finish(seq, FinishReason.STOP)
            streamed = req.num_streamed_tokens
            if (
                seq.status is SequenceStatus.FINISHED
                or not streamed
                or len(seq.token_ids) - seq.num_prompt_tokens - streamed >= interval
            ):
                outputs.append(self._make_output(req))
        return outputs

    def step(self) -> list[RequestOutput]:
        """Schedule one step, execute it, and return the deltas it produced."""
        plan = self.schedule()
        if plan is None:
            return []
        return self.process_result(self.executor.execute(plan))

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def pipeline_step(self, link: PlanLink, max_in_flight: int = 2) -> list[RequestOutput]:
        """Advance with up to ``max_in_flight`` plans sent ahead of their results.

        With 2 (overlap), plan N+1 is built and sent before result N is read: its decodes use
        the tokens step N samples, which the worker already holds, so the worker never waits for
        a round trip. Stop conditions are then learned one step late; a token sampled past a
        stop is dropped in ``update``. With 1, each plan waits for its result. (The gRPC
        scheduler drives the same three calls from an asyncio task.)"""
        plan = self.next_plan(max_in_flight)
        if plan is not None:
            link.send(plan)
        if self.should_receive(plan is not None, max_in_flight):
            return self.on_result(link.receive())
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

    def on_result(self, result: StepResult) -> list[RequestOutput]:
        expected = self._in_flight.popleft()
        if result.step_id != expected:
            raise RuntimeError(f"worker answered step {result.step_id}, expected {expected}")
        return self.process_result(result)

    def _make_output(self, req: _Request) -> RequestOutput:
        seq = req.seq
        new_ids = seq.token_ids[seq.num_prompt_tokens + req.num_streamed_tokens :]
        new_logprobs = None
        if seq.sampling.logprobs:
            new_logprobs = seq.logprobs[req.num_streamed_tokens :]
        req.num_streamed_tokens += len(new_ids)
        if req.detokenize_each_token:
            text, req.held_text = req.held_text, ""
        elif req.detokenizer is not None:
            text = req.detokenizer.update(seq.token_ids, is_final=seq.is_finished)
        else:
            text = ""
        out = RequestOutput(req.request_id, new_ids, text, seq.finish_reason, new_logprobs)
        if seq.is_finished:
            out.usage = Usage(
                prompt_tokens=seq.num_prompt_tokens,
                completion_tokens=seq.num_output_tokens,
                cached_prompt_tokens=seq.num_cached_prompt_tokens or 0,
            )
            del self._requests[req.request_id]
            del self._by_seq[seq.seq_id]
            self.num_finished += 1
        return out

    def reset(self) -> list[str]:
        """The worker was lost: forget all sequences and block accounting. Returns the ids of the
        requests that were in flight (the caller fails them)."""
        self.scheduler.reset()
        self._in_flight.clear()
        lost = list(self._requests)
        self._requests.clear()
        self._by_seq.clear()
        return lost
