"""The scheduler core: the engine task, the worker link, and the ``SchedulerCore`` service that the
API servers talk to.

Everything runs on one asyncio event loop in one thread. Each API server holds one ``Connect``
session; on its frame link (``pagewire_common.framelink``) its requests (token ids + sampling,
already validated), aborts and stops come in, and after each step the core sends it one
``CoreOutputs`` with that server's new tokens as arrays (``pagewire_common.core_messages``), so the core's cost grows with
steps and tokens, not with streamed messages. There is no tokenizer on this path. When the
worker is lost, every request in flight fails with UNAVAILABLE, block accounting starts over,
and the task reconnects. When an API server's session ends (the process died, stopped, or stopped
answering), its requests are aborted and their blocks freed before the next plan.
"""

from __future__ import annotations

import asyncio
import itertools
import logging

import grpc

from pagewire_common import step_profile, wire
from pagewire_common.addresses import peer_name
from pagewire_common.core_messages import AbortReply, BadRequest, CoreOutputs, CoreRequests, NewRequest, api_server_of
from pagewire_common.framelink import FrameListener, LinkClosed
from pagewire_common.kv_events import KVEventBatch
from pagewire_common.logs import WaitingNote
from pagewire_common.requests import FinishReason
from pagewire_common.settings import Settings
from pagewire_common.v1 import core_pb2, core_pb2_grpc
from pagewire_common.v1 import generation_pb2 as pb
from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.delivery import ApiClient, deliver
from scheduler_svc.core.engine import EngineCore, WorkerInfo, plans_in_flight
from scheduler_svc.core.request_names import RequestNames
from scheduler_svc.core.running_batch import StepTokens
from scheduler_svc.core.worker_client import WorkerLink, WorkerLinkError

log = logging.getLogger("pagewire.scheduler")

# a new request needs a couple of turns of the loop to reach the core (CoreService._admit_arrivals)
QUIET_TURNS = 6
# the longest the core waits for one API server to hand on a step's tokens (backpressure)
BACKPRESSURE_TIMEOUT_S = 1.0
# a core does not know its index among the API server's cores: the API server sets it on each batch
CORE_INDEX = 0


