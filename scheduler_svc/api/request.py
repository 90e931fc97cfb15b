"""One request through an API server, whichever door it came in by (gRPC or OpenAI HTTP).

``open_request`` is the one place that says what a valid request is: the server is up, the model
name matches, the prompt tokenizes (off the event loop) and fits the model, the sampling
parameters are in range (``check_request``). It then hands the request to the core
(``submit_request``). ``ApiRequest`` yields the
request's deltas as the core's steps produce them and aborts it in the core when its reader
leaves before the end. A refusal or a failure is a ``RequestError`` carrying a gRPC status; the
HTTP door maps that status to its own.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Protocol

import grpc

from pagewire_common.chat_template import ChatOptions
from pagewire_common.eventloop import Outbox
from pagewire_common.requests import TextDelta, check_request_id, check_without_tokenizer, validate_prompt_tokens
from pagewire_common.sampling import SamplingParams

# how long after its start an API server that has not reached its core yet holds a request for it
STARTING_WAIT_S = 10.0
# with several cores, a request that meets these before it produced anything goes to another core
PASSED_ON = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE)


class ApiServer(Protocol):
    """What a request needs of the API server it came in by (``api.server.ApiServer``)."""

    draining: bool  # shutting down: refuse new requests
    model: Any  # the served model (limits, tokenizer), None until a core reported it
    connected: asyncio.Event  # some core's link and that core's link to its worker are up
    was_connected: bool  # connected at least once since the process started
    started_at: float  # time.monotonic() at its start
    core_connected: bool
    metrics: Any  # RequestMetrics, or None

    num_cores: int

    def route(self, token_ids: list[int], n: int, exclude: set[int] | frozenset[int] = frozenset()) -> "CoreLink": ...

    def reroute(self, request: "ApiRequest", failure: "Failure") -> "CoreLink | None": ...

    def reject(self) -> None: ...


class CoreLink(Protocol):
    """What a request needs of the engine core it runs on (``api.core_link.CoreLink``)."""

    metrics: Any  # RequestMetrics, or None
    server: ApiServer
    index: int  # the core's place among the API server's cores

    def submit(self, name: str, token_ids: list[int], sampling: SamplingParams, outbox: Outbox,
               request: "ApiRequest") -> int: ...

    def reject(self) -> None: ...

    def abort(self, request_id: int) -> None: ...

    def note_undelivered(self, outbox: "StreamOutbox") -> None: ...

    def delivered(self, outbox: "StreamOutbox") -> None: ...


@dataclass(slots=True)
class Failure:
    """Put on a request's outbox when the core refused or lost it."""

    code: grpc.StatusCode
    message: str


class NotReadyError(RuntimeError):
    pass


class StreamOutbox(Outbox):
    """A request's outbox that tells its API server when what was put on it has been taken by the
    request's handler (which then writes it to the client). The server acknowledges the core's
    messages once every stream has taken its part: the core runs at the pace this server streams.

    A stream whose client reads slowly (its handler waits on a full socket) must not set that pace
    for everyone: one that leaves its part untaken for ``LAGGING_STREAM_S`` is let go (``lag``),
    its parts pile up here while the others are acknowledged, and it counts again once its handler
    has taken everything and waits for more."""

    __slots__ = ("_api", "_counted", "_lagging")

    def __init__(self, api: CoreLink):
        super().__init__()
        self._api = api
        self._counted = False
        self._lagging = False

    def put_nowait(self, item) -> None:
        if not self._counted and not self._lagging:
            self._counted = True
            self._api.note_undelivered(self)
        super().put_nowait(item)

    async def take(self) -> list:
        if self._lagging and not self._items:
            self._lagging = False  # caught up with the core: it sets the pace again
        items = await super().take()
        self.release()
        return items

    def release(self) -> None:
        """Nothing on it is waiting any more (taken, or its handler is gone)."""
        if self._counted:
            self._counted = False
            self._api.delivered(self)

    def lag(self) -> None:
        """Its part has waited too long: the server stops waiting for it (the caller forgets it)."""
        self._counted = False
        self._lagging = True


