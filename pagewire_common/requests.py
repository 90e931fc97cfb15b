"""What a request is on both sides of the core's boundary: how it ends (``FinishReason``), the
text delta it streams (``TextDelta``, with ``Usage`` on the last), and the one check of a
tokenized prompt against the engine's limits (``validate_prompt_tokens``), which the API servers,
the core and the offline ``LLM`` all call. Torch-free, like the rest of the floor."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from pagewire_common.sampling import SamplingParams

# A request id is echoed in every response and quoted in errors, whose gRPC metadata must stay
# under 16 KB: longer ids are refused.
MAX_REQUEST_ID_CHARS = 1024


def check_without_tokenizer(sampling: SamplingParams) -> None:
    """``ValueError`` for what a model without a tokenizer cannot do: stop strings are found in
    text, which it does not make."""
    if sampling.stop:
        raise ValueError("stop strings need the model's tokenizer, and this model has no tokenizer.json: "
                         "use stop_token_ids")


def check_request_id(request_id: str) -> None:
    """``ValueError`` for an id longer than ``MAX_REQUEST_ID_CHARS``."""
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise ValueError(f"request_id has {len(request_id)} characters; at most {MAX_REQUEST_ID_CHARS} are allowed")


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model length
    ABORT = "abort"  # cancelled by the client, or failed


@dataclass(slots=True)
class PromptLogprobs:
    """A prompt's tokens under the model (``SamplingParams.prompt_logprobs``): one entry per prompt
    token after the first, entry ``i`` being prompt token ``i + 1`` given tokens ``0..i``, and the
    ``k`` most likely tokens at each of those positions, best first (``k`` = 0: none). NaN where
    nothing was computed (the null worker)."""

    logprobs: np.ndarray  # [P - 1] float32
    top_token_ids: np.ndarray  # [P - 1, k] int32
    top_logprobs: np.ndarray  # [P - 1, k] float32

    @classmethod
    def empty(cls, num_prompt_tokens: int, k: int) -> PromptLogprobs:
        """All NaN, to be filled as the prompt's chunks are computed."""
        n = max(num_prompt_tokens - 1, 0)
        return cls(np.full(n, np.nan, dtype=np.float32), np.zeros((n, k), dtype=np.int32),
                   np.full((n, k), np.nan, dtype=np.float32))

    @property
    def num_top(self) -> int:
        return self.top_token_ids.shape[1]

    def top_lists(self) -> list[tuple[list[int], list[float]]]:
        """The most likely tokens at each entry as (token ids, logprobs) pairs."""
        return list(zip(self.top_token_ids.tolist(), self.top_logprobs.tolist()))


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int


@dataclass(slots=True)
class TextDelta:
    """What one request (one sample) streams next: its tokens since the last delta, their text once
    detokenized, and on the last one why it finished and its usage."""

    request_id: str
    token_ids: list[int]
    text: str = ""
    finish_reason: FinishReason | None = None
    logprobs: list[float] | None = None
    usage: Usage | None = None
    # on a request's first token delta from the engine: prompt tokens served from the prefix cache
    num_cached_prompt_tokens: int | None = None
    # aligned with token_ids when sampling.top_logprobs is set: (token ids, logprobs), best first
    top_logprobs: list[tuple[list[int], list[float]]] | None = None
    # which of the request's n samples this is
    index: int = 0
    # on the first delta when sampling.prompt_logprobs is set (sample 0's only when n > 1)
    prompt_logprobs: PromptLogprobs | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def validate_prompt_tokens(token_ids: list[int], sampling: SamplingParams, *, vocab_size: int, max_model_len: int,
                           strict_length: bool, max_num_seqs: int | None = None) -> None:
    """Check a tokenized request against the engine's limits (``ValueError`` says what is
    wrong). ``strict_length`` rejects prompt + max_tokens beyond the model length (the gRPC
    contract); without it generation simply stops at the model length ("length"). The API
    servers, the core and the offline API all call this one function."""
    if not token_ids:
        raise ValueError("prompt_token_ids is empty")
    if min(token_ids) < 0 or max(token_ids) >= vocab_size:  # min/max: no Python loop per token
        bad = next(t for t in token_ids if not 0 <= t < vocab_size)
        raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab_size})")
    # sampling was validated when it was made: SamplingParams is frozen and checks itself
    bad = next((t for t, _ in sampling.logit_bias if t >= vocab_size), None)
    if bad is not None:
        raise ValueError(f"logit_bias token id {bad} is outside the vocabulary [0, {vocab_size})")
    bad = next((t for t in sampling.stop_token_ids if t >= vocab_size), None)
    if bad is not None:  # the worker masks them before min_tokens: each must be a row of the logits
        raise ValueError(f"stop_token_ids token id {bad} is outside the vocabulary [0, {vocab_size})")
    if max_num_seqs is not None and sampling.n > max_num_seqs:
        raise ValueError(f"n ({sampling.n}) exceeds max_num_seqs ({max_num_seqs}): the samples run together")
    if sampling.structured_output is not None:
        from pagewire_common.grammar import check_grammar  # torch-free

        check_grammar(*sampling.structured_output)
    n = len(token_ids)
    if n >= max_model_len:
        raise ValueError(
            f"prompt has {n} tokens; the maximum model length is {max_model_len} "
            "(prompt plus at least one generated token)"
        )
    if strict_length and n + sampling.max_tokens > max_model_len:
        raise ValueError(
            f"prompt ({n} tokens) + max_tokens ({sampling.max_tokens}) = {n + sampling.max_tokens} "
            f"exceeds the maximum model length {max_model_len}"
        )
