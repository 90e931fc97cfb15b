"""The load generator: prompts, arrival schedules, and an asyncio gRPC client that records
per-request timestamps.

One event loop and one ``grpc.aio`` channel drive every stream. Requests are built as protobuf
messages before the clock starts; while a run is in flight the only per-response work is one
``perf_counter()`` and two list appends, so the client stays far from being the bottleneck.
Two arrival modes:

- closed loop (``concurrency``): that many streams are kept in flight; a new request is sent as
  soon as one finishes;
- open loop (``arrival_offsets``): request ``i`` is sent at ``offsets[i]`` seconds after the
  start whatever is in flight (Poisson arrivals come from :func:`poisson_offsets`).
"""

from __future__ import annotations

import asyncio
import gc
import multiprocessing
import random
from collections.abc import Sequence
from time import perf_counter, process_time
from typing import NamedTuple

import grpc

from pagewire.client import ServerAccess
from pagewire_common import eventloop
from pagewire.bench.metrics import RequestRecord
from pagewire_common.v1 import generation_pb2 as pb
from pagewire_common.v1 import generation_pb2_grpc

MAX_MESSAGE_BYTES = 64 * 1024 * 1024


class ServerUnreachable(RuntimeError):
    """No pagewire server answers at the address."""


class LoadResult(NamedTuple):
    """One run as the client saw it."""

    records: list[RequestRecord]  # one per request, in request order
    duration_s: float  # wall time from the start to the last response
    client_cpu_fraction: float  # CPU time of the busiest client process / its wall time (1.0 = a full core)


def run_rng(seed: int, run_index: int, purpose: str) -> random.Random:
    """A generator for one run's prompts or arrivals: the same seed gives the same workload in
    every invocation (and to every engine compared), and runs differ from each other so a run
    does not hit the prefix cache that the previous one left behind."""
    return random.Random(f"pagewire-bench:{purpose}:{seed}:{run_index}")


def prompt_lengths(n: int, length_range: tuple[int, int], rng: random.Random) -> list[int]:
    """``n`` lengths drawn uniformly from the inclusive range (all equal for a fixed length)."""
    lo, hi = length_range
    return [lo] * n if lo == hi else [rng.randint(lo, hi) for _ in range(n)]


def random_prompts(
    n: int, length_range: tuple[int, int], vocab_size: int, excluded_ids: set[int] | frozenset[int], rng: random.Random
) -> list[list[int]]:
    """``n`` prompts of random token ids in ``[0, vocab_size)`` minus ``excluded_ids`` (special
    tokens: an EOS inside a prompt or a chat marker would make the workload unrepresentative)."""
    allowed = [t for t in range(vocab_size) if t not in excluded_ids]
    if not allowed:
        raise ValueError("no ordinary token id to build random prompts from")
    return [rng.choices(allowed, k=length) for length in prompt_lengths(n, length_range, rng)]


def text_prompts(n: int, text: str, repeats: Sequence[int]) -> list[str]:
    """Request ``i`` gets ``text`` repeated ``repeats[i % len(repeats)]`` times (concatenated as
    is), e.g. repeats (1, 4) alternates a short prompt with one that starts with it."""
    return [text * repeats[i % len(repeats)] for i in range(n)]


def word_prompts(n: int, num_tokens: int, tokenizer, rng: random.Random) -> list[str]:
    """``n`` distinct texts of exactly ``num_tokens`` tokens under ``tokenizer`` (anything with
    ``vocab_size``, ``decode(ids)`` and ``encode(text)``), to send as text to servers that tokenize
    for themselves: runs of words that are each one token of the vocabulary (a space and at least
    three lowercase ASCII letters), every text checked by encoding it."""
    words = sorted({w for w in (tokenizer.decode([i]) for i in range(tokenizer.vocab_size))
                    if len(w) >= 4 and w[0] == " " and w[1:].isascii() and w[1:].isalpha() and w[1:].islower()})
    if len(words) < num_tokens:
        raise ValueError(f"the tokenizer has {len(words)} one-token words, fewer than {num_tokens}")
    prompts: list[str] = []
    seen: set[str] = set()
    for _ in range(100 * n):
        text = "".join(rng.sample(words, num_tokens))
        if text not in seen and len(tokenizer.encode(text)) == num_tokens:
            seen.add(text)
            prompts.append(text)
            if len(prompts) == n:
                return prompts
    raise ValueError(f"found only {len(prompts)} of {n} texts of exactly {num_tokens} tokens")


