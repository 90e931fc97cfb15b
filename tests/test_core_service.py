"""The scheduler core (CoreService: engine task, API-server streams) on one event loop, against an
in-process worker.

Requests reach the core from its API servers' streams a turn of the event loop or two apart;
``_serve`` submits them that way, so these tests see what the engine task does with arrivals that
come in while it steps, and what each API server receives: one message per step.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest

from pagewire_common.core_messages import FINISH_CODES, CoreRequests, NewRequest, first_request_id
from pagewire_common.sampling import SamplingParams
from pagewire_common.settings import Settings
from scheduler_svc.core.service import BACKPRESSURE_TIMEOUT_S, ApiClient, CoreService
from scheduler_svc.core.worker_client import WorkerLinkError
from tests.fake_worker import EOS, VOCAB, FakeKVWorker, reference_tokens

BLOCK_SIZE = 4
NUM_BLOCKS = 2048


class InProcessLink:
    """The WorkerLink interface over a FakeKVWorker: plans execute when sent, and each result is
    read one loop turn later, as a fast worker's would be."""

    def __init__(self, address: str, submitted=lambda: 0, turns=lambda: 0):
        self.worker = FakeKVWorker(NUM_BLOCKS, BLOCK_SIZE)
        self.results: list = []
        self.plans = self.worker.plans
        self._submitted = submitted
        self.submitted_at_send: list[int] = []  # requests submitted so far, as each plan arrives
        self._turns = turns
        self.turn_at_send: list[int] = []  # event-loop turns so far, as each plan arrives
        self.fail: str | None = None
        self.num_opened = 0
        self._lost: str | None = None
        self._on_lost = None

    async def info(self, timeout: float = 5.0):
        return SimpleNamespace(
            model_name="fake", vocab_size=VOCAB, max_model_len=4096, block_size=BLOCK_SIZE,
            num_kv_blocks=NUM_BLOCKS, eos_token_ids=[EOS], dtype="float32", device="cpu", tokenizer_files={},
            structured_output=False,
        )

    async def open(self) -> None:
        self._lost = None
        self.num_opened += 1

    def on_lost(self, callback) -> None:
        self._on_lost = callback

    def lost(self) -> str | None:
        return self._lost

    def lose(self) -> None:
        """The session ends (the worker went away) with nothing read from it."""
        self._lost = "test: the worker went away while idle"
        self._on_lost()

    async def send(self, plan) -> None:
        self.submitted_at_send.append(self._submitted())
        self.turn_at_send.append(self._turns())
        self.results.append(self.worker.execute(plan))

    async def receive(self):
        await asyncio.sleep(0)
        if self.fail:
            raise WorkerLinkError(self.fail)
        return self.results.pop(0)

    def close_stream(self) -> None:
        pass

    async def close(self) -> None:
        pass


def _add(index: int, prompt: list[int], sampling: SamplingParams, name: str = "") -> NewRequest:
    """A request numbered ``index`` among its API server's (``_requests`` gives it that server's id)."""
    return NewRequest(index, prompt, sampling, name)


def _requests(client: ApiClient, adds=(), **fields) -> CoreRequests:
    """What an API server sends: its requests numbered from 0 take its ids (the core's id of the
    server in the high half), as ``ApiServer.submit`` gives them."""
    base = first_request_id(client.api_server_id)
    return CoreRequests(adds=[NewRequest(base + a.request_id, a.prompt_token_ids, a.sampling, a.name, a.passable)
                              for a in adds], **fields)


def _index(client: ApiClient, request_id: int) -> int:
    return request_id - first_request_id(client.api_server_id)


class Received:
    """What one API server got from the core: tokens per rid, finish reasons, errors, messages."""

    def __init__(self, service: CoreService | None = None, ack: bool = True):
        self.service = service if ack else None  # hands each step's outputs on, as an API server does
        self.num_done = 0
        self.tokens: dict[int, list[int]] = {}
        self.finished: dict[int, int] = {}
        self.errors: dict[int, tuple[int, str]] = {}
        self.abort_replies: list[tuple[str, bool]] = []
        self.num_messages = 0

    async def collect(self, client: ApiClient, expected: int):
        while len(self.finished) + len(self.errors) < expected:
            for msg in await client.outbox.take():
                if msg is None:
                    return
                self.num_messages += 1
                rids = [_index(client, i) for i in msg.request_ids.tolist()]
                assert len(rids) == len(set(rids)), "a request appears twice in one step's message"
                for rid, tok in zip(rids, msg.token_ids.tolist()):
                    self.tokens.setdefault(rid, []).append(tok)
                for rid, reason in zip(msg.finished_ids, msg.finish_reasons):
                    self.finished[_index(client, rid)] = FINISH_CODES[reason]
                for err in msg.errors:
                    self.errors[_index(client, err.request_id)] = (err.code, err.message)
                self.abort_replies.extend((r.name, r.found) for r in msg.abort_replies)
                if self.service is not None and msg.has_tokens:
                    self.num_done += 1
                    self.service.apply(client, _requests(client, num_outputs_done=self.num_done))