class CoreService(core_pb2_grpc.SchedulerCoreServicer):
    def __init__(self, worker_address: str, settings: Settings, on_health=None, link_factory=WorkerLink):
        self.worker_address = worker_address
        self.settings = settings
        self._link_factory = link_factory  # address -> a WorkerLink (tests pass an in-process one)
        self._on_health = on_health or (lambda serving: None)
        self._link: WorkerLink | None = None
        self._clients: dict[int, ApiClient] = {}  # API-server id -> its session
        self._client_ids = itertools.count(1)
        self.names = RequestNames(self._is_running)  # the clients' request ids of running requests
        self._wake = asyncio.Event()
        self._caught_up = asyncio.Event()  # an API server handed on a step's outputs
        self._stopping = False
        self.draining = False  # shutting down: new requests are refused, running ones go on
        self._last_connect_error = ""
        self._task: asyncio.Task | None = None
        self.engine: EngineCore | None = None
        self.worker_info: WorkerInfo | None = None
        self.tokenizer_files: dict[str, bytes] = {}
        self.worker_generation = 0
        self.connected = asyncio.Event()
        self.readiness_changed = asyncio.Event()  # the worker link came up or an API server got ready
        self.scheduler_ready = False  # the scheduler logged that it is ready
        self.frames = FrameListener()  # the frame links of the API servers' Connect sessions
        self.num_submitted = 0
        self.num_rejected = 0
        self.num_steps = 0
        self._kv_subscribers: set[int] = set()  # API servers with SubscribeKVEvents streams: record and send
        self._kv_seq = 0  # KV event batches sent so far (their seq)
        # figures of engines before the last reconnect
        self._past = dict(finished=0, aborted=0, preemptions=0, prefix_queried=0, prefix_hits=0)

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        self._link = self._link_factory(self.worker_address)
        self._task = asyncio.get_running_loop().create_task(self._run(), name="pagewire-engine")

    async def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        for client in list(self._clients.values()):
            client.outbox.put_nowait(None)  # ends a consumer in this process
        await self.frames.close()
        if self._link is not None:
            await self._link.close()

    @property
    def num_in_flight(self) -> int:
        return sum(len(client.request_ids) for client in self._clients.values())

    async def drain(self, timeout: float) -> None:
        """Refuse new requests and let the running ones finish, for at most ``timeout`` seconds
        (a core whose API servers are elsewhere: theirs drain on their own machines)."""
        self.draining = True
        self._broadcast_worker_state()  # the API servers route new requests elsewhere
        deadline = asyncio.get_running_loop().time() + timeout
        while self.num_in_flight and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)

    @property
    def num_ready_clients(self) -> int:
        return sum(1 for c in self._clients.values() if c.ready)

    # ---- the SchedulerCore service -----------------------------------------------------------

    async def CoreInfo(self, request, context) -> core_pb2.CoreInfoResponse:
        return self.info_response()

    async def CoreStats(self, request, context) -> pb.Stats:
        return pb.Stats(**self.stats())

    async def Connect(self, request, context):
        conn = await self.frames.open_session(request, context)
        client = self.open_client(context.peer(), send=lambda out: conn.write(out.to_bytes()))
        try:
            conn.write(self.worker_state_message(client).to_bytes())
            while (data := await conn.read()) is not None:
                self.apply(client, CoreRequests.from_bytes(data))
        except LinkClosed:
            pass
        finally:
            conn.close()
            self.close_client(client)

    def info_response(self) -> core_pb2.CoreInfoResponse:
        info = self.worker_info
        msg = core_pb2.CoreInfoResponse(worker_connected=self.connected.is_set(),
                                        worker_generation=self.worker_generation,
                                        max_num_seqs=self.settings.max_num_seqs,
                                        max_queued_requests=self.settings.max_queued_requests,
                                        num_api_servers_ready=self.num_ready_clients,
                                        scheduler_ready=self.scheduler_ready)
        if info is not None and self.engine is not None:
            msg.model_name = info.model_name
            msg.vocab_size = info.vocab_size
            msg.max_model_len = self.engine.max_model_len
            msg.block_size = info.block_size
            msg.num_kv_blocks = info.num_kv_blocks
            msg.eos_token_ids.extend(info.eos_token_ids)
            msg.dtype = info.dtype
            msg.device = info.device
            for name, data in self.tokenizer_files.items():
                msg.tokenizer_files[name] = data
        msg.frame_link.CopyFrom(self.frames.describe())
        return msg

    def worker_state_message(self, client: ApiClient) -> CoreOutputs:
        return CoreOutputs(has_worker_state=True, worker_connected=self.connected.is_set(),
                           worker_generation=self.worker_generation, api_server_id=client.api_server_id,
                           draining=self.draining)

    def stats(self) -> dict:
        engine = self.engine
        alloc = engine.allocator if engine else None
        return dict(
            num_total_blocks=alloc.num_blocks if alloc else 0,
            num_free_blocks=alloc.num_free_blocks if alloc else 0,
            num_cached_blocks=alloc.num_cached_blocks if alloc else 0,
            num_running=engine.scheduler.num_running if engine else 0,
            num_waiting=engine.scheduler.num_waiting if engine else 0,
            num_requests_finished=self._past["finished"] + (engine.num_finished if engine else 0),
            num_requests_aborted=self._past["aborted"] + (engine.num_aborted if engine else 0),
            num_requests_rejected=self.num_rejected,
            worker_connected=self.connected.is_set(),
            num_steps=self.num_steps,
            num_preemptions=self._past["preemptions"] + (engine.scheduler.num_preemptions if engine else 0),
            num_prefix_cache_queried_tokens=self._past["prefix_queried"]
            + (engine.scheduler.num_prefix_queried_tokens if engine else 0),
            num_prefix_cache_hit_tokens=self._past["prefix_hits"] + (engine.scheduler.num_prefix_hit_tokens if engine else 0),
        )

    # ---- requests from API servers -------------------------------------------------------------

    def open_client(self, peer: str = "", send=None) -> ApiClient:
        """A new API server; ``send`` takes each of its ``CoreOutputs`` (by default they go on
        ``client.outbox``, for a consumer in this process). Its id, in the first message, is the
        high half of its request ids."""
        client = ApiClient(next(self._client_ids), peer, send)
        self._clients[client.api_server_id] = client
        log.info("API server %d connected (%s)", client.api_server_id, peer_name(peer))
        return client

    def close_client(self, client: ApiClient) -> None:
        """The API server is gone: abort its requests (blocks freed now, dropped by the worker in
        the next plan)."""
        if self._clients.pop(client.api_server_id, None) is None:
            return
        self._caught_up.set()  # nobody waits for a server that is gone
        if client.api_server_id in self._kv_subscribers:
            self._subscribe_kv_events(client, False)
        engine = self.engine
        if engine is not None:
            for request_id in client.request_ids:
                engine.abort(request_id)
        if client.request_ids:
            log.warning("API server %d left with %d requests in flight; aborted them", client.api_server_id,
                        len(client.request_ids))
        client.request_ids.clear()
        self._wake.set()

    def apply(self, client: ApiClient, msg: CoreRequests) -> None:
        """Add, abort and stop requests of ``client`` (errors go back in its session now)."""
        if msg.num_rejected:
            self.num_rejected += msg.num_rejected
        if msg.kv_events is not None:
            self._subscribe_kv_events(client, msg.kv_events)
        if msg.ready:
            client.ready = True
            self.readiness_changed.set()
        if msg.num_outputs_done > client.num_outputs_done:
            client.num_outputs_done = msg.num_outputs_done
            client.unresponsive = False
            if not client.is_behind:
                self._caught_up.set()
        for add in msg.adds:
            self._add(client, add)
        engine = self.engine
        for request_id in msg.abort_ids:
            if request_id in client.request_ids:
                client.request_ids.discard(request_id)
                if engine is not None:
                    engine.abort(request_id)
        for request_id in msg.stop_ids:
            if request_id in client.request_ids:
                client.request_ids.discard(request_id)
                if engine is not None:
                    engine.finish(request_id, FinishReason.STOP)
        for name in msg.abort_names:
            client.outputs.abort_replies.append(AbortReply(name, self._abort_named(client, name)))
        if client.outputs.errors or client.outputs.abort_replies:
            client.flush()
        self._wake.set()

    def _is_running(self, request_id: int) -> bool:
        client = self._clients.get(api_server_of(request_id))
        return client is not None and request_id in client.request_ids

    def _abort_named(self, client: ApiClient, name: str) -> bool:
        """The public Abort: end the request running under ``name``, whichever API server owns it
        (blocks freed now; the owner's stream ends CANCELLED). False when none runs under it."""
        ids = self.names.running(name)
        if ids is None:
            return False
        self.names.remove(name)
        owner = self._clients[api_server_of(ids.start)]
        engine = self.engine
        for request_id in ids:
            if request_id in owner.request_ids:  # one error per sample still running: the owner may
                owner.request_ids.discard(request_id)  # have ended some on its own (a stop string)
                if engine is not None:
                    engine.abort(request_id)
                owner.error(request_id, grpc.StatusCode.CANCELLED, f"request {name!r} was aborted")
        if owner is not client:
            owner.flush()
        return True

    def _add(self, client: ApiClient, add: NewRequest | BadRequest) -> None:
        engine = self.engine
        request_id = add.request_id
        if isinstance(add, BadRequest):
            self.num_rejected += 1
            client.error(request_id, grpc.StatusCode.INVALID_ARGUMENT, add.message)
            return
        # a passable add's API server may offer it to another core: a refusal that sends it there
        # (no worker, shutting down, no room) is counted by the API server, once, if none takes it
        if engine is None or not self.connected.is_set():
            self.num_rejected += not add.passable
            client.error(request_id, grpc.StatusCode.UNAVAILABLE, "the worker is not connected")
            return
        if self.draining:
            self.num_rejected += not add.passable
            client.error(request_id, grpc.StatusCode.UNAVAILABLE, "the engine core is shutting down")
            return
        n = add.sampling.n
        if api_server_of(request_id) != client.api_server_id or api_server_of(request_id + n - 1) != client.api_server_id:
            self.num_rejected += 1
            client.error(request_id, grpc.StatusCode.INVALID_ARGUMENT,
                         f"request id {request_id} does not belong to API server {client.api_server_id}")
            return
        if any(i in client.request_ids for i in range(request_id, request_id + n)):
            self.num_rejected += 1
            client.error(request_id, grpc.StatusCode.ALREADY_EXISTS, f"request {request_id} is already in flight")
            return
        if add.name and self.names.running(add.name) is not None:
            self.num_rejected += 1
            client.error(request_id, grpc.StatusCode.ALREADY_EXISTS, f"a request with id {add.name!r} is already running")
            return
        try:
            # CoreRequests.from_bytes decoded the ids into a list of ints of this add's own
            token_ids = engine.validate(add.prompt_token_ids, add.sampling, strict_length=True, decoded=True)
        except ValueError as e:
            self.num_rejected += 1
            client.error(request_id, grpc.StatusCode.INVALID_ARGUMENT, str(e))
            return
        refusal = self._queue_refusal(engine, n)
        if refusal is not None:
            self.num_rejected += not add.passable
            client.error(request_id, grpc.StatusCode.RESOURCE_EXHAUSTED, refusal)
            return
        engine.add_request(request_id, token_ids, add.sampling, validated=True)
        client.request_ids.update(range(request_id, request_id + n))
        if add.name:
            self.names.add(add.name, request_id, n)
        self.num_submitted += 1

    @staticmethod
    def _queue_refusal(engine: EngineCore, n: int) -> str | None:
        """Why a request of ``n`` samples finds no room (RESOURCE_EXHAUSTED), or None.

        ``--max-queued-requests N`` lets N requests wait for room in the batch: the waiting ones
        that fill the batch's free places (``max_num_seqs`` less the running sequences) start at
        the next step and are not queued, so requests that arrive together at an idle engine are
        not refused for one another (a waiting request counts as one place, whatever its ``n``:
        with several samples a request the queue's room takes may still wait). With 0 there is no
        queue: a request is taken only when it can start at the next step, that is when its
        samples fit in the batch beside the running sequences and those already waiting, which
        under 0 are the ones taken since the last step (or preempted: they start again first)."""
        scheduler, config = engine.scheduler, engine.config
        limit = config.max_queued_requests
        if limit == 0:
            if scheduler.num_running + scheduler.num_waiting + n > config.max_num_seqs:
                return (f"no room to start it now ({scheduler.num_running} running, {scheduler.num_waiting} about to "
                        f"start, max_num_seqs {config.max_num_seqs}) and no queue (max_queued_requests 0); retry later")
            return None
        if scheduler.num_waiting - max(0, config.max_num_seqs - scheduler.num_running) >= limit:
            return f"the queue is full ({limit} requests waiting); retry later"
        return None

    # ---- the engine task -----------------------------------------------------------------------

    async def _run(self) -> None:
        backoff = 0.2
        waiting = WaitingNote(log, f"the worker at {self.worker_address}")
        while not self._stopping:
            if not self.connected.is_set():
                if await self._connect():
                    backoff = 0.2
                    waiting.reset()
                else:
                    waiting.note(self._last_connect_error)
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, 2.0)
                continue
            try:
                await self._serve_steps()
            except WorkerLinkError as e:
                self._worker_lost(str(e))
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug: fail what is in flight rather than hang it
                log.exception("engine step failed")
                self._worker_lost("internal error in the scheduler engine")

    async def _connect(self) -> bool:
        try:
            info = await self._link.info(timeout=2.0)
            await self._link.open()
            self._link.on_lost(self._wake.set)
        except WorkerLinkError as e:
            log.debug("worker not reachable: %s", e)
            self._last_connect_error = str(e)
            return False
        files = dict(info.tokenizer_files)
        eos_id = wire.tokenizer_eos_token_id(files)
        worker_info = WorkerInfo.build(
            model_name=info.model_name, vocab_size=info.vocab_size, max_model_len=info.max_model_len,
            block_size=info.block_size, num_kv_blocks=info.num_kv_blocks, eos_token_ids=info.eos_token_ids,
            dtype=info.dtype, device=info.device, tokenizer_eos_token_id=eos_id,
            structured_output=info.structured_output,
        )
        self._retire_engine()
        config = SchedulerConfig.from_settings(self.settings, info.max_model_len)
        self.engine = EngineCore(config, worker_info)
        self.engine.allocator.record_kv_events(bool(self._kv_subscribers))
        self.worker_info = worker_info
        self.tokenizer_files = files
        self.worker_generation += 1
        self.connected.set()
        self.readiness_changed.set()
        self._on_health(True)
        self._broadcast_worker_state()
        log.info("connected to worker %s: %s, %d KV blocks x %d tokens",
                 self.worker_address, info.model_name, info.num_kv_blocks, info.block_size)
        return True

    def _retire_engine(self) -> None:
        engine = self.engine
        if engine is not None:
            self._past["finished"] += engine.num_finished
            self._past["aborted"] += engine.num_aborted
            self._past["preemptions"] += engine.scheduler.num_preemptions
            self._past["prefix_queried"] += engine.scheduler.num_prefix_queried_tokens
            self._past["prefix_hits"] += engine.scheduler.num_prefix_hit_tokens

    async def _serve_steps(self) -> None:
        """Run steps while connected; sleep when there is nothing to do. Each part of a step is a
        phase of the step profile (``--profile-steps``; the link times its wait and its decoding)."""
        engine, link = self.engine, self._link
        depth = plans_in_flight(self.settings, engine.worker_info.device)
        admit = depth > 1 and self.settings.admission_turns > 0
        while not self._stopping:
            if engine.is_idle():
                if self._kv_subscribers:
                    self._send_kv_events()  # those of plans whose steps are all delivered
                lost = self._link.lost()
                if lost is None:
                    self._wake.clear()
                    await self._wake.wait()
                    lost = self._link.lost()
                if lost is not None:
                    # the session ended with nothing in flight (on_lost wakes us): health goes
                    # NOT_SERVING and the core reconnects now, not when the next request fails on it
                    raise WorkerLinkError(lost)
                continue
            with step_profile.phase("wait for API servers"):
                await self._wait_for_api_servers()
            with step_profile.phase("schedule"):
                plan = engine.next_plan(depth)
            if plan is not None:
                with step_profile.phase("plan send"):
                    await link.send(plan)
            if engine.should_receive(plan is not None, depth):
                result = await link.receive()
                with step_profile.phase("apply result"):
                    step = engine.on_result(result)
                self.num_steps += 1
                with step_profile.phase("deliver"):
                    self._deliver(step)
                if admit:
                    with step_profile.phase("admission turns"):
                        await self._admit_arrivals()
                step_profile.end_step(len(result.token_ids))
            elif plan is None:
                # nothing to send and nothing outstanding (e.g. a request waits for blocks that
                # only an abort can free): let the API servers' messages in before trying again
                await asyncio.sleep(0.001)

    async def _wait_for_api_servers(self) -> None:
        """Backpressure: build the next plan only once every API server has handed on all but the
        latest step's tokens. When the API servers are the bottleneck, running ahead of them only
        makes small steps (each costs the core and the worker about the same whatever its size)
        and piles tokens up in their queues; waiting lets requests accumulate into full batches.
        The worker meanwhile runs the plan in flight."""
        while any(c.is_behind for c in self._clients.values()) and not self._stopping:
            self._caught_up.clear()
            try:
                await asyncio.wait_for(self._caught_up.wait(), BACKPRESSURE_TIMEOUT_S)
            except asyncio.TimeoutError:
                # a server that hands on nothing for this long is frozen or swamped: the others go on
                for client in self._clients.values():
                    if client.is_behind:
                        client.unresponsive = True
                        log.warning("API server %d is %d messages behind; not waiting for it until it catches up",
                                    client.api_server_id, client.num_outputs_sent - client.num_outputs_done)

    async def _admit_arrivals(self) -> None:
        """After a step, give the event loop turns while new requests keep arriving.

        Requests reach the core a few loop turns after their API server sends them. Against a fast
        worker the engine would step on nearly every turn and let requests in about one per step,
        and every token would carry a share of the per-step plan, result and message costs. Here
        the engine waits up to ``admission_turns`` turns, and stops after QUIET_TURNS turns with no
        new request, or once the batch is full. The worker meanwhile executes the plan in flight,
        so it does not idle unless its step is shorter than these turns; only the overlapped loop
        calls this."""
        scheduler = self.engine.scheduler
        limit = self.engine.config.max_num_seqs
        quiet = 0
        for _ in range(self.settings.admission_turns):
            if scheduler.num_running + scheduler.num_waiting >= limit:
                return
            before = self.num_submitted
            await asyncio.sleep(0)
            if self.num_submitted != before:
                quiet = 0
            else:
                quiet += 1
                if quiet == QUIET_TURNS:
                    return

    def _deliver(self, step: StepTokens) -> None:
        # KV events ride in the step's message to each subscribed API server, alone where it has none
        batch = self._kv_events_batch() if self._kv_subscribers else None
        if batch is None:
            deliver(step, self._clients)
            return
        subscribers = [self._clients[i] for i in self._kv_subscribers]
        for client in subscribers:
            client.outputs.kv_events = batch
        deliver(step, self._clients)
        for client in subscribers:
            if client.outputs.kv_events is not None:  # deliver had nothing else for it
                client.flush()

    # ---- KV events ---------------------------------------------------------------------------

    def _subscribe_kv_events(self, client: ApiClient, on: bool) -> None:
        """The API server has SubscribeKVEvents streams, or none left; the allocator records events
        while any API server has."""
        if on:
            self._kv_subscribers.add(client.api_server_id)
        else:
            self._kv_subscribers.discard(client.api_server_id)
        if self.engine is not None:
            self.engine.allocator.record_kv_events(bool(self._kv_subscribers))

    def _kv_events_batch(self) -> KVEventBatch | None:
        """The allocator's events since the last batch, as the next batch; None if there are none."""
        events = self.engine.allocator.take_kv_events() if self.engine is not None else []
        if not events:
            return None
        self._kv_seq += 1
        return KVEventBatch(CORE_INDEX, self._kv_seq, events)

    def _send_kv_events(self) -> None:
        """Send the events not sent yet, alone, to the subscribed API servers."""
        batch = self._kv_events_batch()
        if batch is not None:
            for api_server_id in self._kv_subscribers:
                client = self._clients[api_server_id]
                client.outputs.kv_events = batch
                client.flush()

    def _broadcast_worker_state(self) -> None:
        for client in self._clients.values():
            try:
                client.send(self.worker_state_message(client))
            except LinkClosed:
                pass

    def _worker_lost(self, message: str) -> None:
        log.error("lost the worker: %s; failing in-flight requests and reconnecting", message)
        self.connected.clear()
        self._on_health(False)
        self._link.close_stream()
        if self.engine is not None:
            self.engine.reset()
        text = f"worker unavailable: {message}"
        for client in self._clients.values():
            for request_id in sorted(client.request_ids):
                client.error(request_id, grpc.StatusCode.UNAVAILABLE, text)
            client.request_ids.clear()
        for client in self._clients.values():
            if client.has_output:
                client.flush()
        if self._kv_subscribers:
            self._send_kv_events()  # the reset's AllBlocksCleared
        self._broadcast_worker_state()

