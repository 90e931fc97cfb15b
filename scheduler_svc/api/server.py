"""An API server: the public ``pagewire.v1.Generation`` service in front of the engine cores.

Several API-server processes can listen on one address (SO_REUSEPORT: the kernel spreads the
connections). Each validates requests, tokenizes prompts and renders chat templates without
stalling its event loop (``OffloadedTokenizer``), picks an engine core for each request
(``router.py``; one core unless ``--data-parallel-size``/``--data-parallel-cores``), sends it over
that core's ``Connect`` stream (``core_link.py``), and turns the core's per-step token arrays into
each client's stream: incremental text, stop strings (a stop ends the request in the core),
``--stream-interval``. ``GetStats`` sums the cores' figures, ``GetLoads`` lists them per core.
Health is SERVING while some core's link and that core's link to its worker are both up.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvcache.allocator import prefix_block_hashes
from pagewire_common import wire
from pagewire_common.addresses import add_port
from pagewire_common.chat_template import ChatOptions
from pagewire_common.kv_events import KVEventBatch
from pagewire_common.requests import FinishReason, TextDelta, check_request_id
from pagewire_common.settings import check_host_port, default_of
from pagewire_common.tls import TlsFiles
from pagewire_common.v1 import core_pb2, generation_pb2_grpc
from pagewire_common.v1 import generation_pb2 as pb
from scheduler_svc.api.auth import ApiKeyInterceptor
from scheduler_svc.api.core_link import CoreLink
from scheduler_svc.api.kv_events import KVEventHub
from scheduler_svc.api.request import PASSED_ON, ApiRequest, Failure, NotReadyError, RequestError, open_request
from scheduler_svc.api.request_decoding import DecodeErrorInterceptor
from scheduler_svc.api.router import NoCoreError, Router
from scheduler_svc.api.tokenize import detokenize, tokenize
from scheduler_svc.api.tokenizer import OffloadedTokenizer, Tokenizer

log = logging.getLogger("pagewire.api")

SERVICE_NAME = "pagewire.v1.Generation"
_FINISH = {None: pb.UNSPECIFIED, FinishReason.STOP: pb.STOP, FinishReason.LENGTH: pb.LENGTH}


@dataclass(frozen=True, slots=True)
class ServedModel:
    """What the core reported: the limits requests are validated against, and the tokenizer."""

    info: core_pb2.CoreInfoResponse
    tokenizer: Tokenizer | None
    offloaded: OffloadedTokenizer | None
    files: dict | None = None  # the tokenizer's files, to tell another core's model apart


class ApiServer:
    """The state of one API-server process: a link to each engine core (``CoreLink``), the router
    that picks one for each request, the served model, and the KV-event streams."""

    def __init__(self, core_addresses: str | list[str], stream_interval: int = default_of("stream_interval"),
                 on_health=None, metrics=None, routing: str = default_of("data_parallel_routing"),
                 balance_threshold: int = default_of("data_parallel_balance_threshold"), chat_template: str | None = None,
                 primary_cores: int | None = None):
        """``chat_template``: the text of ``--chat-template``, which replaces the model's own.
        ``primary_cores``: only the first this many cores may say which model is served (serve's
        own, beside cores elsewhere); the others are taken once one of those serves, with the same
        model. None: any core, the first to come up."""
        addresses = split_core_addresses(core_addresses) if isinstance(core_addresses, str) else list(core_addresses)
        self.primary_cores = len(addresses) if primary_cores is None else primary_cores
        self.metrics = metrics  # RequestMetrics, or None
        self.stream_interval = stream_interval
        self.chat_template = chat_template
        self._on_health = on_health or (lambda serving: None)
        self.router = Router(len(addresses), routing, balance_threshold)
        self.links = [CoreLink(self, i, address) for i, address in enumerate(addresses)]
        self.model: ServedModel | None = None
        self.connected = asyncio.Event()  # some core is up with its worker, and the model is known
        self.started_at = time.monotonic()
        self.was_connected = False  # connected at least once since this process started
        self.draining = False  # shutting down: new requests are refused on every door
        self.kv_events = KVEventHub(self._kv_subscribers_changed)  # SubscribeKVEvents streams
        self._adopting = asyncio.Lock()
        self._adoptions: set[asyncio.Task] = set()  # waiting cores taken on once a first core serves

    @property
    def num_cores(self) -> int:
        return len(self.links)

    @property
    def core_address(self) -> str:
        return ",".join(link.core_address for link in self.links)

    @property
    def core_connected(self) -> bool:
        return any(link.core_connected for link in self.links)

    @property
    def num_pending(self) -> int:
        """Requests (samples) in flight on every core."""
        return sum(len(link.pending) for link in self.links)

    def fail_pending(self, message: str) -> None:
        """End every request in flight on every core with UNAVAILABLE and ``message`` (shutdown)."""
        for link in self.links:
            link.fail_pending(grpc.StatusCode.UNAVAILABLE, message)

    # ---- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        for link in self.links:
            link.start()

    async def stop(self) -> None:
        await asyncio.gather(*(link.stop() for link in self.links))
        if self.model is not None and self.model.offloaded is not None:
            self.model.offloaded.close()

    @property
    def is_serving(self) -> bool:
        return self.connected.is_set()

    # ---- the cores -----------------------------------------------------------------------------

    async def adopt_model(self, link: CoreLink) -> ServedModel | None:
        """The served model for a core whose worker is up (``link.info``): the one the other cores
        serve, or a new one when no other core serves any; None when the core serves another
        model than the others (it takes no requests). One link at a time: two cores coming up
        together share one tokenizer helper."""
        async with self._adopting:
            return await self._adopt_model(link)

    async def _adopt_model(self, link: CoreLink) -> ServedModel | None:
        info = link.info
        files = dict(info.tokenizer_files) if "tokenizer.json" in info.tokenizer_files else None
        old = self.model
        link.waiting_for_model = False
        others_serve = old is not None and any(o.is_serving for o in self.links if o is not link)
        if old is not None and old.info.model_name == info.model_name and old.files == files:
            if old.info is not info and not others_serve:
                self.model = ServedModel(info, old.tokenizer, old.offloaded, files)  # same model, maybe new limits
                return self.model
            differs = [f"{name} {getattr(info, name)} (the others {getattr(old.info, name)})"
                       for name in _SHARED_LIMITS if getattr(info, name) != getattr(old.info, name)]
            if not differs or not others_serve:
                return self.model
            # requests are checked against the served model's limits, and routed by its blocks
            log.error("engine core %d (%s) serves %r with %s: it takes no requests", link.index, link.core_address,
                      info.model_name, ", ".join(differs))
            return None
        if others_serve:
            log.error("engine core %d (%s) serves %r, the others %r: it takes no requests", link.index,
                      link.core_address, info.model_name, old.info.model_name)
            return None
        if link.index >= self.primary_cores:
            # only the first cores say which model is served: this one waits for one of them
            link.waiting_for_model = True
            return None
        tokenizer = Tokenizer.from_files(files, self.chat_template) if files is not None else None
        if tokenizer is None and (old is None or old.tokenizer is not None):
            log.warning("the model %r has no tokenizer.json: requests must send prompt_token_ids, and responses "
                        "carry token ids without text (text prompts, chat and stop strings are refused)",
                        info.model_name)
        if old is not None and old.offloaded is not None:
            old.offloaded.close()
        offloaded = None
        if tokenizer is not None:
            offloaded = OffloadedTokenizer(tokenizer)
            # start its helper process now, not at the first big prompt
            await asyncio.get_running_loop().run_in_executor(None, offloaded.warm_up)
        self.model = ServedModel(info, tokenizer, offloaded, files)
        if self.metrics is not None:
            self.metrics.set_model_name(info.model_name)
        for other in self.links:  # the cores that waited for a first core: theirs may be the same model
            if other.waiting_for_model:
                task = asyncio.get_running_loop().create_task(other.adopt())
                self._adoptions.add(task)  # the loop keeps only a weak reference
                task.add_done_callback(self._adoptions.discard)
        return self.model

    def link_changed(self, link: CoreLink) -> None:
        """A core started or stopped taking requests."""
        up = any(o.is_serving for o in self.links)
        if up and not self.connected.is_set():
            self.connected.set()
            self.was_connected = True
            self._on_health(True)
        elif not up and self.connected.is_set():
            self.connected.clear()
            self._on_health(False)

    def core_lost(self, link: CoreLink, message: str) -> None:
        """A core's ``Connect`` stream ended: it leaves the routing table, and the KV-event streams end (the
        core's events are lost with it; a subscriber subscribes again)."""
        self.router.clear(link.index)
        self.kv_events.fail_all(grpc.StatusCode.UNAVAILABLE, message)

    def core_kv_events(self, core: int, batch: KVEventBatch) -> None:
        if self.router.uses_kv_events:
            self.router.apply_events(core, batch.events)
        self.kv_events.publish(batch)

    @property
    def wants_kv_events(self) -> bool:
        return self.kv_events.has_subscribers or self.router.uses_kv_events

    def _kv_subscribers_changed(self, any_left: bool) -> None:
        """The first SubscribeKVEvents stream came or the last one left: the cores record and send
        KV events while some API server has one (or routes by them)."""
        for link in self.links:
            link.want_kv_events(any_left or self.router.uses_kv_events)

    def route(self, token_ids: list[int], n: int, exclude: set[int] | frozenset[int] = frozenset()) -> CoreLink:
        """The core that takes a request with this prompt and ``n`` samples (``router.py`` has
        the rules), among the cores with room for it when some have (``CoreLink.has_room``): a
        full core would refuse it while another could run it. ``exclude``: cores not to take."""
        if self.num_cores == 1:
            return self.links[0]
        hashes = prefix_block_hashes(token_ids, self.model.info.block_size) if self.router.uses_kv_events else []
        loads = [link.load if link.is_serving and link.index not in exclude else None for link in self.links]
        roomy = [load if load is not None and link.has_room(load, n) else None for link, load in zip(self.links, loads)]
        if any(load is not None for load in roomy):
            loads = roomy
        try:
            return self.links[self.router.pick(hashes, loads)]
        except NoCoreError as e:
            raise NotReadyError(str(e)) from None

    def reroute(self, request: ApiRequest, failure: Failure) -> CoreLink | None:
        """Another core for a request that its core refused for want of room (each API server sees
        the others' load a poll late) or lost before it produced anything, or None: one core, a
        server shutting down, another failure, or no core left that has not refused or lost it."""
        if self.num_cores == 1 or self.draining or failure.code not in PASSED_ON:
            return None
        request.tried_cores.add(request.api.index)
        try:
            link = self.route(request.prompt_token_ids, request.sampling.n, exclude=request.tried_cores)
        except NotReadyError:
            return None
        log.debug("request %s: %s on engine core %d; trying core %d", request.request_id, failure.message,
                  request.api.index, link.index)
        return link

    # ---- what every core answers -----------------------------------------------------------------

    def reject(self) -> None:
        """Count a request this server refused (in the first connected core's Stats)."""
        for link in self.links:
            if link.core_connected:
                link.reject()
                return

    async def core_stats(self) -> list[tuple[int, pb.Stats]]:
        """(core index, Stats) of every core whose link is up and that does not serve another
        model (or other limits); ``NotReadyError`` when none is."""
        links = [link for link in self.links if link.core_connected and not link.mismatched] or self.links[:1]
        if self.num_cores > 1 and not any(link.core_connected for link in self.links):
            raise NotReadyError("no engine core is connected")
        results = await asyncio.gather(*(link.stats() for link in links), return_exceptions=True)
        stats = [(link.index, r) for link, r in zip(links, results) if not isinstance(r, BaseException)]
        if not stats:
            error = results[0]
            raise error if isinstance(error, grpc.RpcError) else NotReadyError(str(error))
        return stats

    async def stats(self) -> pb.Stats:
        """The cores' Stats summed (counts and counters add up; the worker is connected when every
        core's is: with several cores, false while any one's is away, though the others serve)."""
        per_core = await self.core_stats()
        total = pb.Stats()
        for _, stats in per_core:
            for field in _SUMMED_STATS:
                setattr(total, field, getattr(total, field) + getattr(stats, field))
        total.worker_connected = len(per_core) == self.num_cores and all(s.worker_connected for _, s in per_core)
        return total

    async def abort_named(self, name: str) -> bool:
        """The public Abort: every core ends the request running under ``name`` (the client's
        request_id), whichever API server streams it; True when one ran."""
        futures = [link.abort_named(name) for link in self.links if link.core_connected]
        if not futures:
            raise NotReadyError("the scheduler core is not connected")
        results = await asyncio.gather(*futures, return_exceptions=True)
        if any(r is True for r in results):
            return True
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors and len(errors) == len(results):
            raise errors[0]
        return False


