"""Offline batch inference: the scheduler and the worker halves in one process."""

from __future__ import annotations

import gc
import itertools
import logging
import operator
import sys
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence as Seq

from pagewire_common import step_profile
from pagewire_common.chat_template import ChatOptions, load_chat_template
from pagewire_common.core_messages import CoreOutputs
from pagewire_common.requests import TextDelta, Usage, check_without_tokenizer
from pagewire_common.sampling import SamplingParams, check_text
from pagewire_common.settings import OFFLINE_SETTING_NAMES, SETTING_NAMES, Settings
from scheduler_svc.api.text_stream import OutputProcessor
from scheduler_svc.api.tokenizer import Tokenizer
from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.delivery import ApiClient, deliver
from scheduler_svc.core.engine import EngineCore, InProcessLink, WorkerInfo, run_step

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
    # when sampling.top_logprobs is set: at each generated token, the most likely tokens (ids,
    # logprobs), best first
    top_logprobs: list[tuple[list[int], list[float]]] | None = None
    # which of the n samples this is; with n > 1, the first one lists all n here, in order
    index: int = 0
    samples: list["GenerationOutput"] | None = None
    # when sampling.prompt_logprobs is set (sample 0 only, with n > 1): one entry per prompt
    # token after the first (entry i is prompt token i + 1 given tokens 0..i; the first has
    # none), and with prompt_logprobs > 0 the most likely tokens (ids, logprobs) at each, best first
    prompt_logprobs: list[float] | None = None
    prompt_top_logprobs: list[tuple[list[int], list[float]]] | None = None

    @property
    def num_cached_tokens(self) -> int:
        return self.usage.cached_prompt_tokens