def poisson_offsets(n: int, rate: float, rng: random.Random) -> list[float]:
    """Send times (seconds from the start) of ``n`` Poisson arrivals at ``rate`` requests/s; the
    first request goes out at 0."""
    offsets = [0.0]
    t = 0.0
    for _ in range(n - 1):
        t += rng.expovariate(rate)
        offsets.append(t)
    return offsets[:n]


def build_requests(
    prompts: Sequence[list[int] | str], sampling: pb.SamplingParams, model_name: str = ""
) -> list[pb.GenerateRequest]:
    """One request per prompt (text or token ids), built before the clock starts."""
    out = []
    for i, p in enumerate(prompts):
        req = pb.GenerateRequest(request_id=f"bench-{i}", sampling=sampling, model=model_name)
        if isinstance(p, str):
            req.prompt = p
        else:
            req.prompt_token_ids.extend(p)
        out.append(req)
    return out


class _AddMetadata:
    """Adds ``metadata`` (the API key) to a channel's calls. A channel files each interceptor under
    the first kind of call it serves, so each kind has a class of its own."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]):
        self.metadata = metadata

    def _with(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        return grpc.aio.ClientCallDetails(details.method, details.timeout, (*(details.metadata or ()), *self.metadata),
                                          details.credentials, details.wait_for_ready)


class _UnaryMetadata(_AddMetadata, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._with(details), request)


class _StreamMetadata(_AddMetadata, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self._with(details), request)


class Client:
    """An asyncio client of one pagewire server: its streams spread round-robin over
    ``connections`` TCP connections (the kernel hands each connection to one of the server's API
    servers, so one connection would measure one API server)."""

    def __init__(self, addr: str, connections: int = 1, access: ServerAccess = ServerAccess()):
        if connections < 1:
            raise ValueError(f"connections must be >= 1, got {connections}")
        self.addr = addr
        options = [
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            # a connection of its own, not one shared with the other channels to addr
            ("grpc.use_local_subchannel_pool", 1),
        ]
        # the key rides on every call (a server started with --api-key); no interceptor without one
        metadata = access.metadata()
        interceptors = [_UnaryMetadata(metadata), _StreamMetadata(metadata)] if metadata else None
        credentials = access.credentials()
        self.channels = [
            grpc.aio.insecure_channel(addr, options=options, interceptors=interceptors) if credentials is None
            else grpc.aio.secure_channel(addr, credentials, options=options, interceptors=interceptors)
            for _ in range(connections)
        ]
        self.channel = self.channels[0]
        self.stubs = [generation_pb2_grpc.GenerationStub(c) for c in self.channels]
        self.stub = self.stubs[0]

    async def close(self) -> None:
        for channel in self.channels:
            await channel.close()

    async def wait_ready(self, timeout: float) -> pb.ModelInfo:
        """Wait until the server answers and its worker is connected; return its model info.
        Raises :class:`ServerUnreachable` after ``timeout`` seconds."""
        deadline = asyncio.get_running_loop().time() + timeout
        try:
            await asyncio.wait_for(self.channel.channel_ready(), timeout)
        except asyncio.TimeoutError:
            raise ServerUnreachable(
                f"no server answers at {self.addr} (waited {timeout:g}s); start one with `pagewire serve`, "
                f"point --addr at it, or pass --serve to let the bench start one"
            ) from None
        last_error = ""
        while True:
            remaining = deadline - asyncio.get_running_loop().time()
            try:
                return await self.stub.GetModelInfo(pb.ModelInfoRequest(), timeout=max(1.0, remaining))
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                    raise ServerUnreachable(f"the server at {self.addr} is not a pagewire server ({e.details()})") from None
                if e.code() == grpc.StatusCode.UNAUTHENTICATED:  # waiting will not change it
                    raise ServerUnreachable(f"the server at {self.addr} refused the bench: {e.details()} (give its "
                                            "key with --api-key or PAGEWIRE_API_KEY)") from None
                last_error = f"{e.code().name}: {e.details()}"
            if remaining <= 0:
                raise ServerUnreachable(f"the server at {self.addr} is not ready after {timeout:g}s ({last_error})")
            await asyncio.sleep(0.2)

    async def get_stats(self, timeout: float = 10.0) -> pb.Stats:
        """The server's counters (``GetStats``); raises ``grpc.aio.AioRpcError``."""
        return await self.stub.GetStats(pb.StatsRequest(), timeout=timeout)

    async def run(
        self,
        requests: Sequence[pb.GenerateRequest],
        *,
        concurrency: int | None = None,
        arrival_offsets: Sequence[float] | None = None,
        request_timeout: float | None = None,
        progress=None,
        start_at: float | None = None,
    ) -> LoadResult:
        """Send ``requests`` (closed loop with ``concurrency`` streams, or open loop at
        ``arrival_offsets``); return one record per request, in order, and the wall time from the
        start to the last response. The start is now, or the ``perf_counter()`` time ``start_at``
        (several client processes share one start: the clock is the system's monotonic clock).
        ``progress`` (anything with ``update(n)``) is advanced per finished request."""
        if (concurrency is None) == (arrival_offsets is None):
            raise ValueError("give exactly one of concurrency and arrival_offsets")
        n = len(requests)
        records = [RequestRecord() for _ in range(n)]
        generates = [stub.Generate for stub in self.stubs]
        update = progress.update if progress is not None else (lambda k: None)

        async def one(i: int) -> None:
            rec = records[i]
            times = rec.arrival_times
            counts = rec.arrival_counts
            last = None
            rec.send_time = perf_counter()
            call = generates[i % len(generates)](requests[i], timeout=request_timeout)
            try:
                async for resp in call:
                    times.append(perf_counter())
                    counts.append(len(resp.token_ids))
                    last = resp
                rec.end_time = perf_counter()
            except grpc.aio.AioRpcError as e:
                rec.end_time = perf_counter()
                rec.error = e.code().name
                rec.error_message = e.details() or ""
            else:
                if last is not None and last.HasField("usage"):
                    u = last.usage
                    rec.prompt_tokens = u.prompt_tokens
                    rec.completion_tokens = u.completion_tokens
                    rec.cached_prompt_tokens = u.cached_prompt_tokens
                else:
                    rec.completion_tokens = sum(counts)
            update(1)

        duration, cpu = await drive(n, one, concurrency=concurrency, arrival_offsets=arrival_offsets,
                                    start_at=start_at)
        return LoadResult(records, duration, cpu)


