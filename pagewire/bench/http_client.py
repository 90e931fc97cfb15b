"""The bench's client of the OpenAI HTTP door: the same requests as the gRPC client, sent as
streamed ``POST /v1/completions`` (server-sent events), one connection per stream as HTTP/1.1
needs (the kernel spreads the connections over the API servers, as it does gRPC's).

Each chunk of a pagewire server carries its token ids (``return_token_ids``), so token arrivals are
counted exactly as over gRPC, and the last chunk the usage (``stream_options.include_usage``).
llama.cpp's llama-server sends no ids; asked for ``timings_per_token`` (``extra_body``), each of its
chunks carries the running count of generated tokens instead, which counts them as exactly (a
chunk may carry no text, for a special token, or two tokens, when the first ended inside a UTF-8
character). Other servers count one token per chunk with text (``chunk_tokens``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from time import perf_counter

from pagewire.bench.loadgen import LoadResult, ServerUnreachable, drive
from pagewire.bench.metrics import RequestRecord
from pagewire.client import ServerAccess
from pagewire_common.v1 import generation_pb2 as pb

_STATUS_NAMES = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 429: "RESOURCE_EXHAUSTED",
                 503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED"}


def completion_body(req: pb.GenerateRequest, model: str) -> dict:
    """A gRPC ``GenerateRequest`` as the equivalent OpenAI completions body."""
    s = req.sampling
    body = {"model": model, "prompt": req.prompt if req.prompt else list(req.prompt_token_ids),
            "max_tokens": s.max_tokens or 16, "temperature": s.temperature, "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True}
    if s.HasField("top_p"):
        body["top_p"] = s.top_p
    if s.top_k:
        body["top_k"] = s.top_k
    if s.HasField("seed"):
        body["seed"] = s.seed
    if s.ignore_eos:
        body["ignore_eos"] = True
    if s.stop:
        body["stop"] = list(s.stop)
    for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
        if getattr(s, name):
            body[name] = getattr(s, name)
    if s.logit_bias:
        body["logit_bias"] = {str(t): b for t, b in s.logit_bias.items()}
    if s.json_schema:
        body["guided_json"] = s.json_schema
    if s.regex:
        body["guided_regex"] = s.regex
    return body


def chunk_tokens(chunk: dict, num_before: int) -> int:
    """How many tokens one streamed chunk delivered to a request that had ``num_before``: its token
    ids (pagewire), else the growth of llama.cpp's running count (``timings.predicted_n``), else one
    if it has text (servers that stream a token per chunk; a closing chunk has none)."""
    choice = chunk["choices"][0]
    ids = choice.get("token_ids")
    if ids is not None:
        return len(ids)
    predicted = (chunk.get("timings") or {}).get("predicted_n")
    if predicted is not None:
        return predicted - num_before
    return 1 if choice.get("text") else 0


class HttpClient:
    """An asyncio client of one OpenAI-compatible completions server at ``base_url`` (http://HOST:PORT):
    a pagewire server's OpenAI door, or another server on the same requests (llama-server)."""

    def __init__(self, base_url: str, extra_body: dict | None = None, keep_alive: bool = True,
                 access: ServerAccess = ServerAccess()):
        """``extra_body``: fields added to every request's JSON body (a server's own options).
        ``keep_alive=False``: a new connection for every request, closed after its response.
        ``access``: the API key to send and the TLS to trust (an https:// ``base_url``)."""
        self.base_url = base_url.rstrip("/")
        self.extra_body = dict(extra_body or {})
        self.keep_alive = keep_alive
        self.access = access
        self._session = None

    async def _open(self):
        import aiohttp

        if self._session is None:
            # no pooling limit: each concurrent stream needs a connection of its own
            ssl_context = self.access.ssl_context()
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, force_close=not self.keep_alive,
                                               ssl=ssl_context if ssl_context is not None else True),
                timeout=aiohttp.ClientTimeout(total=None), headers=self.access.http_headers())
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def wait_ready(self, timeout: float) -> str:
        """Wait until ``/health`` answers 200; return the served model's name."""
        import aiohttp

        session = await self._open()
        deadline = perf_counter() + timeout
        last = ""
        while perf_counter() < deadline:
            try:
                async with session.get(self.base_url + "/health") as r:
                    if r.status == 200:
                        async with session.get(self.base_url + "/v1/models") as m:
                            return (await m.json())["data"][0]["id"]
                    last = f"HTTP {r.status}"
            except aiohttp.ClientError as e:
                last = str(e)
            await asyncio.sleep(0.2)
        raise ServerUnreachable(f"the OpenAI door at {self.base_url} is not ready after {timeout:g}s ({last}); a "
                                "server the bench did not start serves it where its --http-listen says: give the "
                                "bench the same --http-listen")

    async def run(self, requests: Sequence[pb.GenerateRequest], *, model: str, concurrency: int | None = None,
                  arrival_offsets: Sequence[float] | None = None, request_timeout: float | None = None,
                  progress=None) -> LoadResult:
        """As the gRPC client's ``run``: one record per request, in order, and the wall time."""
        import aiohttp

        if (concurrency is None) == (arrival_offsets is None):
            raise ValueError("give exactly one of concurrency and arrival_offsets")
        session = await self._open()
        url = self.base_url + "/v1/completions"
        bodies = [json.dumps(completion_body(r, model) | self.extra_body).encode() for r in requests]
        records = [RequestRecord() for _ in requests]
        update = progress.update if progress is not None else (lambda k: None)
        timeout = aiohttp.ClientTimeout(total=request_timeout)
        headers = {"Content-Type": "application/json"}

        async def one(i: int) -> None:
            rec = records[i]
            times, counts = rec.arrival_times, rec.arrival_counts
            received = 0
            rec.send_time = perf_counter()
            try:
                async with session.post(url, data=bodies[i], headers=headers, timeout=timeout) as resp:
                    if resp.status != 200:
                        rec.error = _STATUS_NAMES.get(resp.status, f"HTTP_{resp.status}")
                        rec.error_message = (await resp.text())[:500]
                    else:
                        async for line in resp.content:
                            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                                continue
                            now = perf_counter()
                            chunk = json.loads(line[6:])
                            if "error" in chunk:
                                rec.error = chunk["error"].get("code") or "ERROR"
                                rec.error_message = chunk["error"].get("message", "")
                                break
                            if chunk["choices"]:
                                times.append(now)
                                k = chunk_tokens(chunk, received)
                                counts.append(k)
                                received += k
                            if chunk.get("usage"):
                                u = chunk["usage"]
                                rec.prompt_tokens = u["prompt_tokens"]
                                rec.completion_tokens = u["completion_tokens"]
                                rec.cached_prompt_tokens = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                rec.error, rec.error_message = type(e).__name__, str(e)
            rec.end_time = perf_counter()
            update(1)

        duration, cpu = await drive(len(requests), one, concurrency=concurrency, arrival_offsets=arrival_offsets)
        return LoadResult(records, duration, cpu)