class LLM:
    """Generate from many prompts at once with continuous batching and a paged KV cache.

    ``model`` is a Hugging Face model directory (safetensors + config + tokenizer), a ``.gguf``
    file (converted once into a cached safetensors directory), or None for the embedded
    SmolLM2-135M-Instruct. Keyword arguments are the worker's and the engine core's settings of
    ``pagewire serve`` (``pagewire_common.settings.Settings``: ``block_size``,
    ``max_num_batched_tokens``, ``max_num_seqs``, ``num_kv_blocks``, ``kv_cache_bytes``,
    ``enable_prefix_caching``, ``dtype``, ``device``, ``max_model_len``, ...), with the same
    defaults and checks; one only the served processes read is a ``TypeError``.

    ``tensor_parallel_size=N`` shards the model over N ranks: this process is rank 0 and starts
    ranks 1..N-1 as child processes, which stop with ``close()`` (or when this process exits). A
    process holds one such group at a time (torch.distributed's default group).
    """

    def __init__(self, model: str | Path | None = None, **settings):
        from worker_svc.dtypes import dtype_name
        from worker_svc.parallel.ranks import start_runner
        from worker_svc.weights import model_name, resolve_model_path

        unknown = sorted(set(settings) - SETTING_NAMES)
        if unknown:
            raise TypeError(f"LLM() got unknown settings {unknown}; see pagewire_common.settings.Settings")
        served_only = sorted(set(settings) - OFFLINE_SETTING_NAMES)
        if served_only:
            raise TypeError(f"LLM() got settings of the served path only {served_only} (API servers, processes, the "
                            "core service's event loop); the offline engine takes the worker's and the core's")
        self.settings = Settings.from_kwargs(model=None if model is None else str(model), **settings)
        self.model_dir = resolve_model_path(model)
        self.runner = start_runner(self.model_dir, self.settings)
        # the other ranks stop with this object, or at the latest when the interpreter exits
        self._finalizer = weakref.finalize(self, _close_runner, self.runner)
        tokenizer = Tokenizer(self.model_dir) if (self.model_dir / "tokenizer.json").is_file() else None
        mc = self.runner.model_config
        info = WorkerInfo.build(
            model_name=self.settings.served_model_name or model_name(model, self.model_dir), vocab_size=mc.vocab_size, max_model_len=self.runner.max_model_len,
            block_size=self.runner.block_size, num_kv_blocks=self.runner.num_kv_blocks,
            eos_token_ids=mc.eos_token_ids, dtype=dtype_name(self.runner.dtype), device=str(self.runner.device),
            tokenizer_eos_token_id=tokenizer.eos_token_id if tokenizer is not None else None,
            structured_output=self.runner.structured_output,
        )
        self.engine = EngineCore(SchedulerConfig.from_settings(self.settings, self.runner.max_model_len), info)
        self.tokenizer = tokenizer
        self._request_ids = itertools.count()
        # the step profile is the process's: this LLM's setting turns it on or off
        step_profile.configure("offline", self.settings.profile_steps)
        # as each served process does once ready: the model, its modules and torch's objects live as
        # long as the engine, so keep them out of the collector's full collections (one took ~280 ms
        # in a generate on a 2-core VM)
        gc.collect()
        gc.freeze()

    def close(self) -> None:
        """Stop the other tensor-parallel ranks and let go of the model and its KV cache;
        ``generate`` and ``chat`` raise ``RuntimeError`` afterwards. Closing twice is harmless."""
        self._finalizer()
        self.runner = self.engine = None

    def _check_open(self) -> None:
        if self.engine is None:
            raise RuntimeError("this LLM is closed")

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def allocator(self):
        return self.engine.allocator

    def profile(self, reset: bool = False) -> dict | None:
        """With ``profile_steps=N``: the step profile since this LLM started or was last reset, as
        each ``step profile`` line logs it every N steps (``pagewire_common.step_profile``): ``steps``,
        ``tokens`` (sampled), ``wall_us`` and per phase ``total_us``, ``us_per_step`` and
        ``us_per_token``; the worker's phases (apply plan, prepare inputs, forward, sample) and the
        core's and the API server's that run here (schedule, apply result, deliver, dispatch).
        ``reset`` starts the figures over after reading them. None when profiling is off."""
        profile = step_profile.active()
        if profile is None:
            return None
        figures = profile.summary()
        if reset:
            profile.reset()
        return figures

    def generate(
        self,
        prompts: str | Seq[int] | Seq[str | Seq[int]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        use_tqdm: bool | None = None,
    ) -> list[GenerationOutput]:
        """Generate for every prompt; outputs in prompt order. A prompt is a text, token ids (a
        list, or a numpy or torch vector), or vLLM's ``{"prompt": text}`` or
        ``{"prompt_token_ids": ids}``; ``prompts`` is one prompt or a sequence of them.
        ``use_tqdm``: a progress bar of finished samples on stderr (None: where stderr is a
        terminal and there are several samples).

        All prompts are validated before any is queued: a bad one raises ``ValueError`` and
        the engine is left as it was."""
        self._check_open()
        prompts = _prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            iterable = hasattr(sampling_params, "__iter__") and not isinstance(sampling_params, (str, bytes, dict))
            params = list(sampling_params) if iterable else None
            if params is None or not all(isinstance(p, SamplingParams) for p in params):
                raise TypeError("sampling_params must be a SamplingParams or a list of them (one per prompt), got "
                                f"{type(sampling_params).__name__}")
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")

        token_lists = []
        for i, (prompt, sp) in enumerate(zip(prompts, params)):
            try:
                if self.tokenizer is None:
                    check_without_tokenizer(sp)
                token_lists.append(self.engine.validate(self._tokenize(prompt), sp))
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None

        engine = self.engine
        # the same path as served requests, without the processes: the engine's steps become
        # CoreOutputs for one API server (``deliver``), and those become text (``OutputProcessor``)
        steps: list[CoreOutputs] = []
        client = ApiClient(0, send=steps.append)
        clients = {0: client}
        processor = OutputProcessor(self.tokenizer)
        requests = []  # (request id, name, prompt ids, sampling)
        for ids, sp in zip(token_lists, params):
            request_id = next(self._request_ids)
            for _ in range(1, sp.n):  # the samples take the next ids
                next(self._request_ids)
            requests.append((request_id, f"offline-{request_id}", ids, sp))
        collected: dict[int, _Merged] = {}
        for request_id, name, ids, sp in requests:
            engine.add_request(request_id, ids, sp, validated=True)
            client.request_ids.update(range(request_id, request_id + sp.n))
            processor.add(request_id, name, ids, sp)
            for index in range(sp.n):
                collected[request_id + index] = _Merged()
        link = InProcessLink(self.runner)
        depth = 2 if self.settings.overlap else 1
        bar = _progress(len(collected), use_tqdm)
        try:
            while not engine.is_idle():  # until every request ended and the worker dropped them
                step = run_step(engine, link, depth)
                if step is None:
                    continue
                with step_profile.phase("deliver"):
                    deliver(step, clients)
                num_tokens = 0
                with step_profile.phase("dispatch"):
                    for outputs in steps:
                        num_tokens += len(outputs.request_ids)
                        ready, stopped = processor.apply(outputs)
                        for request_id in stopped:
                            engine.finish(request_id)
                            client.request_ids.discard(request_id)
                        for request_id, delta in ready:
                            collected[request_id].add(delta)
                            if bar is not None and delta.finish_reason is not None:
                                bar.update(1)
                steps.clear()
                step_profile.end_step(num_tokens)
        except BaseException:
            # a step failed or was interrupted halfway: the engine and the worker may disagree about
            # what ran, so both start afresh, as after a lost worker (the prefix cache goes too)
            engine.reset()
            self.runner.reset()
            raise
        finally:
            if bar is not None:
                bar.close()
        outputs = []
        for request_id, name, ids, sp in requests:
            samples = [collected[request_id + i].output(name, ids) for i in range(sp.n)]
            if sp.n > 1:
                samples[0].samples = samples
            outputs.append(samples[0])
        return outputs

    def chat(
        self,
        messages: Seq[dict[str, str]] | Seq[Seq[dict[str, str]]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = ChatOptions().add_generation_prompt,
        continue_final_message: bool = ChatOptions().continue_final_message,
        use_tqdm: bool | None = None,
    ) -> list[GenerationOutput]:
        """Answer each conversation, as the served ``Chat`` and ``/v1/chat/completions`` do:
        ``messages`` is one conversation (a list of ``{"role": ..., "content": ...}``) or a list of
        them, each rendered with the model's chat template, or with ``chat_template`` (a Jinja
        file's path or the template itself, as ``--chat-template`` takes), then generated as
        ``generate`` does; one output per conversation, in order. ``add_generation_prompt`` and
        ``continue_final_message`` say how a rendered conversation ends (``ChatOptions``);
        ``use_tqdm`` as for ``generate``."""
        self._check_open()
        if not messages:
            raise ValueError("messages is empty: give a conversation or a list of them")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so no chat template")
        template = load_chat_template(chat_template) if chat_template is not None else None
        prompts = []
        for i, conversation in enumerate(conversations):
            try:
                if isinstance(conversation, (str, dict)) or not conversation:
                    raise ValueError("it must be a non-empty list of messages")
                prompts.append(self.tokenizer.apply_chat_template(list(conversation), add_generation_prompt,
                                                                  template, continue_final_message))
            except ValueError as e:
                raise ValueError(f"conversation {i}: {e}") from None
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _tokenize(self, prompt) -> list[int]:
        if isinstance(prompt, dict):  # vLLM's TextPrompt and TokensPrompt
            if set(prompt) == {"prompt"} and isinstance(prompt["prompt"], str):
                prompt = prompt["prompt"]
            elif set(prompt) == {"prompt_token_ids"}:
                prompt = prompt["prompt_token_ids"]
            else:
                raise ValueError("a prompt given as a dict holds one key, 'prompt' (a text) or 'prompt_token_ids' "
                                 f"(token ids), got {sorted(prompt)}")
        if hasattr(prompt, "tolist"):  # numpy, torch
            prompt = prompt.tolist()
        if not isinstance(prompt, str):
            ids = _token_ids(prompt)
            if ids is None:
                raise ValueError(f"a prompt is a text or a list of token ids (integers), got {_describe(prompt)}")
            return ids
        if not prompt:
            raise ValueError("prompt is empty")
        check_text("the prompt", prompt)
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer; give token ids")
        ids = self.tokenizer.encode(prompt)
        if not ids:
            raise ValueError("prompt encodes to no tokens")
        return ids

    @staticmethod
    def _merge(request_id: str, prompt_ids: list[int], deltas: list[TextDelta]) -> GenerationOutput:
        merged = _Merged()
        for delta in deltas:
            merged.add(delta)
        return merged.output(request_id, prompt_ids)


class _Merged:
    """One sample's deltas merged as they arrive. The engine hands over a delta per token; kept
    until the end, they are objects per token that every garbage collection walks again (on a
    small model a collection then costs more than a step)."""

    __slots__ = ("token_ids", "texts", "logprobs", "top_logprobs", "prompt_logprobs", "last")

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.texts: list[str] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[tuple[list[int], list[float]]] = []
        self.prompt_logprobs = None
        self.last: TextDelta | None = None

    def add(self, delta: TextDelta) -> None:
        self.token_ids.extend(delta.token_ids)
        self.texts.append(delta.text)
        if delta.logprobs:
            self.logprobs.extend(delta.logprobs)
        if delta.top_logprobs:
            self.top_logprobs.extend(delta.top_logprobs)
        if self.prompt_logprobs is None:
            self.prompt_logprobs = delta.prompt_logprobs
        self.last = delta

    def output(self, request_id: str, prompt_ids: list[int]) -> GenerationOutput:
        last, prompt = self.last, self.prompt_logprobs
        return GenerationOutput(
            prompt_logprobs=prompt.logprobs.tolist() if prompt is not None else None,
            prompt_top_logprobs=prompt.top_lists() if prompt is not None and prompt.num_top else None,
            request_id=request_id,
            prompt_token_ids=prompt_ids,
            token_ids=self.token_ids,
            text="".join(self.texts),
            finish_reason=last.finish_reason.value,
            logprobs=self.logprobs if last.logprobs is not None else None,
            usage=last.usage,
            top_logprobs=self.top_logprobs if last.top_logprobs is not None else None,
            index=last.index,
        )


def _close_runner(runner) -> None:
    close = getattr(runner, "close", None)
    if close is not None:
        close()


def _progress(total: int, use_tqdm: bool | None):
    """``generate``'s bar of finished samples, or None (``use_tqdm`` False, or None where stderr is
    not a terminal or there is one sample)."""
    if use_tqdm is False or (use_tqdm is None and (total < 2 or not sys.stderr.isatty())):
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="generate", unit="sample", file=sys.stderr, dynamic_ncols=True)


def _is_token_id(value) -> bool:
    """An integer: Python's, numpy's, or a one-element integer tensor (``operator.index`` takes them)."""
    if isinstance(value, (bool, str, bytes)):
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def _token_ids(prompt) -> list[int] | None:
    """A prompt of token ids (a list, tuple, range or other iterable of integers) as a list; None
    for anything else."""
    if isinstance(prompt, (bytes, bytearray, dict)) or not hasattr(prompt, "__iter__"):
        return None
    values = list(prompt)
    return [operator.index(t) for t in values] if all(_is_token_id(t) for t in values) else None


def _describe(value) -> str:
    if isinstance(value, (list, tuple)):
        bad = next((v for v in value if not _is_token_id(v)), None)
        return f"a {type(value).__name__} holding {bad!r}"
    return type(value).__name__


def _prompt_list(prompts) -> list:
    """``generate``'s prompts as a list of prompts: one prompt (a text, token ids, a dict) is a
    list of one; any other sequence or iterable is a list of prompts."""
    if hasattr(prompts, "tolist"):  # a numpy or torch vector of ids, or a matrix of them
        prompts = prompts.tolist()
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (bytes, bytearray)) or not hasattr(prompts, "__iter__"):
        raise TypeError(f"prompts must be a prompt or a sequence of prompts, got {type(prompts).__name__}")
    prompts = list(prompts)  # a generator too
    if prompts and _is_token_id(prompts[0]):
        return [prompts]  # one prompt of token ids
    return prompts
