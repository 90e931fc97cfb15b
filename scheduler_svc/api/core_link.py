"""An API server's link to one engine core: its ``Connect`` stream and the requests it carries.

An API server holds one ``CoreLink`` per engine core (one, or ``--data-parallel-size`` and
``--data-parallel-cores`` of them). A link sends its requests to its core over the frame link of
one ``Connect`` call and turns the core's per-step token arrays into each client's stream. Its
request ids are its own: the core gives the high half (this API server's id on that core), the
link counts the low half. It reconnects with a back-off whenever the stream ends; a lost core
fails only the requests of its link (UNAVAILABLE), and the router leaves it out until it is back.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time

import grpc

from pagewire_common import step_profile
from pagewire_common.core_messages import (
    CoreOutputs,
    CoreRequests,
    NewRequest,
    first_request_id,
)
from pagewire_common.eventloop import Outbox
from pagewire_common.framelink import CHANNEL_OPTIONS, LinkClosed, LinkSession
from pagewire_common.logs import WaitingNote
from pagewire_common.v1 import core_pb2, core_pb2_grpc
from pagewire_common.v1 import generation_pb2 as pb
from scheduler_svc.api.request import ApiRequest, Failure, NotReadyError, StreamOutbox
from scheduler_svc.api.text_stream import OutputProcessor

log = logging.getLogger("pagewire.api")

_CODES = {code.value[0]: code for code in grpc.StatusCode}
# how often a link asks its core for its running and waiting requests (all API servers' requests)
LOAD_POLL_S = 0.5
# a stream that leaves its part of a core message untaken this long (its client reads slowly, so
# its handler waits on a full socket) no longer holds up the acknowledgement, and so the core and
# every other stream; well under the core's BACKPRESSURE_TIMEOUT_S, after which it would stop
# waiting for this whole server
LAGGING_STREAM_S = 0.25


class _Pending:
    """A request (sample) in flight: where its deltas go, and the request they belong to."""

    __slots__ = ("outbox", "request", "n")

    def __init__(self, outbox: Outbox, request: ApiRequest | None, n: int):
        self.outbox = outbox
        self.request = request
        self.n = n  # the request's number of samples


class CoreLink:
    """One engine core as an API server sees it: the stream, and the requests (samples) in flight
    on it."""

    def __init__(self, server, index: int, core_address: str):
        self.server = server  # the ApiServer (server.py) that holds the links: model, router, KV-event streams
        self.index = index  # the core's place in the API server's list: its index in GetLoads and KV events
        self.core_address = core_address
        self.metrics = server.metrics
        self._channel = grpc.aio.insecure_channel(core_address, options=CHANNEL_OPTIONS)
        self._stub = core_pb2_grpc.SchedulerCoreStub(self._channel)
        self._session: LinkSession | None = None
        # request ids: this server's id from the core (in the high half), then a counter
        self._api_server_id = 0
        self._request_ids = itertools.count(first_request_id(0))
        self.pending: dict[int, _Pending] = {}  # request id (one per sample) -> where its deltas go
        self.output = OutputProcessor(None, server.stream_interval)  # their text streams
        self.info: core_pb2.CoreInfoResponse | None = None  # the core's limits, once its worker is up
        self.core_connected = False
        self.worker_connected = False
        self.draining = False  # the core is shutting down: it takes no new requests
        self.waiting_for_model = False  # up, but waiting for a first core to say which model is served
        self.mismatched = False  # its worker serves another model, or the same with other limits: no requests
        self.worker_generation = 0
        self.is_serving = False  # core link up, worker up, model adopted: requests may come here
        self._out = CoreRequests()  # queued for the core until the next turn of the loop
        # the public Abort: what each name sent to the core waits on (the core replies in order)
        self._abort_waiters: dict[str, list[asyncio.Future]] = {}
        self._flush_wanted = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._stopping = False
        self._said_ready = False
        # core messages with tokens: dispatched to their streams, taken by every stream, told to the core
        self._num_outputs_dispatched = self._num_outputs_done = self._num_outputs_acked = 0
        # streams with something put on their outbox and not yet taken -> when it was put there
        # (the dispatch of its message began), oldest first; one timer lets go of the laggards
        self._undelivered: dict[StreamOutbox, float] = {}
        self._dispatched_at = 0.0
        self._lag_check: asyncio.TimerHandle | None = None
        self._handed_on_ns = 0  # profiling: when the last message's deltas were handed on, until all are taken
        # the core's running + waiting requests at its last report, and how many of them were ours then
        self._reported_load = self._own_at_report = 0

    # ---- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._run(), name=f"pagewire-core-link-{self.index}"),
                       loop.create_task(self._write_loop(), name=f"pagewire-core-writer-{self.index}"),
                       loop.create_task(self._poll_load(), name=f"pagewire-core-load-{self.index}")]

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

    @property
    def load(self) -> int:
        """Running + waiting requests on the core: ours now, plus the other API servers' at the
        core's last report."""
        own = len(self.pending)
        return own + max(0, self._reported_load - self._own_at_report)

    def has_room(self, load: int, n: int) -> bool:
        """Whether the core can take ``n`` more sequences beside ``load`` without refusing them:
        under ``max_num_seqs``, or in its queue (``--max-queued-requests``; 0: no queue)."""
        info = self.info
        if info is None or not info.max_num_seqs:
            return True
        queue = info.max_queued_requests if info.HasField("max_queued_requests") else 0
        return load + n <= info.max_num_seqs + queue

    async def stats(self) -> pb.Stats:
        self.flush()  # rejections counted here reach the core first
        return await self._stub.CoreStats(pb.StatsRequest(), timeout=5)

    async def _poll_load(self) -> None:
        while True:
            await asyncio.sleep(LOAD_POLL_S)
            if not self.core_connected or self.server.num_cores == 1:
                continue
            own = len(self.pending)
            try:
                stats = await self._stub.CoreStats(pb.StatsRequest(), timeout=2)
            except grpc.RpcError:
                continue
            self._reported_load, self._own_at_report = stats.num_running + stats.num_waiting, own

    # ---- requests ------------------------------------------------------------------------------

    def want_kv_events(self, on: bool) -> None:
        """Ask the core for its KV events (SubscribeKVEvents streams, or the router, need them)."""
        self._out.kv_events = on
        self._flush_wanted.set()

    def reject(self) -> None:
        """Count a request the API server refused (the core's Stats report it)."""
        self._out.num_rejected += 1
        self._flush_wanted.set()

    def submit(self, name: str, token_ids: list[int], sampling, outbox: Outbox,
               request: ApiRequest | None = None) -> int:
        """Hand a request to the core; returns its id (``name`` is what the client calls it).
        ``ValueError``, with nothing queued, for a request its message cannot carry."""
        if not self.is_serving:
            raise NotReadyError("the engine core is shutting down" if self.draining and self.core_connected
                                else "the worker is not connected" if self.core_connected
                                else "the scheduler core is not connected")
        request_id = next(self._request_ids)
        # n > 1: the samples are the n consecutive ids from this one, each with its own stream
        for _ in range(1, sampling.n):
            next(self._request_ids)
        encoded = CoreRequests.encode_add(NewRequest(request_id, token_ids, sampling, name, self.server.num_cores > 1))
        self.output.add(request_id, name, token_ids, sampling)
        for index in range(sampling.n):
            self.pending[request_id + index] = _Pending(outbox, request, sampling.n)
        self._out.encoded_adds.append(encoded)
        self._flush_wanted.set()
        return request_id

    def abort(self, request_id: int) -> None:
        """The client went away (cancelled, deadline): the core frees the request's blocks."""
        if self.pending.pop(request_id, None) is not None:
            self.output.remove(request_id)
            self._out.abort_ids.append(request_id)
            self._flush_wanted.set()

    def fail_pending(self, code: grpc.StatusCode, message: str) -> None:
        """End every request in flight here: aborted in the core, failed to its client with ``code``
        (one failure a request: its samples share its outbox)."""
        outboxes = {pending.outbox: None for pending in self.pending.values()}
        for request_id in list(self.pending):
            self.abort(request_id)
        failure = Failure(code, message)
        self.begin_dispatch()  # what it puts on the streams waits from now
        for outbox in outboxes:
            outbox.put_nowait(failure)
        self.flush()

    def flush(self) -> None:
        """Send what is queued for the core now."""
        if self._session is None or not self._has_queued():
            return
        try:
            self._write_one()
        except LinkClosed as e:
            # the session is broken: end it, so the reader fails what is in flight and reconnects
            log.warning("write to the scheduler core %s failed: %s", self.core_address, e)
            self._session.close()

    def abort_named(self, name: str) -> asyncio.Future:
        """The public Abort on this core: the future says whether a request ran under ``name``."""
        if not self.core_connected:
            raise NotReadyError("the scheduler core is not connected")
        future = asyncio.get_running_loop().create_future()
        self._abort_waiters.setdefault(name, []).append(future)
        self._out.abort_names.append(name)
        self._flush_wanted.set()
        return future

    def _has_queued(self) -> bool:
        out = self._out
        return bool(out.encoded_adds or out.adds or out.abort_ids or out.stop_ids or out.abort_names or out.num_rejected
                    or out.ready
                    or self._num_outputs_done != self._num_outputs_acked or out.kv_events is not None)

    async def _write_loop(self) -> None:
        # everything queued during one turn of the loop (adds, aborts, stops, the acknowledgement)
        # goes to the core as one message
        while True:
            await self._flush_wanted.wait()
            self._flush_wanted.clear()
            try:
                self.flush()
            except Exception:  # a bug: the turn's message is lost, so end the session rather than wedge it
                log.exception("sending to the scheduler core %s failed; reconnecting", self.core_address)
                if self._session is not None:
                    self._session.close()

    def _write_one(self) -> None:
        msg, self._out = self._out, CoreRequests()
        msg.num_outputs_done = self._num_outputs_acked = self._num_outputs_done
        self._session.write(msg.to_bytes())

    # ---- the session -----------------------------------------------------------------------------

    async def _run(self) -> None:
        backoff = 0.2
        waiting = WaitingNote(log, f"the scheduler core at {self.core_address}")
        while not self._stopping:
            try:
                await self._serve_link()
                backoff = 0.2
            except asyncio.CancelledError:
                raise
            except (grpc.RpcError, LinkClosed) as e:
                log.debug("core link %s: %s", self.core_address, e)
                if self.core_connected:
                    waiting.reset()  # it was up: the wait starts now
                else:
                    waiting.note(e.details() if isinstance(e, grpc.RpcError) else str(e))
            except Exception:
                log.exception("core link %s failed", self.core_address)
            self._link_lost("the scheduler core is unavailable" if self.server.num_cores == 1
                            else f"engine core {self.index} ({self.core_address}) is unavailable")
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 2.0)

    async def _serve_link(self) -> None:
        info = await self._stub.CoreInfo(core_pb2.CoreInfoRequest(), timeout=5, wait_for_ready=True)
        self._session = await LinkSession.open(self.core_address, info.frame_link, self._stub.Connect)
        self._said_ready = False
        self._num_outputs_dispatched = self._num_outputs_done = self._num_outputs_acked = 0
        self._reported_load = self._own_at_report = 0
        self.core_connected = True
        log.info("connected to the scheduler core at %s", self.core_address)
        if self.server.wants_kv_events:  # subscribed (or routing by cache) while the link was coming up
            self.want_kv_events(True)
        while True:
            data = await self._session.read()
            with step_profile.phase("outputs decode"):
                msg = CoreOutputs.from_bytes(data)
            if msg.has_worker_state:
                await self._worker_state(msg)
            self.begin_dispatch()
            self.dispatch(msg)
            if msg.kv_events is not None:
                msg.kv_events.core_index = self.index
                self.server.core_kv_events(self.index, msg.kv_events)
            if msg.has_tokens:
                self.handed_on()
                step_profile.end_step(len(msg.request_ids))  # a step of the API server: a message with tokens

    async def _worker_state(self, msg: CoreOutputs) -> None:
        if msg.api_server_id and msg.api_server_id != self._api_server_id:
            # a session's first message names this server's ids from now on; every later state
            # message repeats it, and counting again from the first would reuse the ids of
            # requests still running
            self._api_server_id = msg.api_server_id
            self._request_ids = itertools.count(first_request_id(msg.api_server_id))
        self.worker_connected = msg.worker_connected
        if msg.draining and not self.draining:
            log.info("engine core %d (%s) is shutting down: it finishes its running requests and takes no new ones",
                     self.index, self.core_address)
        self.draining = msg.draining
        if msg.worker_connected and not msg.draining:
            if self.info is None or msg.worker_generation != self.worker_generation:
                info = await self._stub.CoreInfo(core_pb2.CoreInfoRequest(), timeout=10)
                self.worker_generation = msg.worker_generation
                self.info = info
        await self.adopt()

    async def adopt(self) -> None:
        """Take requests when the core's worker is up and the server serves its model (which
        ``ApiServer.adopt_model`` decides); otherwise take none."""
        serving = mismatched = False
        if self.worker_connected and not self.draining and self.info is not None:
            model = await self.server.adopt_model(self)
            if model is not None:
                self.output.tokenizer = model.tokenizer
                serving = True
            else:
                mismatched = not self.waiting_for_model
        self.mismatched = mismatched
        self._set_serving(serving)
        if serving and not self._said_ready:
            self._said_ready = True
            self._out.ready = True
            self._flush_wanted.set()

    def _set_serving(self, serving: bool) -> None:
        if serving != self.is_serving:
            self.is_serving = serving
            self.server.link_changed(self)

    def begin_dispatch(self) -> None:
        """A core message is about to be dispatched: what it puts on a stream waits from now."""
        self._dispatched_at = time.monotonic()

    def handed_on(self) -> None:
        """A core message with tokens was dispatched to its streams: it is done once every one
        took its part (``delivered``), or at once if none has anything waiting."""
        self._num_outputs_dispatched += 1
        if not self._undelivered:
            self._all_delivered()
        elif self._lag_check is None:
            self._check_lag_at(next(iter(self._undelivered.values())) + LAGGING_STREAM_S)

    @property
    def num_outputs_done(self) -> int:
        """Core messages with tokens that every stream took its part of (or was let go from)."""
        return self._num_outputs_done

    def note_undelivered(self, outbox: StreamOutbox) -> None:
        """A stream has something put on its outbox that its handler has not taken yet."""
        self._undelivered[outbox] = self._dispatched_at

    def delivered(self, outbox: StreamOutbox) -> None:
        """A stream took what was put on it; once none has anything waiting, every core message
        dispatched so far is done (the core runs at the pace this server streams)."""
        self._undelivered.pop(outbox, None)
        if not self._undelivered:
            self._all_delivered()

    def _check_lag_at(self, when: float) -> None:
        self._lag_check = asyncio.get_running_loop().call_later(max(0.0, when - time.monotonic()),
                                                                 self._let_laggards_go)

    def _let_laggards_go(self) -> None:
        """The streams that have held a part for ``LAGGING_STREAM_S`` stop holding up the
        acknowledgement; the timer is set again for the next one to come due while an
        acknowledgement waits (one timer: it is not cancelled when all deliver in time)."""
        self._lag_check = None
        due = time.monotonic() - LAGGING_STREAM_S
        laggards = []
        for outbox, since in self._undelivered.items():  # oldest first
            if since > due:
                break
            laggards.append(outbox)
        for outbox in laggards:
            del self._undelivered[outbox]
            outbox.lag()
        if laggards:
            log.debug("%d stream(s) read slowly; the others are not held up by them", len(laggards))
        if not self._undelivered:
            self._all_delivered()
        elif self._num_outputs_done != self._num_outputs_dispatched:
            self._check_lag_at(next(iter(self._undelivered.values())) + LAGGING_STREAM_S)

    def _all_delivered(self) -> None:
        if self._num_outputs_done != self._num_outputs_dispatched:
            self._num_outputs_done = self._num_outputs_dispatched
            self._flush_wanted.set()
            profile = step_profile.active()
            if self._handed_on_ns and profile is not None:  # the handlers' turns since the deltas were handed on
                profile.add("handlers", time.perf_counter_ns() - self._handed_on_ns)
            self._handed_on_ns = 0

    def _link_lost(self, message: str) -> None:
        if self._session is not None:
            self._session.close()
            self._session = None
        was_connected = self.core_connected
        self.core_connected = False
        self.worker_connected = False
        self.draining = False
        self.waiting_for_model = self.mismatched = False
        self.info = None
        self._set_serving(False)
        if was_connected:
            self.server.core_lost(self, message)
        self._out = CoreRequests()
        pending, self.pending = self.pending, {}
        self.output.streams.clear()
        self._num_outputs_dispatched = self._num_outputs_done = self._num_outputs_acked = 0
        self._handed_on_ns = 0
        if self._lag_check is not None:
            self._lag_check.cancel()
            self._lag_check = None
        for outbox in self._undelivered:  # the session's: its failure or its deltas, not its pace
            outbox.lag()
        self._undelivered.clear()
        failure = Failure(grpc.StatusCode.UNAVAILABLE, message)
        self.begin_dispatch()
        for outbox in {p.outbox: None for p in pending.values()}:  # one a request: its samples share it
            outbox.put_nowait(failure)
        waiters, self._abort_waiters = self._abort_waiters, {}
        for future in (f for futures in waiters.values() for f in futures):
            if not future.done():
                future.set_exception(NotReadyError(message))

    def dispatch(self, msg: CoreOutputs) -> None:
        """Apply one step's outputs from the core to this link's streams. Step profile phases:
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
