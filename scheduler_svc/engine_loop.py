"""The scheduler's engine thread: owns EngineCore and the worker link.

gRPC handlers (on asyncio event loops) submit validated requests and aborts through a queue;
the thread schedules, exchanges plans and results with the worker, and hands each step's
outputs back to the event loops with one callback per loop per step. When the worker is lost,
every in-flight request fails with UNAVAILABLE, block accounting starts over, and the thread
reconnects in the background.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from pagewire.sampling import SamplingParams
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.engine import EngineCore, RequestOutput, WorkerInfo
from scheduler_svc.tokenizer import Tokenizer
from scheduler_svc.worker_client import WorkerLink, WorkerLinkError

log = logging.getLogger("pagewire.scheduler")


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
    # keep one plan in flight ahead of the worker (see _loop_once)
    overlap: bool = True


@dataclass(slots=True)
class WorkerLost:
    """Delivered to a request's sink when the worker went away mid-request."""

    message: str


@dataclass(slots=True)
class _Sink:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class EngineService:
    def __init__(self, worker_address: str, options: EngineOptions, on_health=None):
        self.worker_address = worker_address
        self.options = options
        self._on_health = on_health or (lambda serving: None)
        self._link = WorkerLink(worker_address)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, _Sink] = {}
        self._lock = threading.Lock()  # guards _sinks and the counters below
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pagewire-engine", daemon=True)
        self.engine: EngineCore | None = None
        self.tokenizer: Tokenizer | None = None
        self.worker_info: WorkerInfo | None = None
        self.connected = threading.Event()
        self.num_finished = 0
        self.num_aborted = 0
        self.num_steps = 0
        self.num_preemptions = 0
        self._num_queued = 0  # submitted, not yet admitted by the engine thread
        self._tmpdir = tempfile.TemporaryDirectory(prefix="pagewire-tokenizer-")

    # ---- called from gRPC handlers --------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._commands.put(("wake", None))
        self._thread.join(timeout)
        self._link.close()
        self._tmpdir.cleanup()

    def validate(self, prompt, prompt_token_ids, sampling: SamplingParams) -> list[int]:
        engine = self.engine
        if engine is None or not self.connected.is_set():
            raise NotReadyError("the worker is not connected")
        return engine.validate(prompt, prompt_token_ids, sampling, strict_length=True)

    def submit(self, request_id: str, token_ids: list[int], sampling: SamplingParams, sink_queue: asyncio.Queue) -> None:
        """Queue a validated request; its outputs (RequestOutput or WorkerLost) go to ``sink_queue``."""
        with self._lock:
            if request_id in self._sinks:
                raise ValueError(f"request id {request_id!r} is already in flight")
            waiting = self._num_queued + (self.engine.scheduler.num_waiting if self.engine else 0)
            if waiting >= self.options.max_queued_requests:
                raise QueueFullError(
                    f"the queue is full ({self.options.max_queued_requests} requests waiting); retry later"
                )
            self._sinks[request_id] = _Sink(asyncio.get_running_loop(), sink_queue)
            self._num_queued += 1
        self._commands.put(("add", (request_id, token_ids, sampling)))

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def stats(self) -> dict:
        engine = self.engine
        alloc = engine.allocator if engine else None
        return dict(
            num_total_blocks=alloc.num_blocks if alloc else 0,
            num_free_blocks=alloc.num_free_blocks if alloc else 0,
            num_cached_blocks=alloc.num_cached_blocks if alloc else 0,
            num_running=engine.scheduler.num_running if engine else 0,
            num_waiting=(engine.scheduler.num_waiting if engine else 0) + self._num_queued,
            num_requests_finished=self.num_finished,
            num_requests_aborted=self.num_aborted,
            worker_connected=self.connected.is_set(),
            num_steps=self.num_steps,
            num_preemptions=self.num_preemptions + (engine.scheduler.num_preemptions if engine else 0),
        )

    @property
    def num_in_flight(self) -> int:
        with self._lock:
            return len(self._sinks)

    # ---- the engine thread ---------------------------------------------------------------

    def _run(self) -> None:
        backoff = 0.2
        while not self._stop.is_set():
            if not self.connected.is_set():
                if self._connect():
                    backoff = 0.2
                else:
                    self._stop.wait(backoff)
                    backoff = min(backoff * 2, 2.0)
                continue
            try:
                self._loop_once()
            except WorkerLinkError as e:
                self._worker_lost(str(e))
            except Exception:  # a bug: fail what is in flight rather than hang it
                log.exception("engine step failed")
                self._worker_lost("internal error in the scheduler engine")

    def _connect(self) -> bool:
        try:
            info = self._link.info(timeout=2.0)
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
        )
        if self.engine is not None:
            self.num_preemptions += self.engine.scheduler.num_preemptions
        self.engine = EngineCore(config, worker_info, self._link, tokenizer)
        self.tokenizer = tokenizer
        self.worker_info = worker_info
        self.connected.set()
        self._on_health(True)
        log.info(
            "connected to worker %s: %s, %d KV blocks x %d tokens",
            self.worker_address, info.model_name, info.num_kv_blocks, info.block_size,
        )
        return True

    def _drain_commands(self, block: bool) -> None:
        engine = self.engine
        try:
            cmd = self._commands.get(timeout=0.05) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, arg = cmd
            if kind == "add":
                request_id, token_ids, sampling = arg
                with self._lock:
                    self._num_queued -= 1
                    alive = request_id in self._sinks
                if alive:
                    engine.add_request(request_id, prompt_token_ids=token_ids, sampling=sampling)
            elif kind == "abort":
                if engine.abort(arg):
                    with self._lock:
                        self._sinks.pop(arg, None)
                        self.num_aborted += 1
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _loop_once(self) -> None:
        engine = self.engine
        idle = not engine.has_unfinished() and not engine.num_in_flight
        self._drain_commands(block=idle)
        before = engine.num_in_flight
        outputs = engine.pipeline_step(self._link, max_in_flight=2 if self.options.overlap else 1)
        if engine.num_in_flight <= before:
            self.num_steps += 1  # a result came back
        if outputs:
            self._deliver(outputs)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        with self._lock:
            for out in outputs:
                sink = self._sinks.get(out.request_id)
                if sink is None:
                    continue
                if out.finished:
                    del self._sinks[out.request_id]
                    self.num_finished += 1
                by_loop.setdefault(sink.loop, []).append((sink.queue, out))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _worker_lost(self, message: str) -> None:
        log.error("lost the worker: %s; failing in-flight requests and reconnecting", message)
        self.connected.clear()
        self._on_health(False)
        self._link.close_stream()
        if self.engine is not None:
            self.num_preemptions += self.engine.scheduler.num_preemptions
            self.engine.reset()
            self.engine.scheduler.num_preemptions = 0
        # requests still in the command queue are failed too
        while True:
            try:
                self._commands.get_nowait()
            except queue.Empty:
                break
        with self._lock:
            sinks, self._sinks = self._sinks, {}
            self._num_queued = 0
        lost = WorkerLost(f"worker unavailable: {message}")
        by_loop: dict = {}
        for sink in sinks.values():
            by_loop.setdefault(sink.loop, []).append((sink.queue, lost))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)


def _put_all(items) -> None:
    for q, item in items:
        q.put_nowait(item)