class RequestError(Exception):
    """A request refused before it reached the core, or failed in it (``code`` is its gRPC status)."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


class ApiRequest:
    """A request handed to the core: iterate it for its deltas (lists of ``TextDelta``, the
    ones that piled up while the reader was busy); ``close`` it when done (an unfinished request
    is aborted, its blocks freed within a step)."""

    __slots__ = ("api", "id", "request_id", "prompt_token_ids", "sampling", "outbox", "finished",
                 "arrival", "first_token_at", "last_token_at", "num_output_tokens", "num_unfinished", "was_started",
                 "refused", "tried_cores")

    def __init__(self, api: CoreLink, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams):
        self.api = api  # the core it runs on
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling = sampling
        self.outbox = StreamOutbox(api)
        self.finished = False
        self.arrival = time.monotonic()
        self.first_token_at = self.last_token_at = None
        self.num_output_tokens = 0
        self.num_unfinished = sampling.n  # samples still running (n > 1: each finishes on its own)
        self.was_started = False
        self.refused = False  # the core refused it before it started (no room, a full queue, ...)
        self.tried_cores: set[int] = set()  # cores that refused or lost it before it started
        self.id = api.submit(request_id, prompt_token_ids, sampling, self.outbox, self)  # the core's id

    async def __aiter__(self) -> AsyncIterator[list[TextDelta]]:
        while not self.finished:
            items = await self.outbox.take()
            last = items[-1]
            if isinstance(last, Failure):  # always the last item: nothing follows it
                deltas = items[:-1]
                if deltas:  # what came before the failure goes out first
                    self._observe(deltas)
                    self.num_unfinished -= sum(it.finished for it in deltas)
                    self.finished = self.num_unfinished == 0
                    yield deltas
                    if self.finished:
                        return
                elif not self.was_started and self._reroute(last):
                    continue  # nothing of it reached the client: another core takes it
                if last.code == grpc.StatusCode.CANCELLED:  # the public Abort: an abort, as a client's own cancel
                    self._end_unfinished("abort")
                elif self.was_started:  # failed after the core took it on (a lost worker or core)
                    self._end_unfinished("error")
                else:  # refused before it started (no room, a full queue, a duplicate id): not a finished request
                    self.finished = self.refused = True
                    server = getattr(self.api, "server", None)
                    if last.code in PASSED_ON and server is not None and server.num_cores > 1:
                        self.api.reject()  # the cores that refused or lost it left it to be counted here, once
                raise RequestError(last.code, last.message)
            self._observe(items)
            self.num_unfinished -= sum(it.finished for it in items)
            self.finished = self.num_unfinished == 0
            yield items

    def _reroute(self, failure: Failure) -> bool:
        """Submit the request to another core after its core refused it for want of room or was
        lost before it produced anything (``ApiServer.reroute`` says whether and where)."""
        server = getattr(self.api, "server", None)
        other = server.reroute(self, failure) if server is not None else None
        if other is None:
            return False
        self.outbox.release()
        self.api = other
        self.outbox = StreamOutbox(other)
        try:
            self.id = other.submit(self.request_id, self.prompt_token_ids, self.sampling, self.outbox, self)
        except (NotReadyError, ValueError):
            return False
        return True

    def started(self) -> None:
        """The core scheduled the request for the first time: its time in the queue ends."""
        if self.was_started:  # the other samples of n > 1 start later, from the same prompt
            return
        self.was_started = True
        if self.api.metrics is not None:
            self.api.metrics.queue_time(time.monotonic() - self.arrival, len(self.prompt_token_ids))

    def _observe(self, items: list[TextDelta]) -> None:
        now = time.monotonic()
        n = sum(len(it.token_ids) for it in items)
        metrics = self.api.metrics
        if n:
            if metrics is not None:
                if self.first_token_at is None:
                    metrics.first_token(now - self.arrival)
                metrics.tokens(n, None if self.last_token_at is None else now - self.last_token_at)
            if self.first_token_at is None:
                self.first_token_at = now
            self.last_token_at = now
            self.num_output_tokens += n
        if metrics is not None:
            for it in items:  # each sample counts as it finishes
                if it.finished:
                    metrics.finished(it.finish_reason.value, now - self.arrival)

    def close(self, finishes: bool = True) -> None:
        """Let go of the request; one not finished (cancelled, deadline passed, the client went
        away) is aborted, and counts as a finished request unless ``finishes`` is False: the
        prompts of a request refused whole, whose other prompt the core refused."""
        self.outbox.release()
        if not self.finished:
            for index in range(self.sampling.n):
                self.api.abort(self.id + index)
            if finishes:
                self._end_unfinished("abort")
            else:
                self.finished = True
                self.num_unfinished = 0

    def _end_unfinished(self, reason: str) -> None:
        """The samples still running end for ``reason``; each counts in the metrics, as each sample
        that finishes does."""
        self.finished = True
        if self.api.metrics is not None:
            seconds = time.monotonic() - self.arrival
            for _ in range(self.num_unfinished):
                self.api.metrics.finished(reason, seconds)
        self.num_unfinished = 0


@dataclass(slots=True)
class CheckedRequest:
    """A request that passed every check of ``check_request``, ready for ``submit_request``."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams


