"""Offline batch inference: the scheduler and the worker halves in one process."""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence as Seq

from pagewire_common.sampling import SamplingParams
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.engine import EngineCore, RequestOutput, Usage, WorkerInfo
from scheduler_svc.tokenizer import Tokenizer

log = logging.getLogger("pagewire")


@dataclass(slots=True)
class GenerationOutput:
    """The whole result of one prompt."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" or "length"
    logprobs: list[float] | None
    usage: Usage

    @property
    def num_cached_tokens(self) -> int:
        return self.usage.cached_prompt_tokens


class LLM:
    """Generate from many prompts at once with continuous batching and a paged KV cache.

    ``model`` is a Hugging Face model directory (safetensors + config + tokenizer), a ``.gguf``
    file (converted once into a cached safetensors directory), or None for the embedded
    SmolLM2-135M-Instruct. Engine options: ``block_size``, ``max_num_batched_tokens``,
    ``max_num_seqs``, ``num_kv_blocks`` (or ``kv_cache_bytes``), ``enable_prefix_caching``,
    ``dtype``, ``device``, ``max_model_len``.
    """

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        block_size: int = 16,
        max_num_batched_tokens: int = 512,
        max_num_seqs: int = 64,
        num_kv_blocks: int | None = None,
        kv_cache_bytes: int | None = None,
        enable_prefix_caching: bool = True,
        dtype: str = "float32",
        device: str | None = None,
        max_model_len: int | None = None,
    ):
        from worker_svc.runner import ModelRunner, RunnerConfig, dtype_name
        from worker_svc.weights import resolve_model_path

        self.model_dir = resolve_model_path(model)
        runner_config = RunnerConfig(
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            kv_cache_bytes=kv_cache_bytes,
            dtype=dtype,
            device=device,
            max_model_len=max_model_len,
        )
        self.runner = ModelRunner(self.model_dir, runner_config)
        tokenizer = Tokenizer(self.model_dir) if (self.model_dir / "tokenizer.json").is_file() else None
        mc = self.runner.model_config
        eos = tuple(mc.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos:
            eos = eos + (tokenizer.eos_token_id,)
        info = WorkerInfo(
            model_name=self.model_dir.name,
            vocab_size=mc.vocab_size,
            max_model_len=self.runner.max_model_len,
            block_size=block_size,
            num_kv_blocks=self.runner.num_kv_blocks,
            eos_token_ids=eos,
            dtype=dtype_name(self.runner.dtype),
            device=str(self.runner.device),
        )
        sched_config = SchedulerConfig(
            max_model_len=self.runner.max_model_len,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            enable_prefix_caching=enable_prefix_caching,
        )
        self.engine = EngineCore(sched_config, info, self.runner, tokenizer)
        self.tokenizer = tokenizer
        self._request_ids = itertools.count()

    @property
    def allocator(self):
        return self.engine.allocator

    def generate(
        self,
        prompts: str | Seq[int] | Seq[str | Seq[int]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[GenerationOutput]:
        """Generate for every prompt (text, or a list of token ids); outputs in prompt order.

        All prompts are validated before any is queued: a bad one raises ``ValueError`` and
        the engine is left as it was."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # one prompt
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")

        token_lists = []
        for i, (prompt, sp) in enumerate(zip(prompts, params)):
            text, ids = (prompt, None) if isinstance(prompt, str) else (None, list(prompt))
            try:
                token_lists.append(self.engine.validate(text, ids, sp))
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None

        request_ids = [f"offline-{next(self._request_ids)}" for _ in prompts]
        collected: dict[str, list[RequestOutput]] = {rid: [] for rid in request_ids}
        for rid, ids, sp in zip(request_ids, token_lists, params):
            self.engine.add_request(rid, prompt_token_ids=ids, sampling=sp)
        try:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.request_id in collected:
                        collected[out.request_id].append(out)
            # drop the finished sequences' worker state too
            while (plan := self.engine.schedule()) is not None:
                self.engine.process_result(self.runner.execute(plan))
        except BaseException:
            for rid in request_ids:
                self.engine.abort(rid)
            raise
        return [self._merge(rid, ids, collected[rid]) for rid, ids in zip(request_ids, token_lists)]

    @staticmethod
    def _merge(request_id: str, prompt_ids: list[int], deltas: list[RequestOutput]) -> GenerationOutput:
        last = deltas[-1]
        logprobs = None
        if last.logprobs is not None:
            logprobs = [lp for d in deltas for lp in (d.logprobs or [])]
        return GenerationOutput(
            request_id=request_id,
            prompt_token_ids=prompt_ids,
            token_ids=[t for d in deltas for t in d.token_ids],
            text="".join(d.text for d in deltas),
            finish_reason=last.finish_reason.value,
            logprobs=logprobs,
            usage=last.usage,
        )