async def _serve(options: Settings, prompts: list[list[int]], max_tokens: int, per_turn: int = 1):
    """Submit ``per_turn`` requests per loop turn from one API server to a running core; return
    every request's tokens, the worker's link, and the engine."""
    links: list[InProcessLink] = []
    submitted = turns = 0

    def factory(address):
        links.append(InProcessLink(address, lambda: submitted, lambda: turns))
        return links[-1]

    async def count_turns():
        nonlocal turns
        while True:
            turns += 1
            await asyncio.sleep(0)

    counter = asyncio.ensure_future(count_turns())

    service = CoreService("in-process", options, link_factory=factory)
    service.start()
    await asyncio.wait_for(service.connected.wait(), 5)
    client = service.open_client()
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    received = Received(service)
    collector = asyncio.ensure_future(received.collect(client, len(prompts)))
    for i, prompt in enumerate(prompts):
        service.apply(client, _requests(client, adds=[_add(i, prompt, sampling)]))
        submitted += 1
        if (i + 1) % per_turn == 0:
            await asyncio.sleep(0)
    await asyncio.wait_for(collector, 30)
    assert not received.errors
    engine = service.engine
    await service.stop()
    counter.cancel()
    return [received.tokens[i] for i in range(len(prompts))], links[0], engine


def _prompts(n: int) -> list[list[int]]:
    return [[(7 * i + j) % (VOCAB - 1) for j in range(5 + i % 7)] for i in range(n)]


def _largest_step(plans) -> int:
    return max(len(p.new_seqs) + len(p.running_seqs) for p in plans)


def test_arrivals_that_trickle_in_fill_the_batch():
    prompts = _prompts(64)
    max_tokens = 12
    results = {}
    for turns in (0, 32):
        options = Settings(max_num_batched_tokens=4096, max_num_seqs=64, admission_turns=turns)
        outputs, link, engine = asyncio.run(_serve(options, prompts, max_tokens))
        assert outputs == [reference_tokens(p, max_tokens) for p in prompts]
        engine.allocator.check_integrity()
        assert engine.allocator.num_free_blocks == engine.allocator.num_blocks
        results[turns] = link.plans
    # without admission turns the engine steps on every turn and takes in about one arrival per
    # step; with them it waits while calls keep coming, and all 64 run together
    assert _largest_step(results[0]) < 16
    assert _largest_step(results[32]) == 64
    assert len(results[32]) < len(results[0]) / 2


def test_admission_turns_stop_once_the_batch_is_full():
    # 8 sequences fill the batch: the engine must not hold on for the rest of the arrivals
    options = Settings(max_num_batched_tokens=4096, max_num_seqs=8, admission_turns=32)
    prompts = _prompts(24)
    outputs, link, engine = asyncio.run(_serve(options, prompts, 6))
    assert outputs == [reference_tokens(p, 6) for p in prompts]
    assert _largest_step(link.plans) == 8
    # two plans go out at once (one in flight ahead); the third, the first after admission
    # turns, as soon as 8 requests were in, not after 32 turns of arrivals
    assert link.submitted_at_send[2] <= 8 + 1
    engine.allocator.check_integrity()


def test_no_waiting_once_arrivals_stop():
    # all 16 requests arrive at once; after that the engine waits six quiet turns per step, not 32
    options = Settings(max_num_batched_tokens=4096, max_num_seqs=64, admission_turns=32)
    prompts = _prompts(16)
    outputs, link, engine = asyncio.run(_serve(options, prompts, 10, per_turn=16))
    assert outputs == [reference_tokens(p, 10) for p in prompts]
    gaps = [b - a for a, b in zip(link.turn_at_send[2:], link.turn_at_send[3:])]
    assert len(gaps) >= 5 and max(gaps) <= 6 + 2, gaps
    engine.allocator.check_integrity()