async def drive(n: int, one, *, concurrency: int | None, arrival_offsets: Sequence[float] | None,
                start_at: float | None = None) -> tuple[float, float]:
    """Run ``one(i)`` for every request index, closed loop (``concurrency`` at a time) or open
    loop (each at its ``arrival_offsets``); return the wall time and the client's CPU fraction."""
    # the measured interval should not include collecting garbage made before it
    gc.collect()
    gc.freeze()
    if start_at is not None and start_at > perf_counter():
        await asyncio.sleep(start_at - perf_counter())
    start = perf_counter() if start_at is None else max(start_at, perf_counter())
    cpu_start = process_time()
    try:
        if concurrency is not None:
            indices = iter(range(n))

            async def stream_slot() -> None:
                for i in indices:  # shared iterator: each slot takes the next request
                    await one(i)

            await asyncio.gather(*(stream_slot() for _ in range(min(concurrency, n))))
        else:
            tasks = []
            for i, offset in enumerate(arrival_offsets):
                delay = start + offset - perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(i)))
            await asyncio.gather(*tasks)
        end = perf_counter()
        cpu = process_time() - cpu_start
    finally:
        gc.unfreeze()
    return end - start, cpu / (end - start) if end > start else 0.0


# ---- several client processes -----------------------------------------------------------------


class _Counter:
    """``update(n)`` on a shared ``multiprocessing.Value`` (the parent turns it into a progress bar)."""

    def __init__(self, value):
        self.value = value

    def update(self, n: int) -> None:
        with self.value.get_lock():
            self.value.value += n


def _client_process(conn, addr: str, counter, connections: int = 1, access: ServerAccess = ServerAccess()) -> None:
    """Body of one client process: connect, then run the shards the parent sends until ``None``."""

    async def serve() -> None:
        client = Client(addr, connections, access)
        loop = asyncio.get_running_loop()
        try:
            await asyncio.wait_for(client.channel.channel_ready(), 30)
            conn.send(("ready", None))
            while True:
                job = await loop.run_in_executor(None, conn.recv)
                if job is None:
                    return
                requests = [pb.GenerateRequest.FromString(b) for b in job["requests"]]
                result = await client.run(
                    requests,
                    concurrency=job["concurrency"],
                    arrival_offsets=job["offsets"],
                    request_timeout=job["request_timeout"],
                    progress=_Counter(counter),
                    start_at=job["start_at"],
                )
                conn.send(("done", result))
        finally:
            await client.close()

    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and closes the pool
    try:
        eventloop.run(serve())
    except Exception as e:  # report instead of dying silently
        try:
            conn.send(("error", f"{type(e).__name__}: {e}"))
        except OSError:
            pass