async def open_request(api: ApiServer, *, request_id: str = "", sampling: SamplingParams | None = None,
                       sampling_error: str | None = None, prompt: str | None = None,
                       prompt_token_ids: list[int] | None = None, messages: list[dict] | None = None,
                       chat_options: ChatOptions = ChatOptions(), model_name: str = "",
                       fill_max_tokens: bool = False) -> ApiRequest:
    """Validate, tokenize and submit one request (``check_request``, then ``submit_request``)."""
    checked = await check_request(api, request_id=request_id, sampling=sampling, sampling_error=sampling_error,
                                  prompt=prompt, prompt_token_ids=prompt_token_ids, messages=messages,
                                  chat_options=chat_options, model_name=model_name, fill_max_tokens=fill_max_tokens)
    return submit_request(api, checked)


async def check_request(api: ApiServer, *, request_id: str = "", sampling: SamplingParams | None = None,
                        sampling_error: str | None = None, prompt: str | None = None,
                        prompt_token_ids: list[int] | None = None, messages: list[dict] | None = None,
                        chat_options: ChatOptions = ChatOptions(), model_name: str = "",
                        fill_max_tokens: bool = False) -> CheckedRequest:
    """Validate and tokenize one request; ``RequestError`` says why it was refused (each refusal
    is counted in the core's stats). A door that could not build the sampling parameters passes
    the reason as ``sampling_error``, so checks run in the same order for every door.
    ``fill_max_tokens``: generate up to the model length (``sampling.max_tokens`` is replaced by
    what the prompt leaves). A request of several prompts checks them all before it submits one.
    ``chat_options``: how ``messages`` are rendered."""
    try:
        return await _check(api, request_id, sampling, sampling_error, prompt, prompt_token_ids, messages,
                            chat_options, model_name, fill_max_tokens)
    except RequestError:
        api.reject()
        raise


def check_together(api: ApiServer, checked: list[CheckedRequest]) -> None:
    """The prompts of one request (the OpenAI door's list of prompts), each checked alone, checked
    together: without a queue (``--max-queued-requests 0``) a request is taken only when it can
    start at once, so prompts whose samples are more than ``max_num_seqs`` would be refused for
    ever (RESOURCE_EXHAUSTED, "retry later"); they are INVALID_ARGUMENT instead."""
    info = api.model.info if api.model is not None else None
    if len(checked) < 2 or info is None or not info.HasField("max_queued_requests") or info.max_queued_requests:
        return
    total = sum(c.sampling.n for c in checked)
    if total > info.max_num_seqs:
        api.reject()
        raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"the request's {len(checked)} prompts make {total} sequences, more than max_num_seqs "
                           f"({info.max_num_seqs}) runs at once, and the server has no queue (max_queued_requests 0): "
                           "send fewer prompts per request")