def test_admission_turns_are_bounded_when_arrivals_never_stop():
    # a request arrives on every turn for far longer than 32 turns: steps keep going meanwhile
    options = Settings(max_num_batched_tokens=4096, max_num_seqs=512, admission_turns=32)
    prompts = _prompts(400)
    outputs, link, engine = asyncio.run(_serve(options, prompts, 4))
    plans = link.plans
    assert outputs == [reference_tokens(p, 4) for p in prompts]
    # the first step goes out before any waiting; each later one after at most 32 admission
    # turns plus the one turn the in-process result takes: at most 33 new requests per step
    assert len(plans[0].new_seqs) == 1
    assert max(len(p.new_seqs) for p in plans) <= 33
    assert len(plans) >= 400 // 33
    engine.allocator.check_integrity()


def test_admission_turns_must_not_be_negative():
    with pytest.raises(ValueError, match="admission_turns"):
        Settings(admission_turns=-1)


def test_admission_turns_flag_reaches_the_settings():
    from pagewire.cli import build_parser

    parser = build_parser()
    cases = (
        (["scheduler", "--worker", "w:1"], 32),
        (["scheduler", "--worker", "w:1", "--admission-turns", "0"], 0),
        (["serve", "--admission-turns", "5"], 5),
    )
    for argv, expected in cases:
        assert Settings.from_args(parser.parse_args(argv)).admission_turns == expected
    with pytest.raises(SystemExit):
        parser.parse_args(["scheduler", "--worker", "w:1", "--admission-turns", "-1"])


def test_prefill_pacing_flag_reaches_the_scheduler():
    from pagewire.cli import build_parser

    parser = build_parser()
    for argv, expected in (
        (["scheduler", "--worker", "w:1"], 0),
        (["scheduler", "--worker", "w:1", "--prefill-pacing-steps", "48"], 48),
        (["serve", "--prefill-pacing-steps", "32"], 32),
    ):
        assert Settings.from_args(parser.parse_args(argv)).prefill_pacing_steps == expected
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--prefill-pacing-steps", "-1"])
    with pytest.raises(ValueError, match="prefill_pacing_steps"):
        Settings(prefill_pacing_steps=-1)
    # and from the settings into the scheduler the engine task builds on connecting
    options = Settings(max_num_batched_tokens=64, prefill_pacing_steps=16)
    outputs, _, engine = asyncio.run(_serve(options, _prompts(4), 5))
    assert outputs == [reference_tokens(p, 5) for p in _prompts(4)]
    assert engine.scheduler.config.prefill_pacing_steps == 16


async def _core(options: Settings):
    links: list[InProcessLink] = []

    def factory(address):
        links.append(InProcessLink(address))
        return links[-1]

    service = CoreService("in-process", options, link_factory=factory)
    service.start()
    await asyncio.wait_for(service.connected.wait(), 5)
    return service, links


def test_two_api_servers_get_one_message_per_step_with_only_their_tokens():
    async def main():
        service, links = await _core(Settings(max_num_batched_tokens=4096, admission_turns=0))
        a, b = service.open_client(), service.open_client()
        sampling = SamplingParams(max_tokens=9, ignore_eos=True)
        prompts = _prompts(10)
        got = {a: Received(service), b: Received(service)}
        collectors = [asyncio.ensure_future(got[c].collect(c, 5)) for c in (a, b)]
        # the same rids on both servers: the core keeps them apart
        service.apply(a, _requests(a, adds=[_add(i, prompts[i], sampling) for i in range(5)]))
        service.apply(b, _requests(b, adds=[_add(i, prompts[5 + i], sampling) for i in range(5)]))
        await asyncio.wait_for(asyncio.gather(*collectors), 30)
        steps = service.num_steps
        engine = service.engine
        await service.stop()
        return got[a], got[b], steps, engine

    ra, rb, steps, engine = asyncio.run(main())
    prompts = _prompts(10)
    assert ra.tokens == {i: reference_tokens(prompts[i], 9) for i in range(5)}
    assert rb.tokens == {i: reference_tokens(prompts[5 + i], 9) for i in range(5)}
    assert set(ra.finished.values()) == set(rb.finished.values()) == {2}  # LENGTH
    # one message per step that produced tokens for that server (plus the worker state at the start)
    assert ra.num_messages <= steps and rb.num_messages <= steps
    assert ra.num_messages == 9 and rb.num_messages == 9  # all five decode together: 9 steps of 5 tokens
    engine.allocator.check_integrity()
    assert engine.allocator.num_free_blocks == engine.allocator.num_blocks