class ClientPool:
    """``num_processes`` client processes that share each run: request ``i`` goes to process
    ``i % num_processes``; closed-loop concurrency is split evenly; open-loop requests keep their
    send times, so together they make the same schedule. All start at one ``perf_counter()``
    instant (a shared monotonic clock), so their timestamps are comparable."""

    def __init__(self, addr: str, num_processes: int, ready_timeout: float = 60.0, connections: int = 1,
                 access: ServerAccess = ServerAccess()):
        if num_processes < 2:
            raise ValueError("a ClientPool needs at least 2 processes (use Client for one)")
        # spawn, not fork: a forked gRPC runtime is not safe to use
        ctx = multiprocessing.get_context("spawn")
        self.counter = ctx.Value("q", 0)
        self.conns = []
        self.procs = []
        for k in range(num_processes):
            parent_end, child_end = ctx.Pipe()
            proc = ctx.Process(target=_client_process, args=(child_end, addr, self.counter, connections, access),
                               name=f"pagewire-bench-client-{k}", daemon=True)
            proc.start()
            child_end.close()
            self.conns.append(parent_end)
            self.procs.append(proc)
        for k, conn in enumerate(self.conns):
            if not conn.poll(ready_timeout):
                self.close()
                raise ServerUnreachable(f"client process {k} did not connect to {addr} within {ready_timeout:g}s")
            kind, detail = conn.recv()
            if kind != "ready":
                self.close()
                raise ServerUnreachable(f"client process {k} failed: {detail}")

    @property
    def num_processes(self) -> int:
        return len(self.procs)

    async def run(
        self,
        requests: Sequence[pb.GenerateRequest],
        *,
        concurrency: int | None = None,
        arrival_offsets: Sequence[float] | None = None,
        request_timeout: float | None = None,
        progress=None,
    ) -> LoadResult:
        """Like :meth:`Client.run`, over all the processes."""
        if (concurrency is None) == (arrival_offsets is None):
            raise ValueError("give exactly one of concurrency and arrival_offsets")
        n = len(requests)
        num = self.num_processes
        shards = [list(range(k, n, num)) for k in range(num)]
        jobs = []
        for k, shard in enumerate(shards):
            if not shard:
                continue
            jobs.append((k, shard, {
                "requests": [requests[i].SerializeToString() for i in shard],
                "concurrency": None if concurrency is None else max(1, concurrency // num + (k < concurrency % num)),
                "offsets": None if arrival_offsets is None else [arrival_offsets[i] for i in shard],
                "request_timeout": request_timeout,
            }))
        with self.counter.get_lock():
            self.counter.value = 0
        # far enough ahead that every process has its shard decoded before the common start
        start_at = perf_counter() + 0.3 + 2e-6 * n
        loop = asyncio.get_running_loop()
        waits = []
        for k, _shard, job in jobs:
            job["start_at"] = start_at
            self.conns[k].send(job)
            waits.append(loop.run_in_executor(None, self.conns[k].recv))
        reported = 0
        pending = set(waits)
        while pending:
            _done, pending = await asyncio.wait(pending, timeout=0.1)
            finished = self.counter.value
            if progress is not None and finished > reported:
                progress.update(finished - reported)
            reported = finished
        records: list[RequestRecord | None] = [None] * n
        duration = 0.0
        busiest = 0.0
        for (k, shard, _job), wait in zip(jobs, waits):
            kind, result = wait.result()
            if kind != "done":
                raise RuntimeError(f"client process {k} failed: {result}")
            for i, rec in zip(shard, result.records):
                records[i] = rec
            # every shard started at start_at (or as soon after as it could)
            duration = max(duration, result.duration_s)
            busiest = max(busiest, result.client_cpu_fraction)
        return LoadResult(records, duration, busiest)

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(None)
            except OSError:
                pass
        for proc in self.procs:
            proc.join(5)
            if proc.is_alive():
                proc.terminate()
                proc.join(5)
        for conn in self.conns:
            conn.close()
