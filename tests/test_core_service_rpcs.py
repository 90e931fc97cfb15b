"""The core's router-facing requests: running request ids unique across API servers and
aborted by name from any of them, and the KV events a subscribed API server receives."""

from __future__ import annotations

import asyncio

import grpc

from pagewire_common.core_messages import first_request_id
from pagewire_common.sampling import SamplingParams
from pagewire_common.settings import Settings
from scheduler_svc.core.service import ApiClient, CoreService
from tests.fake_worker import FakeKVWorker, reference_tokens
from tests.test_core_service import BLOCK_SIZE, InProcessLink, Received, _add, _core, _requests


def _codes(received: Received) -> dict[int, grpc.StatusCode]:
    by_value = {member.value[0]: member for member in grpc.StatusCode}
    return {rid: by_value[code] for rid, (code, _) in received.errors.items()}


def test_request_names_are_unique_across_api_servers_and_abort_by_name_reaches_the_owner():
    async def main():
        service, _ = await _core(Settings(max_num_batched_tokens=4096))
        owner, other = service.open_client(), service.open_client()
        long = SamplingParams(max_tokens=500, ignore_eos=True)
        got_owner, got_other = Received(service), Received(service)
        owner_done = asyncio.ensure_future(got_owner.collect(owner, 3))
        service.apply(owner, _requests(owner, adds=[
            _add(0, [1, 2, 3], long, "job"),
            _add(10, [4, 5, 6], SamplingParams(max_tokens=500, ignore_eos=True, n=2, temperature=1.0, seed=1), "pair"),
            _add(20, [7, 8, 9], long),  # no name: never refused as a duplicate, never found by one
            _add(30, [7, 8, 9], long),
        ]))
        for _ in range(20):
            await asyncio.sleep(0)
        assert service.engine.scheduler.num_running == 5
        service.apply(other, _requests(other, adds=[_add(0, [1, 2], long, "job")]))  # running on the other server
        await asyncio.wait_for(got_other.collect(other, 1), 10)
        service.apply(other, _requests(other, abort_names=["job", "unknown", "", "pair", "job"]))
        (msg,) = await other.outbox.take()
        replies = [(r.name, r.found) for r in msg.abort_replies]
        for _ in range(20):
            await asyncio.sleep(0)
        blocks_held_by_the_rest = service.engine.allocator.num_free_blocks
        service.apply(owner, _requests(owner, abort_ids=[first_request_id(owner.api_server_id) + i for i in (20, 30)]))
        await asyncio.wait_for(owner_done, 10)
        for _ in range(20):
            await asyncio.sleep(0)
        # the name is free again once its request ended
        reuse = Received(service)
        reused = asyncio.ensure_future(reuse.collect(other, 1))
        service.apply(other, _requests(other, adds=[_add(1, [1, 2, 3], SamplingParams(max_tokens=5), "job")]))
        await asyncio.wait_for(reused, 10)
        for _ in range(20):
            await asyncio.sleep(0)
        stats, engine, num_names = service.stats(), service.engine, len(service.names)
        await service.stop()
        return got_owner, got_other, replies, reuse, stats, engine, blocks_held_by_the_rest, num_names

    got_owner, got_other, replies, reuse, stats, engine, blocks_held_by_the_rest, num_names = asyncio.run(main())
    assert _codes(got_other) == {0: grpc.StatusCode.ALREADY_EXISTS}
    assert "'job' is already running" in got_other.errors[0][1]
    assert replies == [("job", True), ("unknown", False), ("", False), ("pair", True), ("job", False)]
    # the owner's streams end CANCELLED: each sample of n = 2
    assert _codes(got_owner) == {0: grpc.StatusCode.CANCELLED, 10: grpc.StatusCode.CANCELLED,
                                 11: grpc.StatusCode.CANCELLED}
    assert got_owner.errors[0][1] == "request 'job' was aborted"
    assert blocks_held_by_the_rest < engine.allocator.num_blocks  # the unnamed two still ran then
    assert reuse.tokens[1] == reference_tokens([1, 2, 3], 5) and 1 in reuse.finished
    assert stats["num_requests_aborted"] == 5 and stats["num_requests_finished"] == 1
    assert stats["num_requests_rejected"] == 1
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    engine.allocator.check_integrity()
    assert num_names <= 1  # ended names are dropped when looked up (the last one when it is next)


def test_abort_by_name_frees_the_blocks_before_the_next_plan():
    async def main():
        service, links = await _core(Settings(max_num_batched_tokens=4096))
        owner, other = service.open_client(), service.open_client()
        got = Received(service)
        done = asyncio.ensure_future(got.collect(owner, 1))
        service.apply(owner, _requests(owner, adds=[_add(0, list(range(1, 40)), SamplingParams(max_tokens=500,
                                                                                                  ignore_eos=True),
                                                         "long")]))
        for _ in range(20):
            await asyncio.sleep(0)
        alloc = service.engine.allocator
        assert alloc.num_free_blocks < alloc.num_blocks
        num_plans = len(links[0].plans)
        service.apply(other, _requests(other, abort_names=["long"]))
        free_now = alloc.num_free_blocks  # at once, in apply
        await asyncio.wait_for(done, 10)
        for _ in range(20):
            await asyncio.sleep(0)
        later = links[0].plans[num_plans:]
        await service.stop()
        return got, free_now, alloc, later

    got, free_now, alloc, later = asyncio.run(main())
    assert _codes(got) == {0: grpc.StatusCode.CANCELLED}
    assert free_now == alloc.num_blocks
    alloc.check_integrity()
    # the worker drops it in the next plan it gets, and no later plan runs it
    assert later and all(0 not in [i - first_request_id(1) for i in plan.running_seq_ids.tolist()] for plan in later[1:])


