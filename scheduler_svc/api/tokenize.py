"""Tokenize and Detokenize: the served model's tokenizer as a service, with nothing generated.

The API server asked answers from its own tokenizer, with the encoding a Generate or Chat request
gets (``request.encode_prompt``: the same chat rendering, big inputs off the event loop), so the ids
Tokenize returns are the ids Generate would send to the core. Neither call reaches the core, and a
refusal is not counted among the core's rejected requests (it refuses no generation).

A model served without a tokenizer is INVALID_ARGUMENT, as it is for a Generate with a text prompt
and a Chat without a chat template: the client asked for what this model cannot give (and the HTTP
door maps both the same way); the server's state does not change, so FAILED_PRECONDITION's "retry
once the system is fixed" would not fit.
"""

from __future__ import annotations

import grpc

from pagewire_common.chat_template import ChatOptions
from scheduler_svc.api.request import ApiServer, RequestError, encode_prompt, served_model

NO_TOKENIZER = "this model has no tokenizer"


async def tokenize(api: ApiServer, *, prompt: str | None = None, messages: list[dict] | None = None,
                   chat_options: ChatOptions = ChatOptions(), model_name: str = "") -> tuple[str | None, list[int]]:
    """The ids of ``prompt``, or the chat template's rendering of ``messages`` (as Chat renders
    them with ``chat_options``) and its ids; exactly one of the two. ``RequestError`` says why not."""
    model = served_model(api, model_name)
    given = (prompt is not None) + (messages is not None)
    if given != 1:
        raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                           "give a prompt or messages (both are empty)" if not given
                           else "give either prompt or messages, not both")
    if model.offloaded is None:
        raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, NO_TOKENIZER)
    try:
        return await encode_prompt(model, prompt, messages, chat_options)
    except ValueError as e:  # no chat template, a bad message or template
        raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None


async def detokenize(api: ApiServer, token_ids: list[int], model_name: str = "") -> str:
    """The text of ``token_ids`` as the streams decode it (special tokens skipped); every id must be
    below the model's ``vocab_size``, the bound Generate checks prompt ids against."""
    model = served_model(api, model_name)
    if not token_ids:
        raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "token_ids is empty")
    if model.offloaded is None:
        raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, NO_TOKENIZER)
    vocab_size = model.info.vocab_size
    if max(token_ids) >= vocab_size:
        bad = next(t for t in token_ids if t >= vocab_size)
        raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"token id {bad} is outside the vocabulary (vocab_size {vocab_size})")
    return await model.offloaded.decode(token_ids)
