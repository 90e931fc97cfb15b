"""The OpenAI-compatible HTTP door of an API server (aiohttp, on the server's own event loop).

``POST /v1/completions`` and ``/v1/chat/completions`` (streamed as server-sent events or not),
``GET /v1/models``, ``GET /health``, ``POST /tokenize``, ``POST /detokenize`` and ``GET /metrics``.
Every request goes through ``check_request`` and ``submit_request``, as gRPC's do: one place says
what is valid, and a refusal carries a gRPC status that maps to the HTTP one (400, 429, 503...);
an unknown model is 404, as OpenAI answers. Streamed responses send their headers once the first tokens (or the refusal) are known, so a full queue is a 429,
not an error inside a 200 stream. A client that disconnects cancels its handler, which aborts its
requests in the core.

aiohttp was chosen by measurement: it spends about half the server CPU per streamed chunk of
Starlette on uvicorn (``benchmarks/http_sse_cost.py``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re
import sys
import uuid

from aiohttp import web

from pagewire_common.requests import TextDelta
from pagewire_common.sampling import check_text
from scheduler_svc.api import metrics as metrics_mod
from scheduler_svc.api.auth import check_authorization
from scheduler_svc.api.openai_protocol import (
    LogprobsBuilder,
    OpenAIError,
    ParsedRequest,
    bad,
    chat_options,
    merge_logprobs,
    parse,
    parse_messages,
    usage_dict,
)
from scheduler_svc.api.request import (
    ApiRequest,
    RequestError,
    check_request,
    check_together,
    encode_prompt,
    not_serving_reason,
    submit_request,
    wait_until_started,
)

log = logging.getLogger("pagewire.http")
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_DONE = b"data: [DONE]\n\n"
_CLOSE_AFTER = "pagewire.close_after"  # a request whose connection cannot be reused
# events of one stream encoded between two turns of the event loop at most (a backlog of deltas)
BACKLOG_CHUNKS = 64


def _dumps(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def error_response(err: OpenAIError) -> web.Response:
    return web.Response(status=err.status, body=_dumps(err.body()), content_type="application/json")


class OpenAIDoor:
    """The HTTP routes of one API server."""

    def __init__(self, api, api_key: str | None = None):
        self.api = api
        self.api_key = api_key

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=[self._errors, self._auth])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/metrics", self.metrics)
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        try:
            return await handler(request)
        except OpenAIError as e:
            response = error_response(e)
            if request.get(_CLOSE_AFTER):
                response.force_close()
            return response
        except web.HTTPException as e:  # unknown route, wrong method: the OpenAI error shape too
            if e.status < 400:
                raise
            return error_response(OpenAIError(e.status, e.reason, "invalid_request_error"))

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        # /health stays open, as gRPC health does: load balancers probe it without a key
        if request.path != "/health" and not check_authorization(request.headers.get("Authorization"), self.api_key):
            raise OpenAIError(401, "missing or wrong API key: send 'Authorization: Bearer KEY'",
                              "authentication_error", code="invalid_api_key")
        return await handler(request)

    # ---- small endpoints -----------------------------------------------------------------------

    def _model(self):
        model = self.api.model
        if model is None or not self.api.is_serving:
            raise OpenAIError(503, not_serving_reason(self.api), "service_unavailable_error")
        return model

    async def models(self, request: web.Request) -> web.Response:
        info = self._model().info
        return web.json_response({"object": "list", "data": [{
            "id": info.model_name, "object": "model", "created": 0, "owned_by": "pagewire",
            "root": info.model_name, "max_model_len": info.max_model_len}]})

    async def health(self, request: web.Request) -> web.Response:
        if self.api.draining:  # a load balancer sends no more: every new request would be refused
            raise OpenAIError(503, "the server is shutting down", "service_unavailable_error")
        if self.api.is_serving:
            return web.Response(status=200)
        self._model()  # raises the 503 that says which link is down
        return web.Response(status=503)

    def _named_model(self, body: dict):
        """The served model, when the body names none or names it; 404 as OpenAI answers otherwise."""
        model = self._model()
        name = body.get("model")
        if name is not None and not isinstance(name, str):
            raise bad(f"model must be a string, got {type(name).__name__}", "model")
        if name and name != model.info.model_name:
            raise OpenAIError(404, f"The model `{name}` does not exist; this server serves `{model.info.model_name}`.",
                              "not_found_error", "model", code="model_not_found")
        return model

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await _json_object(request)
        model = self._named_model(body)
        if "messages" in body and "prompt" in body:
            raise bad("give either prompt or messages, not both", "prompt")
        try:
            if "messages" in body:
                _, ids = await encode_prompt(model, None, parse_messages(body["messages"]), chat_options(body))
            elif isinstance(body.get("prompt"), str):
                _, ids = await encode_prompt(model, body["prompt"], None)
            else:
                raise bad("give prompt (a string) or messages", "prompt")
        except ValueError as e:
            raise bad(str(e)) from None
        return web.json_response({"tokens": ids, "count": len(ids), "max_model_len": model.info.max_model_len})

    async def detokenize(self, request: web.Request) -> web.Response:
        body = await _json_object(request)
        model = self._named_model(body)
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise bad("tokens must be a list of token ids", "tokens")
        vocab = model.info.vocab_size
        outside = next((t for t in ids if not 0 <= t < vocab), None)
        if outside is not None:
            raise bad(f"token id {outside} is outside the vocabulary [0, {vocab})", "tokens")
        if model.tokenizer is None:
            raise bad("this model has no tokenizer")
        return web.json_response({"prompt": model.tokenizer.decode(ids)})

    async def metrics(self, request: web.Request) -> web.Response:
        api = self.api
        try:
            per_core = await api.core_stats()
        except Exception as e:  # no core answers: serve the request figures anyway
            log.debug("metrics without the cores' figures: %s", e)
            per_core = None
        name = api.model.info.model_name if api.model is not None else None
        body = await asyncio.get_running_loop().run_in_executor(None, metrics_mod.exposition, api.metrics, per_core,
                                                                name)
        return web.Response(body=body, headers={"Content-Type": metrics_mod.CONTENT_TYPE})

    # ---- completions ---------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        api = self.api
        try:
            parsed = parse(await _json(request), chat=chat)
            try:
                await wait_until_started(api)  # a server restarted beside others: its core a moment later
            except RequestError as e:
                raise OpenAIError.from_grpc(e.code, e.message) from None
            self._named_model({"model": parsed.model})
        except OpenAIError:
            api.reject()
            raise
        reqs: list[ApiRequest] = []
        try:
            # every prompt is checked before any is submitted: a refused request never ran in part
            checked = [await check_request(api, sampling=parsed.sampling, sampling_error=parsed.sampling_error,
                                           model_name=parsed.model, fill_max_tokens=parsed.fill_max_tokens, **kw)
                       for kw in parsed.prompts]
            check_together(api, checked)
            for c in checked:
                reqs.append(submit_request(api, c))
            answer = _Answer(parsed, reqs, api.model)
            if parsed.stream:
                return await answer.stream(request)
            return await answer.whole()
        except RequestError as e:
            raise OpenAIError.from_grpc(e.code, e.message) from None
        finally:
            # aborts what did not finish (client gone, error); when the core refused one of the
            # prompts the request is refused whole, and the others it took are not finished ones
            refused = any(r.refused for r in reqs)
            for r in reqs:
                r.close(finishes=not refused)


async def _json(request: web.Request):
    """The request's body as JSON; 400 for a body that does not decompress (its Content-Encoding),
    is not UTF-8 JSON, holds an integer of more digits than Python converts, nests too deep for the
    parser, or holds a string that is not valid Unicode (a lone UTF-16 surrogate escape such as
    ``"\\ud83d"``, which no tokenizer or wire can carry)."""
    try:
        raw = await request.read()
    except web.RequestPayloadError as e:  # e.g. a Content-Encoding: gzip body that is not gzip
        # the rest of the body cannot be read either: the connection closes after the answer
        # (aiohttp would read on to reuse it, and log the same error with a traceback)
        request.content.feed_eof()
        request[_CLOSE_AFTER] = True
        cause = e.__cause__
        raise bad(f"the request body could not be read: {getattr(cause, 'message', None) or cause or e}") from None
    try:
        text = raw.decode("utf-8")
        body = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad(f"the request body is not valid JSON: {e}") from None
    except ValueError:  # Python's limit on the digits of an integer it converts
        raise bad(f"the request body holds an integer of more than {sys.get_int_max_str_digits():,} digits") from None
    except RecursionError:
        raise bad("the request body is not valid JSON: it nests too deeply") from None
    if _SURROGATE_ESCAPE.search(text):  # only such an escape makes one: raw UTF-8 cannot
        _check_strings(body)
    return body


async def _json_object(request: web.Request) -> dict:
    body = await _json(request)
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    return body


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _check_strings(body) -> None:
    """400 for the first string (or object key) of a parsed body that is not valid Unicode."""
    stack = [(body, "the request body")]
    while stack:
        value, where = stack.pop()
        if isinstance(value, str):
            try:
                check_text(where, value)
            except ValueError as e:
                raise bad(str(e)) from None
        elif isinstance(value, dict):
            for key, item in value.items():
                stack.append((key, f"a key of {where}"))
                stack.append((item, f"{where}.{key}" if where != "the request body" else key))
        elif isinstance(value, list):
            stack.extend((item, f"{where}[{i}]") for i, item in enumerate(value))


class _Answer:
    """The response to one completions request: its choices are its prompts' samples."""

    def __init__(self, parsed: ParsedRequest, reqs: list[ApiRequest], model):
        self.parsed = parsed
        self.reqs = reqs
        self.model_name = model.info.model_name
        self.tokenizer = model.tokenizer
        self.id = ("chatcmpl-" if parsed.chat else "cmpl-") + uuid.uuid4().hex
        self.object = "chat.completion" if parsed.chat else "text_completion"
        self.logprobs: dict[int, LogprobsBuilder] = {}
        self.usage = [0, 0, 0]
        self._echoed: set[int] = set()  # choices whose prompt went out (echo)

    def _index(self, i: int, out: TextDelta) -> int:
        return i * self.parsed.n + out.index

    def _count(self, out: TextDelta) -> None:
        if out.usage is not None:
            u = out.usage
            self.usage[1] += u.completion_tokens
            if not out.index:  # the samples of one prompt share it
                self.usage[0] += u.prompt_tokens
                self.usage[2] += u.cached_prompt_tokens

    def _echo(self, i: int, out: TextDelta) -> tuple[TextDelta | None, TextDelta]:
        """With echo: (prompt i as a delta of its own, before the choice's first, else None; ``out``
        as the answer shows it: with max_tokens 0, nothing of the one token computed but its end).
        The prompt delta has its text and token ids, and with logprobs the prompt's (the first
        token has none), which come with the request's first delta."""
        if not self.parsed.echo:
            return None, out
        prefix = None
        index = self._index(i, out)
        if index not in self._echoed:
            self._echoed.add(index)
            ids = self.reqs[i].prompt_token_ids
            text = self.parsed.prompts[i].get("prompt")
            if text is None:  # prompt ids: their text with special tokens, as the logprobs name them (vLLM too)
                text = self.tokenizer.decode(ids, skip_special_tokens=False) if self.tokenizer is not None else ""
            lps = tops = None
            if self.parsed.num_top_logprobs is not None:
                computed = out.prompt_logprobs
                lps = [None, *(computed.logprobs.tolist() if computed is not None else [float("nan")] * (len(ids) - 1))]
                if self.parsed.num_top_logprobs and computed is not None:
                    tops = [None, *computed.top_lists()]
            prefix = TextDelta(out.request_id, list(ids), text, None, lps, top_logprobs=tops, index=out.index)
        if self.parsed.echo_only:
            usage = out.usage
            out = dataclasses.replace(out, token_ids=[], text="", logprobs=[] if out.logprobs is not None else None,
                                      top_logprobs=None,
                                      usage=dataclasses.replace(usage, completion_tokens=0) if usage else None)
        return prefix, out

    def _lp(self, index: int, out: TextDelta) -> dict | None:
        if self.parsed.num_top_logprobs is None:
            return None
        builder = self.logprobs.get(index)
        if builder is None:
            builder = self.logprobs[index] = LogprobsBuilder(self.parsed.chat, self.tokenizer)
        return builder.part(out)

    async def _merged(self):
        """(request index, deltas) as they come, from every prompt's request."""
        if len(self.reqs) == 1:
            async for items in self.reqs[0]:
                yield 0, items
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, req: ApiRequest):
            try:
                async for items in req:
                    await queue.put((i, items))
                await queue.put((i, None))
            except RequestError as e:
                await queue.put((i, e))

        tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(self.reqs)]
        try:
            left = len(tasks)
            while left:
                i, items = await queue.get()
                if items is None:
                    left -= 1
                elif isinstance(items, RequestError):
                    raise items
                else:
                    yield i, items
        finally:
            for t in tasks:
                t.cancel()

    async def whole(self) -> web.Response:
        texts: dict[int, list[str]] = {}
        ids: dict[int, list[int]] = {}
        lps: dict[int, list[dict]] = {}
        reasons: dict[int, str] = {}
        async for i, items in self._merged():
            for out in items:
                index = self._index(i, out)
                prefix, out = self._echo(i, out)
                if prefix is not None:
                    texts.setdefault(index, []).append(prefix.text)
                    lp = self._lp(index, prefix)
                    if lp is not None:
                        lps.setdefault(index, []).append(lp)
                texts.setdefault(index, []).append(out.text)
                ids.setdefault(index, []).extend(out.token_ids)
                lp = self._lp(index, out)
                if lp is not None:
                    lps.setdefault(index, []).append(lp)
                if out.finish_reason is not None:
                    reasons[index] = out.finish_reason.value
                self._count(out)
        choices = []
        for index in sorted(texts):
            text = "".join(texts[index])
            lp = merge_logprobs(lps[index], self.parsed.chat) if index in lps else None
            if self.parsed.chat:
                choices.append({"index": index, "message": {"role": "assistant", "content": text},
                                "logprobs": lp, "finish_reason": reasons.get(index)})
            else:
                choices.append({"index": index, "text": text, "logprobs": lp, "finish_reason": reasons.get(index)})
            if self.parsed.return_token_ids:
                choices[-1]["token_ids"] = ids[index]
        body = {"id": self.id, "object": self.object, "created": self.parsed.created, "model": self.model_name,
                "choices": choices, "usage": usage_dict(*self.usage)}
        return web.Response(body=_dumps(body), content_type="application/json")

    async def stream(self, request: web.Request) -> web.StreamResponse:
        chat = self.parsed.chat
        obj = "chat.completion.chunk" if chat else "text_completion"
        head = {"id": self.id, "object": obj, "created": self.parsed.created, "model": self.model_name}
        if self.parsed.include_usage:
            head["usage"] = None
        gen = self._merged()
        first = await anext(gen, None)  # a refusal before any token is an HTTP status, not a stream
        resp = web.StreamResponse(headers=_SSE_HEADERS)
        await resp.prepare(request)
        try:
            await self._stream_events(resp, gen, first, head, chat)
        except ConnectionResetError:
            # the client went away between two writes (its requests end in _generate); aiohttp
            # would log an error with a traceback for every such stream
            log.debug("client left the stream %s", self.id)
        return resp

    async def _stream_events(self, resp: web.StreamResponse, gen, first, head: dict, chat: bool) -> None:
        started: set[int] = set()
        try:
            pending = [first] if first is not None else []
            while True:
                for i, items in pending:
                    chunks = []
                    for out in items:
                        index = self._index(i, out)
                        prefix, out = self._echo(i, out)
                        if prefix is not None:  # completions: the prompt, before the choice's first text
                            chunks.append(self._chunk(head, {"index": index, "text": prefix.text,
                                                             "logprobs": self._lp(index, prefix), "finish_reason": None}))
                        if chat and index not in started:
                            started.add(index)
                            chunks.append(self._chunk(head, {"index": index, "delta": {"role": "assistant", "content": ""},
                                                             "logprobs": None, "finish_reason": None}))
                        reason = out.finish_reason.value if out.finish_reason is not None else None
                        lp = self._lp(index, out)
                        if chat:
                            choice = {"index": index, "delta": {"content": out.text} if out.text or not reason else {},
                                      "logprobs": lp, "finish_reason": reason}
                        else:
                            choice = {"index": index, "text": out.text, "logprobs": lp, "finish_reason": reason}
                        if self.parsed.return_token_ids:
                            choice["token_ids"] = out.token_ids
                        chunks.append(self._chunk(head, choice))
                        self._count(out)
                        if len(chunks) >= BACKLOG_CHUNKS:
                            # the deltas of a client that read slowly piled up: the other streams
                            # get turns in between, not after all of them are encoded
                            await resp.write(b"".join(chunks))
                            chunks = []
                            await asyncio.sleep(0)
                    await resp.write(b"".join(chunks))
                nxt = await anext(gen, None)
                if nxt is None:
                    break
                pending = [nxt]
            if self.parsed.include_usage:
                await resp.write(self._chunk({**head, "usage": usage_dict(*self.usage)}, None))
        except RequestError as e:  # failed after the headers went out: an error event ends the stream
            await resp.write(b"data: " + _dumps(OpenAIError.from_grpc(e.code, e.message).body()) + b"\n\n")
        await resp.write(_DONE)
        await resp.write_eof()

    @staticmethod
    def _chunk(head: dict, choice: dict | None) -> bytes:
        body = dict(head)
        body["choices"] = [] if choice is None else [choice]
        return b"data: " + _dumps(body) + b"\n\n"