class _SmallCacheLink(InProcessLink):
    """An in-process worker with 8 KV blocks, so that a second prompt evicts the first's."""

    NUM_BLOCKS = 8

    def __init__(self, address: str):
        super().__init__(address)
        self.worker = FakeKVWorker(self.NUM_BLOCKS, BLOCK_SIZE)
        self.plans = self.worker.plans

    async def info(self, timeout: float = 5.0):
        info = await super().info(timeout)
        info.num_kv_blocks = self.NUM_BLOCKS
        return info


async def _run_to_end(service: CoreService, client: ApiClient, index: int, prompt: list[int], max_tokens: int,
                      batches: list):
    """Submit one request and read the client's messages until it finishes, acknowledging each as an
    API server does; the KV event batches go on ``batches``."""
    service.apply(client, _requests(client, adds=[_add(index, prompt, SamplingParams(max_tokens=max_tokens,
                                                                                     ignore_eos=True))]))
    rid = first_request_id(client.api_server_id) + index
    while True:
        for msg in await asyncio.wait_for(client.outbox.take(), 10):
            assert not msg.errors
            if msg.kv_events is not None:
                batches.append(msg.kv_events)
            if msg.has_tokens:
                client.num_done = getattr(client, "num_done", 0) + 1
                service.apply(client, _requests(client, num_outputs_done=client.num_done))
            if rid in msg.finished_ids:
                return


def _chain(token_ids: list[int]) -> list[int]:
    from kvcache.allocator import _ROOT_BLOCK_HASH

    hashes, parent = [], _ROOT_BLOCK_HASH
    for start in range(0, len(token_ids) - BLOCK_SIZE + 1, BLOCK_SIZE):
        parent = hash((parent, tuple(token_ids[start : start + BLOCK_SIZE])))
        hashes.append(parent)
    return hashes


def test_a_subscribed_api_server_gets_stored_and_removed_kv_events():
    from pagewire_common.kv_events import BlockRemoved, BlockStored

    async def main():
        service = CoreService("in-process", Settings(max_num_batched_tokens=4096, admission_turns=0),
                              link_factory=_SmallCacheLink)
        service.start()
        await asyncio.wait_for(service.connected.wait(), 5)
        quiet, client = service.open_client(), service.open_client()
        service.apply(client, _requests(client, kv_events=True))
        allocator = service.engine.allocator
        batches: list = []
        prompt_a = list(range(1, 11))  # two full blocks and two tokens
        await _run_to_end(service, client, 0, prompt_a, 3, batches)
        cached_a = dict(allocator._hash_to_block)
        num_a = len(batches)
        # 28 tokens and 2 more fill all 8 blocks: every hash of the first prompt is evicted
        await _run_to_end(service, client, 1, list(range(30, 58)), 2, batches)
        allocator.check_integrity()
        service.apply(client, _requests(client, kv_events=False))
        recording_after = allocator._kv_events
        quiet_messages = [m for m in quiet.outbox._items if m.kv_events is not None]
        await service.stop()
        return batches, num_a, cached_a, recording_after, quiet_messages

    batches, num_a, cached_a, recording_after, quiet_messages = asyncio.run(main())
    assert [b.seq for b in batches] == list(range(1, len(batches) + 1))
    assert {b.core_index for b in batches} == {0}
    events_a = [e for b in batches[:num_a] for e in b.events]
    assert all(isinstance(e, BlockStored) and e.block_size == BLOCK_SIZE for e in events_a)
    stored_a = [h for e in events_a for h in e.block_hashes]
    # the prompt's two full blocks, chained from the root
    tokens_a = list(range(1, 11)) + reference_tokens(list(range(1, 11)), 3)
    assert stored_a == _chain(tokens_a)[: len(stored_a)] and len(stored_a) >= 2
    assert set(stored_a) == set(cached_a)  # exactly the allocator's hashes
    parent = None
    for e in events_a:  # each event continues the chain of the one before
        assert e.parent_block_hash == parent
        start = stored_a.index(e.block_hashes[0]) * BLOCK_SIZE
        assert e.token_ids == tokens_a[start : start + len(e.block_hashes) * BLOCK_SIZE]
        parent = e.block_hashes[-1]
    events_b = [e for b in batches[num_a:] for e in b.events]
    removed = [h for e in events_b if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert sorted(removed) == sorted(stored_a)
    stored_b = [h for e in events_b if isinstance(e, BlockStored) for h in e.block_hashes]
    assert stored_b[:7] == _chain(list(range(30, 58)))
    assert recording_after is None  # the last subscriber left: recording is off
    assert quiet_messages == []  # an API server that did not subscribe gets none
    assert (len(stored_a), len(removed), len(stored_b)) == (2, 2, 7)