def submit_request(api: ApiServer, checked: CheckedRequest) -> ApiRequest:
    """Hand a checked request to the core its prompt is routed to."""
    try:
        return ApiRequest(api.route(checked.prompt_token_ids, checked.sampling.n), checked.request_id,
                          checked.prompt_token_ids, checked.sampling)
    except NotReadyError as e:
        api.reject()
        raise RequestError(grpc.StatusCode.UNAVAILABLE, str(e)) from None
    except ValueError as e:  # a value the checks let through but the core's message cannot carry
        api.reject()
        raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"the request cannot be sent to the engine core: {e}") from None


async def _check(api, request_id, sampling, sampling_error, prompt, ids, messages, chat_options, model_name,
                 fill_max_tokens) -> CheckedRequest:
    await wait_until_started(api)
    model = served_model(api, model_name)
    info = model.info
    given = sum(x is not None for x in (prompt, ids, messages))
    if given != 1:
        raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                           "give a prompt or prompt_token_ids (both are empty)" if not given
                           else "give either prompt or prompt_token_ids, not both")
    try:
        check_request_id(request_id)
        if sampling_error is not None:
            raise ValueError(sampling_error)
        if model.tokenizer is None:
            check_without_tokenizer(sampling)
        if ids is None:
            _, ids = await encode_prompt(model, prompt, messages, chat_options)
            if not ids:
                raise ValueError("prompt encodes to no tokens")
        if fill_max_tokens:
            sampling = dataclasses.replace(sampling, max_tokens=max(1, info.max_model_len - len(ids)))
        validate_prompt_tokens(ids, sampling, vocab_size=info.vocab_size, max_model_len=info.max_model_len,
                               strict_length=True, max_num_seqs=info.max_num_seqs)
    except ValueError as e:
        raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
    return CheckedRequest(request_id or uuid.uuid4().hex, list(ids), sampling)


async def wait_until_started(api: ApiServer) -> None:
    """An API server restarted beside others on one port takes clients at once (SO_REUSEPORT) and
    reaches its core a moment later: a request that comes meanwhile waits for that (up to
    ``STARTING_WAIT_S`` from the server's start) rather than being refused. ``RequestError`` once
    the server is shutting down, before or during the wait."""
    while not api.was_connected and not api.draining:
        left = STARTING_WAIT_S - (time.monotonic() - api.started_at)
        if left <= 0:
            break
        try:  # a short wait at a time: a drain ends it too
            await asyncio.wait_for(api.connected.wait(), min(left, 0.05))
        except asyncio.TimeoutError:
            pass
    if api.draining:
        raise RequestError(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")


def not_serving_reason(api: ApiServer) -> str:
    """Why the API server takes no requests now (its UNAVAILABLE or 503 message)."""
    if not api.was_connected:
        return ("this API server is starting: its engine core is up, its worker not yet" if api.core_connected
                else "this API server is starting: its engine core is not reachable yet")
    return "the worker is not connected" if api.core_connected else "the scheduler core is not connected"


def served_model(api: ApiServer, model_name: str = ""):
    """The served model (``ServedModel``) once the core and the worker are up, checked against the
    name a client gave; ``RequestError`` (UNAVAILABLE, INVALID_ARGUMENT) otherwise."""
    model = api.model
    if model is None or not api.connected.is_set():
        raise RequestError(grpc.StatusCode.UNAVAILABLE, not_serving_reason(api))
    if model_name and model_name != model.info.model_name:
        raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"unknown model {model_name!r}; this server serves {model.info.model_name!r}")
    return model


async def encode_prompt(model, prompt: str | None, messages: list[dict] | None,
                        chat_options: ChatOptions = ChatOptions()) -> tuple[str | None, list[int]]:
    """A prompt's token ids, or chat messages' rendering and its ids, off the event loop when big
    (``OffloadedTokenizer``); ``ValueError`` for no tokenizer, no messages or a bad template. The
    one encoding of text for Generate, Chat, Tokenize and the HTTP door."""
    if model.offloaded is None:
        raise ValueError("this model has no tokenizer; send prompt_token_ids")
    if messages is not None:
        if not messages:
            raise ValueError("messages is empty")
        return await model.offloaded.encode_chat(messages, chat_options)
    return None, await model.offloaded.encode(prompt)
