"""Sampling parameters shared by the offline API, the scheduler and the worker.

Pure Python: the scheduler imports this and must never pull in torch.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass

_MAX_SEED = 2**64 - 1
# the largest value of the counts and token ids that cross the wire as uint32 (top_k, max_tokens,
# stop_token_ids, n, min_tokens): a larger one is refused here, not by the encoder
MAX_UINT32 = 2**32 - 1
MAX_TOP_LOGPROBS = 20
# OpenAI's ranges: a penalty or bias beyond them only ever makes a token certain or impossible
MAX_ABS_PENALTY = 2.0
MAX_ABS_LOGIT_BIAS = 100.0
# the engine takes these as 32-bit floats (the wire's float fields): a non-zero value outside
# [F32_TINY, F32_MAX] in size would arrive as 0 or infinity
F32_TINY, F32_MAX = 2.0**-149, 3.4028234663852886e38
# temperatures below this sample greedily (vLLM's threshold); they are taken as 0, compared as
# the 32-bit floats the wire carries, so that a value and its rounding land on the same side
GREEDY_BELOW = 1e-5


def _as_f32(value: float) -> float:
    return struct.unpack("f", struct.pack("f", value))[0]


_GREEDY_BELOW_F32 = _as_f32(GREEDY_BELOW)
_F32_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
STRUCTURED_FIELDS = ("json_schema", "regex", "grammar")
# The API servers match stop strings with an automaton that costs the same per character whatever
# their number (scheduler_svc/api/stop_strings.py); these bound what one request may make it hold.
# OpenAI allows 4 strings, vLLM any number.
MAX_STOP_STRINGS = 1024
MAX_STOP_CHARS = 65536  # all of a request's stop strings together


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens for one request.

    ``temperature == 0`` means greedy decoding, and so does one below ``GREEDY_BELOW`` (1e-5, as in
    vLLM: the sampler's 1 / temperature would overflow its 32-bit floats); ``top_k == 0`` (or -1,
    as vLLM spells it) and ``top_p == 1.0`` switch those filters off. ``seed`` makes a sampled request reproducible: the same prompt,
    parameters and seed give the same tokens whatever else is in the batch. ``stop`` strings
    end generation and are cut from the returned text (kept at its end with
    ``include_stop_str_in_output``); ``stop_token_ids`` end it and are kept
    in ``token_ids``. ``logprobs`` asks for the log-probability of each sampled token under the
    model's distribution (before temperature and filters).

    Logit adjustments, applied on the device in this order: ``logit_bias`` (token id -> value
    added to its logit), ``min_tokens`` (EOS and ``stop_token_ids`` cannot end the sequence
    before that many generated tokens; nor can ``stop`` strings, which the API servers then match
    only where they end in later text), ``repetition_penalty`` (transformers' rule over prompt
    and generated tokens: positive logits divided, negative ones multiplied; 1 is off),
    ``presence_penalty``/``frequency_penalty`` (OpenAI's rule over generated tokens: minus
    ``presence`` once a token appeared, minus ``frequency`` per occurrence), then temperature,
    ``min_p`` (drop tokens below ``min_p`` times the top probability), top-k and top-p.
    ``top_logprobs`` asks for the most likely tokens at each step with their log-probabilities;
    like ``logprobs`` they are the model's distribution before any adjustment.
    ``prompt_logprobs`` (None: off) asks for each prompt token after the first its log-probability
    given the tokens before it, and the ``prompt_logprobs`` most likely tokens at that position (0:
    the token's own only), delivered once, with the first generated token (with ``n > 1``, on
    sample 0 only). Such a request computes its whole prompt: it takes no prefix-cache hits (its
    blocks are still cached for later requests).

    ``n`` samples are drawn from one prompt (prefilled once, its KV blocks shared).
    At most one of ``json_schema`` (a JSON schema, as text or a dict; JSON without free
    whitespace), ``regex`` and ``grammar`` (Lark, or GBNF when it has ``::=``) constrains the
    output. A complete grammar allows only EOS, which ends the sequence (STOP) even under
    ``ignore_eos`` or before ``min_tokens``; ``ignore_eos`` only keeps the model from ending while
    the grammar can still go on.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    n: int = 1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # a mapping token id -> bias; kept as (token id, bias) pairs sorted by id, so the params
    # stay hashable
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    top_logprobs: int = 0
    json_schema: str | None = None
    regex: str | None = None
    grammar: str | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, (int, float)) and 0 < t < 2 * GREEDY_BELOW and _as_f32(t) < _GREEDY_BELOW_F32:
            object.__setattr__(self, "temperature", 0.0)
        if isinstance(self.top_k, int) and not isinstance(self.top_k, bool) and self.top_k == -1:  # vLLM's "off"
            object.__setattr__(self, "top_k", 0)
        # Lists are accepted for convenience and frozen into tuples so the params stay hashable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        bias = self.logit_bias
        pairs = bias.items() if hasattr(bias, "items") else bias
        try:
            pairs = tuple(sorted((int(t), float(b)) for t, b in pairs))
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias must map token ids to numbers, got {bias!r}") from None
        object.__setattr__(self, "logit_bias", pairs)
        if isinstance(self.json_schema, dict):
            object.__setattr__(self, "json_schema", json.dumps(self.json_schema))
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first field that is out of range."""
        if not isinstance(self.temperature, (int, float)) or math.isnan(self.temperature):
            raise ValueError(f"temperature must be a number, got {self.temperature!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        if math.isinf(self.temperature):
            raise ValueError("temperature must be finite")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or not 0 <= self.top_k <= MAX_UINT32:
            raise ValueError(f"top_k must be an integer in [0, {MAX_UINT32}] (0 disables it), got {self.top_k!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed <= _MAX_SEED):
            raise ValueError(f"seed must be an integer in [0, 2**64) or None, got {self.seed!r}")
        for name in ("ignore_eos", "logprobs", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                hint = " (top_logprobs=k asks for the k most likely tokens as well)" if name == "logprobs" else ""
                raise ValueError(f"{name} must be True or False{hint}, got {getattr(self, name)!r}")
        if not isinstance(self.max_tokens, int) or not 1 <= self.max_tokens <= MAX_UINT32:
            raise ValueError(f"max_tokens must be an integer in [1, {MAX_UINT32}], got {self.max_tokens!r}")
        validate_stop(self.stop)
        for t in self.stop_token_ids:
            if not 0 <= t <= MAX_UINT32:
                raise ValueError(f"stop_token_ids must be token ids in [0, {MAX_UINT32}], got {t}")
        if not isinstance(self.n, int) or not 1 <= self.n <= MAX_UINT32:
            raise ValueError(f"n must be an integer in [1, {MAX_UINT32}], got {self.n!r}")
        if not (0.0 <= self.min_p <= 1.0):  # also false for NaN
            raise ValueError(f"min_p must be in [0, 1] (0 disables it), got {self.min_p}")
        if not (0.0 < self.repetition_penalty < math.inf):
            raise ValueError(f"repetition_penalty must be > 0 (1 disables it), got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (-MAX_ABS_PENALTY <= value <= MAX_ABS_PENALTY):
                raise ValueError(f"{name} must be in [-{MAX_ABS_PENALTY:g}, {MAX_ABS_PENALTY:g}], got {value}")
        for token, bias in self.logit_bias:
            if token < 0:
                raise ValueError(f"logit_bias keys must be token ids >= 0, got {token}")
            if not (-MAX_ABS_LOGIT_BIAS <= bias <= MAX_ABS_LOGIT_BIAS):
                raise ValueError(f"logit_bias values must be in [-{MAX_ABS_LOGIT_BIAS:g}, {MAX_ABS_LOGIT_BIAS:g}], "
                                 f"got {bias} for token {token}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        if not isinstance(self.top_logprobs, int) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs!r}")
        k = self.prompt_logprobs
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= MAX_TOP_LOGPROBS):
            raise ValueError(f"prompt_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}] or None, got {k!r}")
        for name in _F32_FIELDS:
            value = getattr(self, name)
            if value and not F32_TINY <= abs(value) <= F32_MAX:
                raise ValueError(f"{name} must fit the engine's 32-bit floats (0, or between {F32_TINY:.3g} and "
                                 f"{F32_MAX:.3g} in size), got {value!r}")
        given = [name for name in STRUCTURED_FIELDS if getattr(self, name) is not None]
        if len(given) > 1:
            raise ValueError(f"at most one of json_schema, regex and grammar may be set, got {' and '.join(given)}")
        for name in given:
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"{name} must be a non-empty string")
            check_text(name, getattr(self, name))

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        """Whether the worker must count this sequence's tokens (repetition, presence, frequency)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def structured_output(self) -> tuple[str, str] | None:
        """``(kind, text)`` of the grammar that constrains the output (kind is a field name), or None."""
        for name in STRUCTURED_FIELDS:
            text = getattr(self, name)
            if text is not None:
                return name, text
        return None


def validate_stop(stop: tuple[str, ...]) -> None:
    """Raise ``ValueError`` unless ``stop`` is non-empty strings within ``MAX_STOP_STRINGS`` and
    ``MAX_STOP_CHARS``."""
    if len(stop) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stop)}")
    for s in stop:
        if not isinstance(s, str) or not s:
            raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        check_text("a stop string", s)
    num_chars = sum(map(len, stop))
    if num_chars > MAX_STOP_CHARS:
        raise ValueError(f"stop strings may have at most {MAX_STOP_CHARS} characters in all, got {num_chars}")


def check_text(what: str, text: str) -> None:
    """Raise ``ValueError`` unless ``text`` is valid Unicode: a lone UTF-16 surrogate (JSON's
    ``"\\ud83d"`` without its pair, from a client that cut a string inside an emoji) has no UTF-8
    form, so no tokenizer or wire can carry it."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"{what} is not valid Unicode text: it holds a lone surrogate "
                             f"{text[e.start]!r} at character {e.start}") from None


# The declared defaults, for code that has to name one: a keyword argument's default, what an unset
# protobuf field means. Read them here rather than repeat the literals.
DEFAULT_SAMPLING = SamplingParams()
