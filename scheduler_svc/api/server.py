"""An API server: the public ``pagewire.v1.Generation`` service in front of the scheduler core.

Several API-server processes can listen on one address (SO_REUSEPORT: the kernel spreads the
connections). Each validates requests, tokenizes prompts and renders chat templates without
stalling its event loop (``OffloadedTokenizer``), sends them to the core over one ``Connect``
session (its frame link carries the messages both ways), and turns the core's per-step token
arrays into each client's stream: incremental text, stop strings (a stop ends the request in the
core), ``--stream-interval``. ``GetStats`` and ``GetModelInfo`` answer from the core's figures.
Health is SERVING only while the link to the core and the core's link to the worker are both up.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pagewire_common import step_profile, wire
from pagewire_common.addresses import add_port
from pagewire_common.core_messages import CoreOutputs, CoreRequests, NewRequest, first_request_id
from pagewire_common.eventloop import Outbox
from pagewire_common.framelink import CHANNEL_OPTIONS, LinkClosed, LinkSession
from pagewire_common.requests import FinishReason, TextDelta
from pagewire_common.settings import default_of
from pagewire_common.tls import TlsFiles
from pagewire_common.v1 import core_pb2, core_pb2_grpc, generation_pb2_grpc
from pagewire_common.v1 import generation_pb2 as pb
from scheduler_svc.api.auth import ApiKeyInterceptor
from scheduler_svc.api.request import (
    ApiRequest,
    Failure,
    NotReadyError,
    RequestError,
    open_request,
)
from scheduler_svc.api.kv_events import KVEventHub
from scheduler_svc.api.text_stream import OutputProcessor
from scheduler_svc.api.tokenize import detokenize, tokenize
from scheduler_svc.api.tokenizer import OffloadedTokenizer, Tokenizer

log = logging.getLogger("pagewire.api")

SERVICE_NAME = "pagewire.v1.Generation"
_FINISH = {None: pb.UNSPECIFIED, FinishReason.STOP: pb.STOP, FinishReason.LENGTH: pb.LENGTH}
_CODES = {code.value[0]: code for code in grpc.StatusCode}


@dataclass(frozen=True, slots=True)
class ServedModel:
    """What the core reported: the limits requests are validated against, and the tokenizer."""

    info: core_pb2.CoreInfoResponse
    tokenizer: Tokenizer | None
    offloaded: OffloadedTokenizer | None


class _Pending:
    """A request (sample) in flight: where its deltas go, and the request they belong to."""

    __slots__ = ("outbox", "request", "n")

    def __init__(self, outbox: Outbox, request: ApiRequest | None, n: int):
        self.outbox = outbox
        self.request = request
        self.n = n  # the request's number of samples


class ApiServer:
    """The state of one API-server process: its link to the core and its requests in flight."""

    def __init__(self, core_address: str, stream_interval: int = default_of("stream_interval"), on_health=None,
                 metrics=None):
        self.core_address = core_address
        self.metrics = metrics  # RequestMetrics, or None
        self.stream_interval = stream_interval
        self._on_health = on_health or (lambda serving: None)
        self._channel = grpc.aio.insecure_channel(core_address, options=CHANNEL_OPTIONS)
        self._stub = core_pb2_grpc.SchedulerCoreStub(self._channel)
        self._session: LinkSession | None = None
        # request ids: this server's id from the core (in the high half), then a counter
        self._request_ids = itertools.count(first_request_id(0))
        self.pending: dict[int, _Pending] = {}  # request id (one per sample) -> where its deltas go
        self.output = OutputProcessor(None, stream_interval)  # their text streams
        self.model: ServedModel | None = None
        self.core_connected = False
        self.worker_connected = False
        self.worker_generation = 0
        self.connected = asyncio.Event()  # core link up, worker up, model known
        self._out = CoreRequests()  # queued for the core until the next turn of the loop
        # the public Abort: what each name sent to the core waits on (the core replies in order)
        self._abort_waiters: dict[str, list[asyncio.Future]] = {}
        self._flush_wanted = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._stopping = False
        self.draining = False  # shutting down: new requests are refused on every door
        self._said_ready = False
        # core messages with tokens: dispatched to their streams, taken by every stream, told to the core
        self._num_outputs_dispatched = self._num_outputs_done = self._num_outputs_acked = 0
        self._num_undelivered = 0  # streams with something put on their outbox and not yet taken
        self.kv_events = KVEventHub(self._kv_subscribers_changed)  # SubscribeKVEvents streams
        self._handed_on_ns = 0  # profiling: when the last message's deltas were handed on, until all are taken

    # ---- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._run(), name="pagewire-core-link"),
                       loop.create_task(self._write_loop(), name="pagewire-core-writer")]

    async def stop(self) -> None:
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
        if self._session is not None:
            self._session.close()
        await self._channel.close()
        if self.model is not None and self.model.offloaded is not None:
            self.model.offloaded.close()

    @property
    def is_serving(self) -> bool:
        return self.connected.is_set()

    async def stats(self) -> pb.Stats:
        self.flush()  # rejections counted here reach the core first
        return await self._stub.CoreStats(pb.StatsRequest(), timeout=5)

    # ---- requests ------------------------------------------------------------------------------

    def _kv_subscribers_changed(self, any_left: bool) -> None:
        """The first SubscribeKVEvents stream came or the last one left: the core records and sends
        KV events while some API server has one."""
        self._out.kv_events = any_left
        self._flush_wanted.set()

    def reject(self) -> None:
        """Count a request this server refused (the core's Stats report it)."""
        self._out.num_rejected += 1
        self._flush_wanted.set()

    def submit(self, name: str, token_ids: list[int], sampling, outbox: Outbox,
               request: ApiRequest | None = None) -> int:
        """Hand a request to the core; returns its id (``name`` is what the client calls it)."""
        if not self.connected.is_set():
            raise NotReadyError("the worker is not connected" if self.core_connected else "the scheduler core is not connected")
        request_id = next(self._request_ids)
        # n > 1: the samples are the n consecutive ids from this one, each with its own stream
        for _ in range(1, sampling.n):
            next(self._request_ids)
        self.output.add(request_id, name, token_ids, sampling)
        for index in range(sampling.n):
            self.pending[request_id + index] = _Pending(outbox, request, sampling.n)
        self._out.adds.append(NewRequest(request_id, token_ids, sampling, name))
        self._flush_wanted.set()
        return request_id

    def abort(self, request_id: int) -> None:
        """The client went away (cancelled, deadline): the core frees the request's blocks."""
        if self.pending.pop(request_id, None) is not None:
            self.output.remove(request_id)
            self._out.abort_ids.append(request_id)
            self._flush_wanted.set()

    def flush(self) -> None:
        """Send what is queued for the core now."""
        if self._session is None or not self._has_queued():
            return
        try:
            self._write_one()
        except LinkClosed as e:
            # the session is broken: end it, so the reader fails what is in flight and reconnects
            log.warning("write to the scheduler core failed: %s", e)
            self._session.close()

    def abort_named(self, name: str) -> asyncio.Future:
        """The public Abort: the core ends the request running under ``name`` (the client's
        request_id), whichever API server streams it; the future says whether one was running."""
        if not self.core_connected:
            raise NotReadyError("the scheduler core is not connected")
        future = asyncio.get_running_loop().create_future()
        self._abort_waiters.setdefault(name, []).append(future)
        self._out.abort_names.append(name)
        self._flush_wanted.set()
        return future

    def _has_queued(self) -> bool:
        out = self._out
        return bool(out.adds or out.abort_ids or out.stop_ids or out.abort_names or out.num_rejected or out.ready
                    or self._num_outputs_done != self._num_outputs_acked or out.kv_events is not None)

    async def _write_loop(self) -> None:
        # everything queued during one turn of the loop (adds, aborts, stops, the acknowledgement)
        # goes to the core as one message
        while True:
            await self._flush_wanted.wait()
            self._flush_wanted.clear()
            self.flush()

    def _write_one(self) -> None:
        msg, self._out = self._out, CoreRequests()
        msg.num_outputs_done = self._num_outputs_acked = self._num_outputs_done
        self._session.write(msg.to_bytes())

    # ---- the link to the core ------------------------------------------------------------------

    async def _run(self) -> None:
        backoff = 0.2
        while not self._stopping:
            try:
                await self._serve_link()
                backoff = 0.2
            except asyncio.CancelledError:
                raise
            except (grpc.RpcError, LinkClosed) as e:
                log.debug("core link: %s", e)
            except Exception:
                log.exception("core link failed")
            self._link_lost("the scheduler core is unavailable")
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 2.0)

    async def _serve_link(self) -> None:
        info = await self._stub.CoreInfo(core_pb2.CoreInfoRequest(), timeout=5, wait_for_ready=True)
        self._session = await LinkSession.open(self.core_address, info.frame_link, self._stub.Connect)
        self._said_ready = False
        self._num_outputs_dispatched = self._num_outputs_done = self._num_outputs_acked = 0
        self.core_connected = True
        log.info("connected to the scheduler core at %s", self.core_address)
        if self.kv_events.has_subscribers:  # subscribed while the link was coming up
            self._kv_subscribers_changed(True)
        while True:
            data = await self._session.read()
            with step_profile.phase("outputs decode"):
                msg = CoreOutputs.from_bytes(data)
            if msg.has_worker_state:
                await self._worker_state(msg)
            self.dispatch(msg)
            if msg.kv_events is not None:
                self.kv_events.publish(msg.kv_events)
            if msg.has_tokens:
                self._num_outputs_dispatched += 1
                if not self._num_undelivered:
                    self.delivered()
                step_profile.end_step(len(msg.request_ids))  # a step of the API server: a message with tokens

    async def _worker_state(self, msg: CoreOutputs) -> None:
        if msg.api_server_id:  # the session's first message: this server's ids from now on
            self._request_ids = itertools.count(first_request_id(msg.api_server_id))
        self.worker_connected = msg.worker_connected
        if msg.worker_connected and (self.model is None or msg.worker_generation != self.worker_generation):
            info = await self._stub.CoreInfo(core_pb2.CoreInfoRequest(), timeout=10)
            old = self.model
            tokenizer = Tokenizer.from_files(dict(info.tokenizer_files)) if "tokenizer.json" in info.tokenizer_files else None
            if old is not None and old.tokenizer is not None and tokenizer is not None and old.tokenizer.files == tokenizer.files:
                self.model = ServedModel(info, old.tokenizer, old.offloaded)  # same model again: keep the helper
            else:
                if old is not None and old.offloaded is not None:
                    old.offloaded.close()
                offloaded = None
                if tokenizer is not None:
                    offloaded = OffloadedTokenizer(tokenizer)
                    # start its helper process now, not at the first big prompt
                    await asyncio.get_running_loop().run_in_executor(None, offloaded.warm_up)
                self.model = ServedModel(info, tokenizer, offloaded)
            self.output.tokenizer = self.model.tokenizer
            if self.metrics is not None:
                self.metrics.set_model_name(info.model_name)
            self.worker_generation = msg.worker_generation
        self._set_connected(self.worker_connected and self.model is not None)
        if self.connected.is_set() and not self._said_ready:
            self._said_ready = True
            self._out.ready = True
            self._flush_wanted.set()

    def note_undelivered(self) -> None:
        """A stream has something put on its outbox that its handler has not taken yet."""
        self._num_undelivered += 1

    def delivered(self) -> None:
        """A stream took what was put on it; once none has anything waiting, every core message
        dispatched so far is done."""
        if self._num_undelivered > 0:
            self._num_undelivered -= 1
        if not self._num_undelivered and self._num_outputs_done != self._num_outputs_dispatched:
            self._num_outputs_done = self._num_outputs_dispatched
            self._flush_wanted.set()
            profile = step_profile.active()
            if self._handed_on_ns and profile is not None:  # the handlers' turns since the deltas were handed on
                profile.add("handlers", time.perf_counter_ns() - self._handed_on_ns)
            self._handed_on_ns = 0

    def _set_connected(self, up: bool) -> None:
        if up and not self.connected.is_set():
            self.connected.set()
            self._on_health(True)
        elif not up and self.connected.is_set():
            self.connected.clear()
            self._on_health(False)

    def _link_lost(self, message: str) -> None:
        if self._session is not None:
            self._session.close()
            self._session = None
        self.core_connected = False
        self.worker_connected = False
        self._set_connected(False)
        self.kv_events.fail_all(grpc.StatusCode.UNAVAILABLE, message)  # the core's events are lost with it
        self._out = CoreRequests()
        pending, self.pending = self.pending, {}
        self.output.streams.clear()
        self._num_outputs_dispatched = self._num_outputs_done = self._num_outputs_acked = 0
        self._handed_on_ns = 0
        failure = Failure(grpc.StatusCode.UNAVAILABLE, message)
        for p in pending.values():
            p.outbox.put_nowait(failure)
        waiters, self._abort_waiters = self._abort_waiters, {}
        for future in (f for futures in waiters.values() for f in futures):
            if not future.done():
                future.set_exception(NotReadyError(message))

    def dispatch(self, msg: CoreOutputs) -> None:
        """Apply one step's outputs from the core to this server's streams. Step profile phases:
        ``dispatch`` (errors, first tokens, text streams), ``hand on`` (the deltas onto their
        streams' outboxes), and ``handlers``, from then until every stream woken took its part."""
        pending = self.pending
        with step_profile.phase("dispatch"):
            for err in msg.errors:
                p = pending.pop(err.request_id, None)
                if p is not None:
                    p.outbox.put_nowait(Failure(_CODES.get(err.code, grpc.StatusCode.UNKNOWN), err.message))
                    self.output.remove(err.request_id)
                    # the request's other samples end with it (refused: they never ran; aborted:
                    # the core sent one error per sample still running, the first one ends them all)
                    first = p.request.id if p.request is not None else err.request_id
                    for sample_id in range(first, first + p.n):
                        if pending.pop(sample_id, None) is not None:
                            self.output.remove(sample_id)
            for reply in msg.abort_replies:
                futures = self._abort_waiters.get(reply.name)
                if futures:
                    future = futures.pop(0)
                    if not futures:
                        del self._abort_waiters[reply.name]
                    if not future.done():
                        future.set_result(reply.found)
            for request_id in msg.started_ids:
                p = pending.get(request_id)
                if p is not None and p.request is not None:
                    p.request.started()
            ready, stopped = self.output.apply(msg)
        with step_profile.phase("hand on"):
            for request_id, delta in ready:
                p = pending[request_id]
                p.outbox.put_nowait(delta)
                if delta.finished:
                    del pending[request_id]
            if stopped:
                self._out.stop_ids.extend(stopped)
                self._flush_wanted.set()
        if ready and step_profile.active() is not None:
            self._handed_on_ns = time.perf_counter_ns()


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, api: ApiServer):
        self.api = api

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        async for resp in self._run(context, request.request_id, request.sampling, request.model,
                                    prompt=request.prompt or None,
                                    prompt_token_ids=list(request.prompt_token_ids) or None):
            yield resp

    async def Chat(self, request: pb.ChatRequest, context: grpc.aio.ServicerContext):
        messages = [{"role": m.role, "content": m.content} for m in request.messages]
        async for resp in self._run(context, request.request_id, request.sampling, request.model, messages=messages):
            yield resp

    async def SubscribeKVEvents(self, request: pb.KVEventsRequest, context: grpc.aio.ServicerContext):
        if not self.api.core_connected:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the scheduler core is not connected")
        subscriber = self.api.kv_events.subscribe()
        try:
            while True:
                for item in await subscriber.take():
                    if isinstance(item, Failure):
                        await context.abort(item.code, item.message)
                    yield item
        finally:
            self.api.kv_events.unsubscribe(subscriber)

    async def GetModelInfo(self, request, context):
        model = self.api.model
        if model is None or not self.api.connected.is_set():
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is not connected yet")
        info = model.info
        return pb.ModelInfo(
            model_name=info.model_name, max_model_len=info.max_model_len, vocab_size=info.vocab_size,
            block_size=info.block_size, num_kv_blocks=info.num_kv_blocks, eos_token_ids=list(info.eos_token_ids),
            dtype=info.dtype, device=info.device,
            has_chat_template=bool(model.tokenizer and model.tokenizer.chat_template),
        )

    async def GetStats(self, request, context):
        try:
            return await self.api.stats()
        except grpc.RpcError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the scheduler core is unavailable: {e.details()}")

    async def Abort(self, request: pb.AbortRequest, context):
        # through the core: the request may stream from another API server on this port
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is empty")
        try:
            found = await self.api.abort_named(request.request_id)
        except NotReadyError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        return pb.AbortResponse(found=found)

    async def Tokenize(self, request: pb.TokenizeRequest, context):
        messages = [{"role": m.role, "content": m.content} for m in request.messages]
        try:
            prompt, ids = await tokenize(self.api, prompt=request.prompt or None, messages=messages or None,
                                         model_name=request.model)
        except RequestError as e:
            await context.abort(e.code, e.message)
        return pb.TokenizeResponse(token_ids=ids, num_tokens=len(ids), prompt=prompt or "")

    async def Detokenize(self, request: pb.DetokenizeRequest, context):
        try:
            text = await detokenize(self.api, list(request.token_ids), model_name=request.model)
        except RequestError as e:
            await context.abort(e.code, e.message)
        return pb.DetokenizeResponse(text=text)

    async def GetLoads(self, request, context):
        try:
            stats = await self.api.stats()
        except grpc.RpcError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the scheduler core is unavailable: {e.details()}")
        return pb.Loads(cores=[core_load(0, stats)])  # one core today; each would answer its own Stats

    # ---- one request ------------------------------------------------------------------------

    async def _run(self, context, request_id, sampling_msg, model_name, **prompt):
        try:
            sampling, sampling_error = wire.sampling_from_pb(sampling_msg), None
        except ValueError as e:
            sampling, sampling_error = None, str(e)
        try:
            req = await open_request(self.api, request_id=request_id, sampling=sampling, sampling_error=sampling_error,
                                     model_name=model_name, **prompt)
        except RequestError as e:
            await context.abort(e.code, e.message)
        try:
            # deltas that piled up while this stream was being written go out as one message (one
            # per sample when n > 1)
            async for items in req:
                if req.sampling.n == 1:
                    yield _response(req.request_id, items)
                    continue
                for index in sorted({it.index for it in items}):
                    yield _response(req.request_id, [it for it in items if it.index == index])
        except RequestError as e:
            await context.abort(e.code, e.message)
        finally:
            req.close()