class _UnreadableRequests(logging.Filter):
    """aiohttp logs a request it cannot parse (a gRPC client pointed at the HTTP port, a TLS hello
    on a plaintext port, a malformed HTTP/1 request) as an error with its parser's traceback; one
    warning line says it, and which it looks like."""

    def filter(self, record: logging.LogRecord) -> bool:
        from aiohttp.http_exceptions import HttpProcessingError

        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, HttpProcessingError):
            reason = error.message.splitlines()[0] if error.message else ""
            if "PRI" in reason:  # HTTP/2's preface
                kind = "an HTTP/2 client, gRPC?, on the HTTP/1 port"
            elif "Invalid method" in reason:
                kind = "not HTTP: a TLS client on a plaintext port?"
            else:
                kind = "a malformed HTTP request"
            record.msg, record.args = "%s (%s): %s %s", (record.getMessage(), kind, error.code, reason)
            record.exc_info = record.exc_text = None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


async def start_http(api, listen: str, reuse_port: bool, *, api_key: str | None = None,
                     ssl_context=None) -> tuple[web.AppRunner, int]:
    """Serve the OpenAI door on ``listen`` (host:port); returns the runner and the bound port. With
    ``api_key`` every route but ``/health`` needs ``Authorization: Bearer KEY`` (401 otherwise);
    with ``ssl_context`` the address speaks HTTPS only."""
    host, _, port = listen.rpartition(":")
    server_log = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, _UnreadableRequests) for f in server_log.filters):
        server_log.addFilter(_UnreadableRequests())
    runner = web.AppRunner(OpenAIDoor(api, api_key).app(), access_log=None, handler_cancellation=True,
                           shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, host.strip("[]") or "0.0.0.0", int(port), reuse_port=reuse_port or None,
                       ssl_context=ssl_context)
    try:
        await site.start()
    except OSError as e:
        await runner.cleanup()
        raise OSError(f"cannot listen on {listen} (HTTP): {e.strerror}") from None
    return runner, runner.addresses[0][1]
