"""The scheduler's engine task: owns EngineCore and the worker link, on the event loop.

gRPC handlers and the engine share one asyncio event loop and one thread: a handler adds its
request to the engine directly and waits on its own queue; the engine task schedules, sends
plans and awaits results from the worker (the loop serves client streams meanwhile) and puts
each step's deltas on the requests' queues. No thread handoffs, no locks. When the worker is
lost, every in-flight request fails with UNAVAILABLE, block accounting starts over, and the
task reconnects.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from pagewire_common.sampling import SamplingParams
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.engine import EngineCore, RequestOutput, WorkerInfo
from scheduler_svc.tokenizer import Tokenizer
from scheduler_svc.worker_client import WorkerLink, WorkerLinkError

log = logging.getLogger("pagewire.scheduler")


# a new call needs two or three turns of the loop to reach its handler (EngineService._admit_arrivals)
QUIET_TURNS = 6


class QueueFullError(RuntimeError):
    pass


class NotReadyError(RuntimeError):
    pass


@dataclass(frozen=True, slots=True)
class EngineOptions:
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    enable_prefix_caching: bool = True
    max_queued_requests: int = 1024
    max_model_len: int | None = None
    # keep one plan in flight ahead of the worker (EngineCore.pipeline_step)
    overlap: bool = True
    # after the first token, stream a response once this many tokens are ready (or at the end)
    stream_interval: int = 1
    # after a step, the most event-loop turns given to calls still being accepted (EngineService._admit_arrivals)
    admission_turns: int = 32
    # spread prompt tokens over about this many steps while sequences decode (0: off; Scheduler._prefill_allowance)
    prefill_pacing_steps: int = 0

    def __post_init__(self) -> None:
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {self.stream_interval}")
        if self.admission_turns < 0:
            raise ValueError(f"admission_turns must be >= 0, got {self.admission_turns}")
        if self.prefill_pacing_steps < 0:
            raise ValueError(f"prefill_pacing_steps must be >= 0, got {self.prefill_pacing_steps}")


@dataclass(slots=True)
class WorkerLost:
    """Put on a request's queue when the worker went away mid-request."""

    message: str


class OutputStream:
    """One request's deltas, from the engine task to its handler on the same loop: the engine
    appends without waiting, and the handler takes everything that piled up at once. (An
    ``asyncio.Queue`` does the same with more bookkeeping per item, once per streamed message.)"""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: list = []
        self._waiter: asyncio.Future | None = None

    def put_nowait(self, item) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def take(self) -> list:
        """Wait for at least one item; return all that are there, oldest first."""
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        items, self._items = self._items, []
        return items