def core_load(core: int, stats: pb.Stats) -> pb.CoreLoad:
    """One core's load from its Stats: blocks held by requests, and its prefix-cache hit rate."""
    queried = stats.num_prefix_cache_queried_tokens
    return pb.CoreLoad(core=core, num_running=stats.num_running, num_waiting=stats.num_waiting,
                       num_used_blocks=stats.num_total_blocks - stats.num_free_blocks,
                       num_total_blocks=stats.num_total_blocks,
                       prefix_cache_hit_rate=stats.num_prefix_cache_hit_tokens / queried if queried else 0.0)


def _response(request_id: str, items: list[TextDelta]) -> pb.GenerateResponse:
    last = items[-1]
    if len(items) == 1:
        resp = pb.GenerateResponse(request_id=request_id, token_ids=last.token_ids, text=last.text,
                                   finish_reason=_FINISH[last.finish_reason])
    else:
        resp = pb.GenerateResponse(
            request_id=request_id,
            token_ids=[t for it in items for t in it.token_ids],
            text="".join(it.text for it in items),
            finish_reason=_FINISH[last.finish_reason],
        )
    if last.logprobs is not None:
        resp.logprobs.extend(lp for it in items for lp in (it.logprobs or ()))
    if last.top_logprobs is not None:
        resp.top_logprobs.extend(pb.TopLogprobs(token_ids=ids, logprobs=lps)
                                 for it in items for ids, lps in (it.top_logprobs or ()))
    for it in items:  # on the first delta only
        prompt = it.prompt_logprobs
        if prompt is not None:
            resp.prompt_logprobs.extend(prompt.logprobs.tolist())
            if prompt.num_top:
                resp.prompt_top_logprobs.extend(pb.TopLogprobs(token_ids=ids, logprobs=lps)
                                                for ids, lps in prompt.top_lists())
    if last.index:
        resp.index = last.index
    if last.usage is not None:
        u = last.usage
        resp.usage.CopyFrom(pb.Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                                     cached_prompt_tokens=u.cached_prompt_tokens))
    return resp


