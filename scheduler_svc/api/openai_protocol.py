"""The OpenAI API's JSON shapes: request bodies to our requests, our deltas to its responses.

Parsing only checks what JSON can get wrong (types, shapes, fields we do not serve); what a
valid prompt and valid sampling parameters are is said once, by ``open_request`` and
``SamplingParams.validate``, for both doors. Fields we do not know are ignored, as OpenAI-compatible
servers do; a known field we cannot honour is an error rather than silently dropped.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass, field

import grpc

from pagewire_common.chat_template import ChatOptions
from pagewire_common.requests import TextDelta
from pagewire_common.sampling import DEFAULT_SAMPLING, MAX_TOP_LOGPROBS, SamplingParams, validate_stop

_SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))

# gRPC status of a refused or failed request -> HTTP status and OpenAI error type
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
}


class OpenAIError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    @classmethod
    def from_grpc(cls, code: grpc.StatusCode, message: str) -> "OpenAIError":
        """The answer to a refusal of the shared checks (or the core's): a message that starts
        with the name of a sampling field ("top_p must be ...") names it as the param."""
        status, kind = HTTP_STATUS.get(code, (500, "internal_error"))
        first = message.split(" ", 1)[0]
        param = first if status == 400 and first in _SAMPLING_FIELDS else None
        return cls(status, message, kind, param=param, code=code.name.lower())

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param)


@dataclass
class ParsedRequest:
    """One OpenAI request: the prompts it holds (each a keyword set for ``open_request``), the
    sampling parameters (or why they are invalid) and how to answer."""

    chat: bool
    model: str
    prompts: list[dict]
    sampling: SamplingParams | None
    sampling_error: str | None
    n: int
    stream: bool = False
    include_usage: bool = False
    num_top_logprobs: int | None = None  # None: no logprobs; 0: the sampled token's only
    fill_max_tokens: bool = False  # chat without max_tokens: up to the model length
    return_token_ids: bool = False  # each choice also carries its token ids (as vLLM's extra field)
    echo: bool = False  # completions: each choice starts with its prompt (and, with logprobs, the prompt's)
    echo_only: bool = False  # echo with max_tokens 0: the prompt alone (one token is computed, not answered)
    created: int = field(default_factory=lambda: int(time.time()))


def _get(body: dict, name: str, types, default=None):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise bad(f"{name} must be {_type_names(types)}, got a boolean", name)
    if not isinstance(value, types):
        raise bad(f"{name} must be {_type_names(types)}, got {type(value).__name__}", name)
    if isinstance(value, float) and not math.isfinite(value):
        raise bad(f"{name} must be a finite number", name)
    return value


def _type_names(types) -> str:
    names = {int: "an integer", float: "a number", str: "a string", bool: "a boolean", list: "a list", dict: "an object"}
    types = types if isinstance(types, tuple) else (types,)
    if types == (int, float):
        return "a number"
    return " or ".join(names.get(t, t.__name__) for t in types)


def _int_list(value, name: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise bad(f"{name} must be a list of integers", name)
    return value


def parse_messages(value) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise bad("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(f"messages[{i}] must be an object with a string role", "messages")
        content = m.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):  # content parts: text only
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad(f"messages[{i}].content: only text parts are supported", "messages")
                texts.append(part["text"])
            content = "".join(texts)
        elif not isinstance(content, str):
            raise bad(f"messages[{i}].content must be a string or a list of text parts", "messages")
        out.append({"role": m["role"], "content": content})
    return out


def chat_options(body: dict) -> ChatOptions:
    """vLLM's ``add_generation_prompt`` and ``continue_final_message`` (chat and tokenize)."""
    default = ChatOptions()
    try:
        return ChatOptions(_get(body, "add_generation_prompt", bool, default.add_generation_prompt),
                           _get(body, "continue_final_message", bool, default.continue_final_message))
    except ValueError as e:
        raise bad(str(e), "continue_final_message") from None


def _prompts(value) -> list[dict]:
    """``prompt``: a string, a list of strings, a list of token ids, or a list of such lists."""
    if isinstance(value, str):
        return [{"prompt": value}]
    if isinstance(value, list) and value:
        if all(isinstance(p, str) for p in value):
            return [{"prompt": p} for p in value]
        if all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            return [{"prompt_token_ids": value}]
        if all(isinstance(p, list) for p in value):
            return [{"prompt_token_ids": _int_list(p, "prompt")} for p in value]
    raise bad("prompt must be a string, a list of strings, a list of token ids or a list of token-id lists", "prompt")


def _structured(body: dict, put) -> None:
    """Structured output: OpenAI's ``response_format``, and what vLLM's clients send: the
    ``guided_json``/``guided_regex``/``guided_grammar``/``guided_choice`` fields and the
    ``structured_outputs`` object (``json``, ``regex``, ``grammar``, ``choice``, ``json_object``).
    One constraint a request; a choice is a grammar of its strings."""
    given: list[tuple[str, str, str]] = []  # (SamplingParams field, its text, the body's field)
    fmt = _get(body, "response_format", dict, None)
    if fmt is not None:
        kind = fmt.get("type")
        if kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                raise bad("response_format.json_schema.schema must be a JSON schema object", "response_format")
            given.append(("json_schema", json.dumps(spec["schema"]), "response_format"))
        elif kind == "json_object":
            given.append(("json_schema", _JSON_OBJECT, "response_format"))
        elif kind != "text":
            raise bad(f"response_format.type must be text, json_object or json_schema, got {kind!r}", "response_format")
    guided = _get(body, "guided_json", (dict, str), None)
    if guided is not None:
        given.append(("json_schema", guided if isinstance(guided, str) else json.dumps(guided), "guided_json"))
    for name, field_name in (("guided_regex", "regex"), ("guided_grammar", "grammar")):
        text = _get(body, name, str, None)
        if text is not None:
            given.append((field_name, text, name))
    choice = _get(body, "guided_choice", list, None)
    if choice is not None:
        given.append(("grammar", _choice_grammar(choice, "guided_choice"), "guided_choice"))
    outputs = _get(body, "structured_outputs", dict, None)
    if outputs is not None:
        given.extend(_structured_outputs(outputs))
    if len(given) > 1:
        raise bad(f"give one structured output constraint, not {' and '.join(g[2] for g in given)}", given[1][2])
    for field_name, text, _ in given:
        put(field_name, text)


_JSON_OBJECT = json.dumps({"type": "object"})
_PARAM = "structured_outputs"


def _structured_outputs(value: dict) -> list[tuple[str, str, str]]:
    """vLLM's ``structured_outputs`` object; its option flags (whitespace, fallback, backend) are
    hints this server's one engine has no use for."""
    given = []
    if value.get("structural_tag") is not None:
        raise bad("structured_outputs.structural_tag is not supported", _PARAM)
    json_spec = value.get("json")
    if json_spec is not None:
        if not isinstance(json_spec, (dict, str)):
            raise bad("structured_outputs.json must be a JSON schema (an object or its text)", _PARAM)
        given.append(("json_schema", json_spec if isinstance(json_spec, str) else json.dumps(json_spec), _PARAM))
    for key, field_name in (("regex", "regex"), ("grammar", "grammar")):
        text = value.get(key)
        if text is not None:
            if not isinstance(text, str):
                raise bad(f"structured_outputs.{key} must be a string", _PARAM)
            given.append((field_name, text, _PARAM))
    if value.get("choice") is not None:
        given.append(("grammar", _choice_grammar(value["choice"], "structured_outputs.choice"), _PARAM))
    json_object = value.get("json_object")
    if json_object is not None and not isinstance(json_object, bool):
        raise bad("structured_outputs.json_object must be a boolean", _PARAM)
    if json_object:
        given.append(("json_schema", _JSON_OBJECT, _PARAM))
    if len(given) > 1:
        raise bad("structured_outputs: give one of json, regex, grammar, choice and json_object", _PARAM)
    return given


def _choice_grammar(choices, name: str) -> str:
    """The grammar (Lark) whose sentences are exactly ``choices``: each a string literal, written
    as JSON writes it."""
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise bad(f"{name} must be a non-empty list of non-empty strings", name.partition(".")[0])
    return "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in dict.fromkeys(choices))


# vLLM request fields refused unless they hold a value that changes nothing
_UNSUPPORTED_VLLM_FIELDS: dict[str, tuple] = {
    "allowed_token_ids": (None, []), "bad_words": (None, []), "truncate_prompt_tokens": (None,),
    "use_beam_search": (None, False), "skip_special_tokens": (None, True), "length_penalty": (None, 1, 1.0),
}


def parse(body, *, chat: bool) -> ParsedRequest:
    """An OpenAI completions or chat-completions body -> ``ParsedRequest`` (``OpenAIError`` 400)."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    model = _get(body, "model", str, "")
    if chat:
        if "messages" not in body:
            raise bad("messages is required", "messages")
        prompts = [{"messages": parse_messages(body["messages"]), "chat_options": chat_options(body)}]
    else:
        if "prompt" not in body:
            raise bad("prompt is required", "prompt")
        prompts = _prompts(body["prompt"])
    echo = _get(body, "echo", bool, False)
    if echo and chat:
        raise bad("echo is not supported on chat completions", "echo")
    if _get(body, "tools", list, None) and body.get("tool_choice") != "none":
        raise bad("tools are not supported: this server does not call tools (tool_choice \"none\" leaves them out)",
                  "tools")
    if _get(body, "functions", list, None) and body.get("function_call") != "none":  # the older spelling of tools
        raise bad("functions are not supported: this server does not call functions", "functions")
    if any(m != "text" for m in _get(body, "modalities", list, None) or ()):
        raise bad("only the text modality is supported", "modalities")
    # a tool or function to call with none given is OpenAI's 400 too ("none" and "auto" ask nothing)
    if body.get("tool_choice") not in (None, "none", "auto") and not body.get("tools"):
        raise bad("tool_choice other than \"none\" or \"auto\" needs tools, which this server does not call",
                  "tool_choice")
    if body.get("function_call") not in (None, "none", "auto") and not body.get("functions"):
        raise bad("function_call other than \"none\" or \"auto\" needs functions, which this server does not call",
                  "function_call")
    # vLLM's fields that would change the output, which this server does not implement
    for name, inert in _UNSUPPORTED_VLLM_FIELDS.items():
        if name in body and body[name] not in inert:
            raise bad(f"{name} is not supported by this server", name)
    n = _get(body, "n", int, DEFAULT_SAMPLING.n)
    if echo and n != 1:
        raise bad("echo with n other than 1 is not supported", "echo")
    if _get(body, "best_of", int, 1) not in (1, n):
        raise bad("best_of other than n is not supported", "best_of")
    if _get(body, "suffix", str, None):
        raise bad("suffix is not supported", "suffix")
    if body.get("prompt_logprobs") is not None:  # vLLM's extension: here only on gRPC Generate
        raise bad("prompt_logprobs is not supported by the HTTP door; Generate over gRPC takes it", "prompt_logprobs")
    stream = _get(body, "stream", bool, False)
    options = _get(body, "stream_options", dict, {})
    if options and not stream:
        raise bad("stream_options is only allowed with stream: true", "stream_options")
    include_usage = bool(stream and _get(options, "include_usage", bool, False))
    if n < 1:
        raise bad(f"n must be >= 1, got {n}", "n")

    kw: dict = {}
    unsupported: list[str] = []

    def put(name: str, value) -> None:
        """A sampling field the body sets; one it leaves out (None) keeps SamplingParams's default."""
        if value is None:
            return
        if name in _SAMPLING_FIELDS:
            kw[name] = value
        else:
            unsupported.append(name)

    def number(name: str) -> float | None:
        value = _get(body, name, (int, float))
        return None if value is None else float(value)

    put("temperature", number("temperature"))
    put("top_p", number("top_p"))
    top_k = _get(body, "top_k", int)
    put("top_k", 0 if top_k == -1 else top_k)  # -1 is "off" for vLLM's clients, 0 for ours
    put("seed", _get(body, "seed", int))
    max_tokens = _get(body, "max_completion_tokens", int, None) if chat else None
    if max_tokens is None:
        max_tokens = _get(body, "max_tokens", int, None)
    min_tokens = _get(body, "min_tokens", int)
    # echo with max_tokens 0 answers the prompt alone (a log-likelihood request): one token is
    # computed, for the engine computes at least one, and left out of the answer
    echo_only = echo and max_tokens == 0
    if echo_only:
        max_tokens = 1
    # completions without max_tokens get SamplingParams's default, which is OpenAI's
    fill = chat and max_tokens is None
    if fill:
        # replaced by what the model length leaves once the prompt is known (and checked again then)
        max_tokens = max(1, min_tokens or 0)
    put("max_tokens", max_tokens)
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise bad("stop must be a string or a list of strings", "stop")
        try:
            validate_stop(tuple(stop))
        except ValueError as e:
            raise bad(str(e), "stop") from None
        put("stop", tuple(stop))
    put("include_stop_str_in_output", _get(body, "include_stop_str_in_output", bool))
    if body.get("stop_token_ids") is not None:
        put("stop_token_ids", tuple(_int_list(body["stop_token_ids"], "stop_token_ids")))
    put("ignore_eos", _get(body, "ignore_eos", bool))
    for name in ("min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        put(name, number(name))
    put("min_tokens", min_tokens)
    bias = _get(body, "logit_bias", dict)
    if bias is not None:
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in bias.values()):
            raise bad("logit_bias must map token ids to numbers", "logit_bias")
        try:
            bias = {int(k): float(v) for k, v in bias.items()}
        except (TypeError, ValueError):
            raise bad("logit_bias must map token ids to numbers", "logit_bias") from None
        put("logit_bias", bias)
    put("n", n)
    _structured(body, put)

    # logprobs: chat asks with a flag and top_logprobs; completions with the number of top tokens
    if chat:
        want = _get(body, "logprobs", bool, False)
        top = _get(body, "top_logprobs", int, 0)
        if top and not want:
            raise bad("top_logprobs needs logprobs: true", "top_logprobs")
        num_top = top if want else None
    else:
        lp = _get(body, "logprobs", int, None)
        num_top = lp
    if num_top is not None:
        if not 0 <= num_top <= MAX_TOP_LOGPROBS:
            raise bad(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {num_top}",
                      "top_logprobs" if chat else "logprobs")
        put("logprobs", True)
        if num_top:
            put("top_logprobs", num_top)
        if echo:  # the prompt's logprobs too
            put("prompt_logprobs", num_top)

    return_ids = _get(body, "return_token_ids", bool, False)
    if unsupported:
        sampling, error = None, f"{', '.join(unsupported)}: not supported by this server"
    else:
        try:
            sampling, error = SamplingParams(**kw), None
        except (ValueError, TypeError) as e:
            sampling, error = None, str(e)
    return ParsedRequest(chat, model, prompts, sampling, error, n, stream, include_usage, num_top, fill, return_ids,
                         echo=echo, echo_only=echo_only)


# ---- responses -------------------------------------------------------------------------------


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def token_text(tokenizer, token_id: int) -> tuple[str, list[int]]:
    """A token as OpenAI shows it in logprobs: its text and its UTF-8 bytes."""
    if tokenizer is None:
        return f"token_id:{token_id}", []
    table = tokenizer.token_bytes
    if token_id in tokenizer.special_token_ids:  # no text in the stream, but named here (<|im_end|>)
        raw = tokenizer.decode([token_id], skip_special_tokens=False).encode()
    elif table is not None and token_id < len(table):
        raw = table[token_id]
    else:
        raw = tokenizer.decode([token_id]).encode()
    return raw.decode("utf-8", errors="replace"), list(raw)


class LogprobsBuilder:
    """Accumulates one choice's logprobs in the chat or the completions shape."""

    def __init__(self, chat: bool, tokenizer):
        self.chat = chat
        self.tokenizer = tokenizer
        self.offset = 0

    def part(self, out: TextDelta) -> dict:
        tops = getattr(out, "top_logprobs", None) or [None] * len(out.token_ids)
        lps = out.logprobs or [float("nan")] * len(out.token_ids)
        entries = []
        for token_id, lp, top in zip(out.token_ids, lps, tops):
            text, raw = token_text(self.tokenizer, token_id)
            alts = [] if top is None else [(token_text(self.tokenizer, t), v) for t, v in zip(*top)]
            entries.append((text, raw, lp, alts))
        if self.chat:
            return {"content": [{"token": t, "logprob": lp, "bytes": raw,
                                 "top_logprobs": [{"token": a, "logprob": v, "bytes": ab} for (a, ab), v in alts]}
                                for t, raw, lp, alts in entries]}
        offsets = []
        for t, *_ in entries:
            offsets.append(self.offset)
            self.offset += len(t)
        return {"tokens": [e[0] for e in entries], "token_logprobs": [e[2] for e in entries],
                "top_logprobs": [{a: v for (a, _), v in e[3]} or None for e in entries], "text_offset": offsets}


def merge_logprobs(parts: list[dict], chat: bool) -> dict:
    if chat:
        return {"content": [c for p in parts for c in p["content"]]}
    return {k: [x for p in parts for x in p[k]] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