class EngineService:
    def __init__(self, worker_address: str, options: EngineOptions, on_health=None, link_factory=WorkerLink):
        self.worker_address = worker_address
        self._link_factory = link_factory  # address -> a WorkerLink (tests pass an in-process one)
        self.options = options
        self._on_health = on_health or (lambda serving: None)
        self._link: WorkerLink | None = None
        self._queues: dict[str, OutputStream] = {}
        self._wake = asyncio.Event()
        self._stopping = False
        self._task: asyncio.Task | None = None
        self.engine: EngineCore | None = None
        self.tokenizer: Tokenizer | None = None
        self.worker_info: WorkerInfo | None = None
        self.connected = asyncio.Event()
        self.num_submitted = 0
        self.num_finished = 0
        self.num_aborted = 0
        self.num_steps = 0
        self.num_preemptions = 0
        self._tmpdir = tempfile.TemporaryDirectory(prefix="pagewire-tokenizer-")

    # ---- called from gRPC handlers (same event loop) --------------------------------------

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
        if self._link is not None:
            await self._link.close()
        self._tmpdir.cleanup()

    def validate(self, prompt, prompt_token_ids, sampling: SamplingParams) -> list[int]:
        engine = self.engine
        if engine is None or not self.connected.is_set():
            raise NotReadyError("the worker is not connected")
        return engine.validate(prompt, prompt_token_ids, sampling, strict_length=True)

    def submit(self, request_id: str, token_ids: list[int], sampling: SamplingParams, queue: OutputStream) -> None:
        """Queue a validated request; its outputs (RequestOutput or WorkerLost) go to ``queue``."""
        engine = self.engine
        if engine is None or not self.connected.is_set():
            raise NotReadyError("the worker is not connected")
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in flight")
        if engine.scheduler.num_waiting >= self.options.max_queued_requests:
            raise QueueFullError(f"the queue is full ({self.options.max_queued_requests} requests waiting); retry later")
        engine.add_request(request_id, prompt_token_ids=token_ids, sampling=sampling)
        self._queues[request_id] = queue
        self.num_submitted += 1
        self._wake.set()

    def abort(self, request_id: str) -> None:
        """Cancel a request: its blocks are freed now; the worker drops it in the next plan."""
        if self._queues.pop(request_id, None) is not None and self.engine is not None:
            if self.engine.abort(request_id):
                self.num_aborted += 1
                self._wake.set()

    def stats(self) -> dict:
        engine = self.engine
        alloc = engine.allocator if engine else None
        return dict(
            num_total_blocks=alloc.num_blocks if alloc else 0,
            num_free_blocks=alloc.num_free_blocks if alloc else 0,
            num_cached_blocks=alloc.num_cached_blocks if alloc else 0,
            num_running=engine.scheduler.num_running if engine else 0,
            num_waiting=engine.scheduler.num_waiting if engine else 0,
            num_requests_finished=self.num_finished,
            num_requests_aborted=self.num_aborted,
            worker_connected=self.connected.is_set(),
            num_steps=self.num_steps,
            num_preemptions=self.num_preemptions + (engine.scheduler.num_preemptions if engine else 0),
        )

    @property
    def num_in_flight(self) -> int:
        return len(self._queues)

    # ---- the engine task -----------------------------------------------------------------

    async def _run(self) -> None:
        backoff = 0.2
        while not self._stopping:
            if not self.connected.is_set():
                if await self._connect():
                    backoff = 0.2
                else:
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
            self._link.open()
        except WorkerLinkError as e:
            log.debug("worker not reachable: %s", e)
            return False
        tok_dir = Path(self._tmpdir.name) / f"conn-{time.monotonic_ns()}"
        tok_dir.mkdir()
        for name, data in info.tokenizer_files.items():
            (tok_dir / Path(name).name).write_bytes(data)
        tokenizer = Tokenizer(tok_dir) if (tok_dir / "tokenizer.json").is_file() else None
        eos = tuple(info.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos:
            eos += (tokenizer.eos_token_id,)
        worker_info = WorkerInfo(
            model_name=info.model_name,
            vocab_size=info.vocab_size,
            max_model_len=info.max_model_len,
            block_size=info.block_size,
            num_kv_blocks=info.num_kv_blocks,
            eos_token_ids=eos,
            dtype=info.dtype,
            device=info.device,
        )
        opts = self.options
        config = SchedulerConfig(
            max_model_len=min(opts.max_model_len or info.max_model_len, info.max_model_len),
            max_num_batched_tokens=opts.max_num_batched_tokens,
            max_num_seqs=opts.max_num_seqs,
            enable_prefix_caching=opts.enable_prefix_caching,
            max_queued_requests=opts.max_queued_requests,
            prefill_pacing_steps=opts.prefill_pacing_steps,
        )
        if self.engine is not None:
            self.num_preemptions += self.engine.scheduler.num_preemptions
        self.engine = EngineCore(config, worker_info, None, tokenizer, stream_interval=opts.stream_interval)
        self.tokenizer = tokenizer
        self.worker_info = worker_info
        self.connected.set()
        self._on_health(True)
        log.info(
            "connected to worker %s: %s, %d KV blocks x %d tokens",
            self.worker_address, info.model_name, info.num_kv_blocks, info.block_size,
        )
        return True

    async def _serve_steps(self) -> None:
        """Run steps while connected; sleep when there is nothing to do."""
        engine, link = self.engine, self._link
        depth = 2 if self.options.overlap else 1
        admit = depth > 1 and self.options.admission_turns > 0
        while not self._stopping:
            if not engine.has_unfinished() and not engine.num_in_flight and not engine.scheduler.has_pending_drops():
                self._wake.clear()
                await self._wake.wait()
                continue
            plan = engine.next_plan(depth)
            if plan is not None:
                await link.send(plan)
            if engine.should_receive(plan is not None, depth):
                outputs = engine.on_result(await link.receive())
                self.num_steps += 1
                self._deliver(outputs)
                if admit:
                    await self._admit_arrivals()
            elif plan is None:
                # nothing to send and nothing outstanding (e.g. a request waits for blocks that
                # only an abort can free): let handlers run before trying again
                await asyncio.sleep(0.001)

    async def _admit_arrivals(self) -> None:
        """After a step, give the event loop turns while new requests keep arriving.

        grpc.aio accepts one call at a time and re-arms its accept from the event loop, so a new
        call takes two or three turns of the loop to reach its handler. Against a fast worker
        the engine would step on nearly every turn and let calls in about one per step: with
        256 streams open, steps held 60 sequences, and every token carried a share of the
        per-step plan, result and gRPC costs in both processes. Here the engine waits up to
        ``admission_turns`` turns, and stops after QUIET_TURNS turns with no new request, or once
        the batch is full. The worker meanwhile executes the plan in flight, so it does not idle
        unless its step is shorter than these turns; only the overlapped loop calls this.
        """
        scheduler = self.engine.scheduler
        limit = self.engine.config.max_num_seqs
        quiet = 0
        for _ in range(self.options.admission_turns):
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

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Put deltas on their requests' queues (the engine already applied stream_interval)."""
        queues = self._queues
        for out in outputs:
            queue = queues.get(out.request_id)
            if queue is None:
                continue
            if out.finished:
                del queues[out.request_id]
                self.num_finished += 1
            queue.put_nowait(out)

    def _worker_lost(self, message: str) -> None:
        log.error("lost the worker: %s; failing in-flight requests and reconnecting", message)
        self.connected.clear()
        self._on_health(False)
        self._link.close_stream()
        if self.engine is not None:
            self.num_preemptions += self.engine.scheduler.num_preemptions
            self.engine.reset()
            self.engine.scheduler.num_preemptions = 0
        queues, self._queues = self._queues, {}
        lost = WorkerLost(f"worker unavailable: {message}")
        for queue in queues.values():
            queue.put_nowait(lost)