async def build_server(api: ApiServer, listen: str, reuse_port: bool, *, listeners: int = 1, api_key: str | None = None,
                       tls: TlsFiles | None = None):
    """Started grpc.aio servers with Generation, health and reflection, ``listeners`` of them on
    one address (one for a unix socket); returns (servers, port, servicer, health servicer). With
    ``api_key`` every call but health and reflection needs it; with ``tls`` the address speaks TLS
    only.

    grpc.aio accepts a server's calls one after another, each several turns of the event loop
    after the last, and under heavy streaming those turns are long. Several servers sharing the
    port (SO_REUSEPORT) each accept on their own, so new calls on different connections are taken
    in side by side instead of queueing behind one another."""
    if listen.startswith("unix:"):
        listeners = 1
    servicer = GenerationServicer(api)
    health_servicer = health.aio.HealthServicer()
    credentials = tls.grpc_credentials() if tls is not None else None
    servers: list[grpc.aio.Server] = []
    port = 0
    try:
        for i in range(listeners):
            server = grpc.aio.server(
                options=[
                    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
                    ("grpc.so_reuseport", 1 if reuse_port or listeners > 1 else 0),
                ],
                interceptors=[ApiKeyInterceptor(api_key)] if api_key is not None else None,
            )
            generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
            health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
            reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
            # the first may be given port 0: the others join the port it got
            address = listen if i == 0 else f"{listen.rpartition(':')[0]}:{port}"
            bound = add_port(server, address, credentials)
            servers.append(server)
            port = port or bound
        for server in servers:
            await server.start()
    except BaseException:
        for server in servers:
            await server.stop(grace=None)
        raise
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    return servers, port, servicer, health_servicer


async def stop_servers(servers: list[grpc.aio.Server], grace: float | None) -> None:
    await asyncio.gather(*(server.stop(grace=grace) for server in servers))