def test_a_closed_api_server_stream_aborts_its_requests_and_frees_their_blocks():
    async def main():
        service, _ = await _core(Settings(max_num_batched_tokens=4096))
        gone, stays = service.open_client(), service.open_client()
        long = SamplingParams(max_tokens=200, ignore_eos=True)
        service.apply(gone, _requests(gone, adds=[_add(i, p, long) for i, p in enumerate(_prompts(4))]))
        received = Received(service)
        collector = asyncio.ensure_future(received.collect(stays, 2))
        service.apply(stays, _requests(stays, adds=[_add(i, p, SamplingParams(max_tokens=30, ignore_eos=True))
                                                         for i, p in enumerate(_prompts(2))]))
        for _ in range(20):
            await asyncio.sleep(0)
        assert service.engine.scheduler.num_running == 6
        service.close_client(gone)  # its Connect stream ended
        await asyncio.wait_for(collector, 30)
        for _ in range(50):
            await asyncio.sleep(0)
        stats = service.stats()
        engine = service.engine
        await service.stop()
        return received, stats, engine

    received, stats, engine = asyncio.run(main())
    assert received.tokens == {i: reference_tokens(p, 30) for i, p in enumerate(_prompts(2))}
    assert stats["num_requests_aborted"] == 4 and stats["num_requests_finished"] == 2
    assert stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_total_blocks"]
    engine.allocator.check_integrity()


def test_requests_arriving_together_at_an_idle_engine_queue_only_past_the_batch():
    """max_num_seqs 2 and a queue of 1: of four requests in one message, two start at the next
    step and are not queued, the third waits, the fourth finds the queue full; so does a fifth
    that its API server may offer to another core, which the core leaves uncounted."""
    async def main():
        service, _ = await _core(Settings(max_num_seqs=2, max_queued_requests=1, max_num_batched_tokens=64))
        client = service.open_client()
        ok = SamplingParams(max_tokens=4, ignore_eos=True)
        received = Received(service)
        collector = asyncio.ensure_future(received.collect(client, 5))
        passable = NewRequest(5, [1, 2, 8], ok, passable=True)
        service.apply(client, _requests(client, adds=[*(_add(i, [1, 2, 3 + i], ok) for i in range(1, 5)), passable]))
        await asyncio.wait_for(collector, 30)
        stats = service.stats()
        engine = service.engine
        await service.stop()
        return received, stats, engine

    received, stats, engine = asyncio.run(main())
    assert {rid: code for rid, (code, _) in received.errors.items()} == {
        4: grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], 5: grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]}
    assert stats["num_requests_rejected"] == 1
    assert sorted(received.finished) == [1, 2, 3]
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    engine.allocator.check_integrity()


def test_a_core_shutting_down_counts_a_passable_refusal_not_at_all_and_another_once():
    """While it drains a core refuses new requests UNAVAILABLE; one its API server may offer to
    another core is left for that server to count."""
    async def main():
        service, _ = await _core(Settings(max_num_batched_tokens=64))
        client = service.open_client()
        received = Received(service)
        collector = asyncio.ensure_future(received.collect(client, 2))
        service.draining = True
        ok = SamplingParams(max_tokens=4)
        service.apply(client, _requests(client, adds=[_add(1, [1, 2, 3], ok),
                                                      NewRequest(2, [1, 2, 4], ok, passable=True)]))
        await asyncio.wait_for(collector, 30)
        stats = service.stats()
        await service.stop()
        return received, stats

    received, stats = asyncio.run(main())
    unavailable = grpc.StatusCode.UNAVAILABLE.value[0]
    assert {rid: code for rid, (code, _) in received.errors.items()} == {1: unavailable, 2: unavailable}
    assert stats["num_requests_rejected"] == 1