def split_core_addresses(text: str) -> list[str]:
    """``ADDR[,ADDR...]`` (host:port or unix:PATH each) -> the list; ``ValueError`` naming a bad one."""
    addresses = [a.strip() for a in text.split(",")]
    for address in addresses:
        if address.startswith("unix:"):
            if len(address) > len("unix:"):
                continue
        elif check_host_port(address) is None:
            continue
        raise ValueError(f"bad engine core address {address!r} in {text!r}: host:port or unix:PATH")
    twice = next((a for i, a in enumerate(addresses) if a in addresses[:i]), None)
    if twice is not None:  # its requests and figures would count twice
        raise ValueError(f"engine core address {twice!r} is given twice in {text!r}")
    return addresses


# what every core of one served model must share: requests are checked against these before any
# core is chosen, and routed by prompt blocks of that size
_SHARED_LIMITS = ("max_model_len", "vocab_size", "block_size")

_SUMMED_STATS = ("num_total_blocks", "num_free_blocks", "num_running", "num_waiting", "num_requests_finished",
                 "num_requests_aborted", "num_requests_rejected", "num_cached_blocks", "num_steps", "num_preemptions",
                 "num_prefix_cache_queried_tokens", "num_prefix_cache_hit_tokens")


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
        try:
            options = chat_options_from_pb(request)
        except ValueError as e:
            self.api.reject()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        async for resp in self._run(context, request.request_id, request.sampling, request.model, messages=messages,
                                    chat_options=options):
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
        except NotReadyError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))

    async def Abort(self, request: pb.AbortRequest, context):
        # through the core: the request may stream from another API server on this port
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is empty")
        try:
            check_request_id(request.request_id)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        try:
            found = await self.api.abort_named(request.request_id)
        except NotReadyError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        return pb.AbortResponse(found=found)

    async def Tokenize(self, request: pb.TokenizeRequest, context):
        messages = [{"role": m.role, "content": m.content} for m in request.messages]
        try:
            prompt, ids = await tokenize(self.api, prompt=request.prompt or None, messages=messages or None,
                                         chat_options=chat_options_from_pb(request), model_name=request.model)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
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
        # the cores that answer, each by its index in this API server's list (a core that is down is left out)
        try:
            per_core = await self.api.core_stats()
        except grpc.RpcError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the scheduler core is unavailable: {e.details()}")
        except NotReadyError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        return pb.Loads(cores=[core_load(core, stats) for core, stats in per_core])

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


def chat_options_from_pb(request: pb.ChatRequest | pb.TokenizeRequest) -> ChatOptions:
    """A Chat or Tokenize request's rendering options (``ValueError`` for both ends at once)."""
    default = ChatOptions()
    add = request.add_generation_prompt if request.HasField("add_generation_prompt") else default.add_generation_prompt
    return ChatOptions(add, request.continue_final_message)


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
                interceptors=[*([ApiKeyInterceptor(api_key)] if api_key is not None else []), DecodeErrorInterceptor()],
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