def test_refusals_come_back_on_the_stream_with_their_status():
    async def main():
        service, _ = await _core(Settings(max_num_seqs=1, max_queued_requests=1, max_num_batched_tokens=64))
        client = service.open_client()
        ok = SamplingParams(max_tokens=50, ignore_eos=True)
        received = Received(service)
        collector = asyncio.ensure_future(received.collect(client, 5))
        service.apply(client, _requests(client, adds=[_add(1, [1, 2, 3], ok)]))
        for _ in range(10):
            await asyncio.sleep(0)  # 1 runs
        service.apply(client, _requests(client, adds=[
            _add(2, [1, 2, 3], ok),  # waits
            _add(3, [1, 2, 3], ok),  # the queue is full
            _add(4, [1, VOCAB + 5], ok),  # outside the vocabulary
            _add(2, [4, 5], ok),  # the same id again
        ]))
        # an id whose high half names another API server
        service.apply(client, CoreRequests(adds=[NewRequest(first_request_id(client.api_server_id + 1), [1, 2], ok)]))
        await asyncio.wait_for(collector, 30)
        while service.engine.has_unfinished() or received.tokens.get(2, []) == [] or 2 not in received.finished:
            more = Received(service)
            more.num_done = received.num_done
            await asyncio.wait_for(more.collect(client, 1), 30)
            received.num_done = more.num_done
            received.tokens.update(more.tokens)
            received.finished.update(more.finished)
        stats = service.stats()
        await service.stop()
        return received, stats

    received, stats = asyncio.run(main())
    codes = {rid: grpc.StatusCode.__members__[name] for rid, (code, _) in received.errors.items()
             for name, member in grpc.StatusCode.__members__.items() if member.value[0] == code}
    foreign = 1 << 32  # first_request_id(server + 1) - first_request_id(server)
    assert codes == {3: grpc.StatusCode.RESOURCE_EXHAUSTED, 4: grpc.StatusCode.INVALID_ARGUMENT,
                     2: grpc.StatusCode.ALREADY_EXISTS, foreign: grpc.StatusCode.INVALID_ARGUMENT}
    assert "outside the vocabulary" in received.errors[4][1]
    assert "does not belong to API server" in received.errors[foreign][1]
    assert received.tokens[1] == reference_tokens([1, 2, 3], 50)
    assert stats["num_requests_rejected"] == 4


def test_no_queue_takes_requests_that_can_start_and_refuses_the_rest():
    """--max-queued-requests 0: an idle engine takes what fits in the batch, a full one refuses."""
    async def main():
        service, _ = await _core(Settings(max_num_seqs=2, max_queued_requests=0, max_num_batched_tokens=64))
        info = service.info_response()  # the API servers learn there is no queue
        assert info.HasField("max_queued_requests") and info.max_queued_requests == 0 and info.max_num_seqs == 2
        client = service.open_client()
        ok = SamplingParams(max_tokens=30, ignore_eos=True)
        received = Received(service)
        collector = asyncio.ensure_future(received.collect(client, 3))
        # idle: both start at the next step (one message, so neither has run when the other arrives)
        service.apply(client, _requests(client, adds=[_add(1, [1, 2, 3], ok), _add(2, [4, 5, 6], ok)]))
        service.apply(client, _requests(client, adds=[_add(3, [7, 8], ok)]))  # both places taken
        for _ in range(10):
            await asyncio.sleep(0)
        running = service.engine.scheduler.num_running
        service.apply(client, _requests(client, adds=[_add(4, [7, 8], ok)]))  # still full, now running
        await asyncio.wait_for(collector, 30)
        while len(received.finished) < 2:
            await asyncio.wait_for(received.collect(client, 4), 30)
        service.apply(client, _requests(client, adds=[_add(5, [9, 10], ok)]))  # idle again
        await asyncio.wait_for(received.collect(client, 5), 30)
        stats = service.stats()
        await service.stop()
        return received, stats, running

    received, stats, running = asyncio.run(main())
    assert running == 2
    assert {rid: code for rid, (code, _) in received.errors.items()} == {
        3: grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], 4: grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]}
    assert "no queue" in received.errors[3][1]
    assert received.tokens == {1: reference_tokens([1, 2, 3], 30), 2: reference_tokens([4, 5, 6], 30),
                               5: reference_tokens([9, 10], 30)}
    assert stats["num_requests_rejected"] == 2 and stats["num_requests_finished"] == 3


def test_a_queue_of_zero_refused_everything_before():
    """The old check (num_waiting >= 0) refused every request; an idle engine takes one now."""
    async def main():
        service, _ = await _core(Settings(max_num_seqs=1, max_queued_requests=0))
        client = service.open_client()
        received = Received(service)
        service.apply(client, _requests(client, adds=[_add(0, [1, 2], SamplingParams(max_tokens=3, ignore_eos=True))]))
        await asyncio.wait_for(received.collect(client, 1), 30)
        await service.stop()
        return received

    received = asyncio.run(main())
    assert received.errors == {} and received.tokens == {0: reference_tokens([1, 2], 3)}


def test_a_lost_worker_fails_every_request_with_unavailable():
    async def main():
        service, links = await _core(Settings(max_num_batched_tokens=4096))
        a, b = service.open_client(), service.open_client()
        long = SamplingParams(max_tokens=500, ignore_eos=True)
        service.apply(a, _requests(a, adds=[_add(i, p, long) for i, p in enumerate(_prompts(3))]))
        service.apply(b, _requests(b, adds=[_add(7, [1, 2], long)]))
        for _ in range(10):
            await asyncio.sleep(0)
        ra, rb = Received(service), Received(service)
        ca = asyncio.ensure_future(ra.collect(a, 3))
        cb = asyncio.ensure_future(rb.collect(b, 1))
        links[0].fail = "test: the worker went away"  # the next read from the worker fails
        await asyncio.wait_for(asyncio.gather(ca, cb), 10)
        await asyncio.wait_for(service.connected.wait(), 5)  # reconnects, fresh accounting
        stats = service.stats()
        await service.stop()
        return ra, rb, stats, len(links)

    ra, rb, stats, num_links = asyncio.run(main())
    assert num_links == 1  # the same link object reconnects
    unavailable = grpc.StatusCode.UNAVAILABLE.value[0]
    assert {rid: code for rid, (code, _) in ra.errors.items()} == {0: unavailable, 1: unavailable, 2: unavailable}
    assert {rid: code for rid, (code, _) in rb.errors.items()} == {7: unavailable}
    assert "the worker went away" in rb.errors[7][1]
    assert stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_total_blocks"]


def test_a_worker_lost_while_idle_is_found_at_once():
    """No request in flight, so nothing is read from the worker: its session's end alone tells the
    core, which goes unhealthy and reconnects before any request comes to fail on it."""
    async def main():
        health: list[bool] = []
        links: list[InProcessLink] = []

        def factory(address):
            links.append(InProcessLink(address))
            return links[-1]

        service = CoreService("in-process", Settings(), on_health=health.append, link_factory=factory)
        service.start()
        await asyncio.wait_for(service.connected.wait(), 5)
        client = service.open_client()
        received = Received(service)
        collector = asyncio.ensure_future(received.collect(client, 1))
        service.apply(client, _requests(client, adds=[_add(0, [1, 2], SamplingParams(max_tokens=3, ignore_eos=True))]))
        await asyncio.wait_for(collector, 5)
        for _ in range(5):
            await asyncio.sleep(0)
        links[0].lose()
        await asyncio.wait_for(wait_for(lambda: links[0].num_opened == 2), 5)
        after = Received(service)
        collector = asyncio.ensure_future(after.collect(client, 1))
        service.apply(client, _requests(client, adds=[_add(1, [1, 2], SamplingParams(max_tokens=3, ignore_eos=True))]))
        await asyncio.wait_for(collector, 5)
        await service.stop()
        return health, received, after

    health, received, after = asyncio.run(main())
    assert health == [True, False, True]
    assert received.errors == {} and after.errors == {} and after.tokens == {1: reference_tokens([1, 2], 3)}


async def wait_for(predicate) -> None:
    while not predicate():
        await asyncio.sleep(0.01)


def test_the_core_runs_at_most_a_step_ahead_of_an_api_server_that_has_not_caught_up():
    async def main():
        service, _ = await _core(Settings(max_num_batched_tokens=4096, admission_turns=0))
        client = service.open_client()
        service.apply(client, _requests(client, adds=[_add(0, [1, 2, 3], SamplingParams(max_tokens=40, ignore_eos=True))]))
        for _ in range(200):
            await asyncio.sleep(0)
        stalled_at = service.num_steps
        messages = [m for m in await client.outbox.take() if m is not None]
        with_tokens = [m for m in messages if len(m.request_ids)]
        # two results came back (the plan in flight is the one after them): nothing more until the API
        # server says it handed on all but the latest
        assert stalled_at == 2 and len(with_tokens) == 2
        # one that stays silent is not waited for after BACKPRESSURE_TIMEOUT_S: the core goes on
        await asyncio.sleep(BACKPRESSURE_TIMEOUT_S * 1.5)
        moved_on = service.num_steps
        assert moved_on > stalled_at + 5 and client.unresponsive
        received = Received(service)
        received.num_done = 2
        service.apply(client, _requests(client, num_outputs_done=2))
        assert not client.unresponsive  # it answered: waited for again
        await asyncio.wait_for(received.collect(client, 1), 10)
        steps = service.num_steps
        await service.stop()
        return steps, received

    steps, received = asyncio.run(main())
    # 40 sampling steps and the plan that drops the finished sequence; the rest of the tokens came
    assert steps == 41 and len(received.tokens[0]) == 38
