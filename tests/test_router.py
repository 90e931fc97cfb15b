"""The API servers' routing rule (``scheduler_svc/api/router.py``): exact picks for each policy,
the balance threshold, the index fed by KV events, and cores that are down."""

import pytest

from kvcache.allocator import BlockAllocator, prefix_block_hashes
from pagewire_common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from scheduler_svc.api.router import NoCoreError, Router

BLOCK = 4


def stored(hashes):
    return BlockStored(list(hashes), None, [0] * BLOCK * len(hashes), BLOCK)


def test_prefix_hashes_are_the_allocators():
    """The router hashes a prompt as the allocator registers it: a sequence's stored-block events
    carry exactly ``prefix_block_hashes`` of its tokens (full blocks only)."""
    allocator = BlockAllocator(16, BLOCK, True)
    allocator.record_kv_events(True)
    tokens = list(range(100, 111))  # 2 full blocks and 3 tokens
    allocator.allocate(1, tokens)
    allocator.cache_blocks(1, tokens, len(tokens))
    (event,) = allocator.take_kv_events()
    assert event.block_hashes == prefix_block_hashes(tokens, BLOCK)
    assert len(prefix_block_hashes(tokens, BLOCK)) == 2
    assert prefix_block_hashes(tokens[:3], BLOCK) == []
    assert prefix_block_hashes(tokens[:8], BLOCK) == prefix_block_hashes(tokens, BLOCK)
    allocator.check_integrity()


def test_cache_aware_picks_the_longest_cached_prefix():
    router = Router(3, "cache-aware", balance_threshold=4)
    router.apply_events(0, [stored([1])])
    router.apply_events(2, [stored([1, 2, 3])])
    assert router.matched_blocks(0, [1, 2, 3, 4]) == 1
    assert router.matched_blocks(2, [1, 2, 3, 4]) == 3
    assert router.matched_blocks(1, [1, 2, 3, 4]) == 0
    assert router.pick([1, 2, 3, 4], [0, 0, 3]) == 2
    # a hole breaks the run: only leading blocks count
    assert router.matched_blocks(2, [9, 2, 3]) == 0


def test_cache_aware_ties_go_to_the_less_loaded_then_the_lower_index():
    router = Router(3, "cache-aware", balance_threshold=8)
    for core in range(3):
        router.apply_events(core, [stored([5, 6])])
    assert router.pick([5, 6], [4, 2, 2]) == 1
    assert router.pick([5, 6], [1, 2, 2]) == 0


def test_balance_threshold_sends_to_the_least_loaded():
    """The core with the prefix keeps it while its load is at most ``threshold`` above the least
    loaded core's, and loses it beyond."""
    router = Router(2, "cache-aware", balance_threshold=4)
    router.apply_events(1, [stored([7, 8])])
    assert router.pick([7, 8], [0, 4]) == 1  # 4 above: still within
    assert router.pick([7, 8], [0, 5]) == 0  # 5 above: the least loaded
    # the routed prompt's hashes are entered for the core it went to
    assert router.matched_blocks(0, [7, 8]) == 2


def test_no_cached_prefix_goes_to_the_least_loaded_and_is_remembered():
    router = Router(2, "cache-aware", balance_threshold=16)
    assert router.pick([1, 2], [3, 1]) == 1
    # before the core announces the blocks, the same prefix follows the first request
    assert router.pick([1, 2, 3], [3, 2]) == 1
    assert router.pick([4], [0, 0]) == 0  # a new prefix with equal loads: in turn after core 1


def test_kv_events_add_remove_and_clear():
    router = Router(2, "cache-aware")
    router.apply_events(0, [stored([1, 2, 3]), BlockRemoved([2])])
    assert router.matched_blocks(0, [1, 2, 3]) == 1
    router.apply_events(1, [stored([1, 2])])
    router.apply_events(0, [AllBlocksCleared()])
    assert router.num_indexed(0) == 0 and router.num_indexed(1) == 2
    router.apply_events(1, [stored([4])])
    router.clear(1)  # the core is gone
    assert router.num_indexed(1) == 0 and router.matched_blocks(1, [1, 2]) == 0
    assert router._cores_of == {}  # nothing left behind for cores that hold nothing


def test_round_robin_in_turn_skipping_cores_that_are_down():
    router = Router(3, "round-robin")
    assert [router.pick([], [0, 0, 0]) for _ in range(4)] == [0, 1, 2, 0]
    assert [router.pick([], [0, None, 9]) for _ in range(3)] == [2, 0, 2]


def test_least_loaded_with_ties_in_turn():
    router = Router(3, "least-loaded")
    assert router.pick([], [2, 1, 3]) == 1
    assert [router.pick([], [0, 0, 0]) for _ in range(3)] == [2, 0, 1]
    assert router.pick([], [None, 5, 4]) == 2


def test_cores_that_are_down_are_never_picked():
    router = Router(2, "cache-aware")
    router.apply_events(0, [stored([1, 2])])
    assert router.pick([1, 2], [None, 7]) == 1
    with pytest.raises(NoCoreError):
        router.pick([1, 2], [None, None])


def test_bad_policy_and_core_count():
    with pytest.raises(ValueError, match="unknown routing 'random'"):
        Router(2, "random")
    with pytest.raises(ValueError, match="at least one core"):
        Router(0)


def test_a_core_without_room_is_passed_over_while_another_has_room():
    """The API server routes among the cores with room for the request (under max_num_seqs, or in
    their queue): with no queue, the core holding the prefix is full and the other takes it, not
    a refusal; with a queue it waits at the prefix's core; with no room anywhere the rules pick."""
    import asyncio

    from pagewire_common.v1 import core_pb2
    from scheduler_svc.api.server import ApiServer, ServedModel

    prompt = list(range(10, 26))  # four full blocks of 4

    async def route(queue: int, loads: tuple[int, int], n: int = 1) -> int:
        api = ApiServer("unix:/nonexistent-a.sock,unix:/nonexistent-b.sock")
        info = core_pb2.CoreInfoResponse(block_size=4, max_num_seqs=2, max_queued_requests=queue)
        api.model = ServedModel(info, None, None)
        for link, load in zip(api.links, loads):
            link.is_serving, link.info = True, info
            link.pending = dict.fromkeys(range(load))
        api.router._add(0, prefix_block_hashes(prompt, 4))  # core 0 holds the prefix
        try:
            return api.route(prompt, n).index
        finally:
            for link in api.links:
                await link._channel.close()

    assert asyncio.run(route(0, (2, 0))) == 1  # core 0 is full and has no queue
    assert asyncio.run(route(0, (1, 0))) == 0  # room for one more
    assert asyncio.run(route(0, (1, 0), n=2)) == 1  # not for two samples
    assert asyncio.run(route(4, (2, 0))) == 0  # it queues there
    assert asyncio.run(route(0, (2, 2))) == 0  # no room anywhere: the prefix's core (which refuses it)


def test_only_the_first_cores_say_which_model_is_served():
    """serve's own cores come first (--primary-cores): a core elsewhere that comes up first waits
    for them, is taken once they serve the same model, and refused when it serves another."""
    import asyncio

    from pagewire_common.v1 import core_pb2
    from scheduler_svc.api.server import ApiServer

    async def run(other_model: str) -> tuple:
        api = ApiServer("unix:/nonexistent-a.sock,unix:/nonexistent-b.sock", primary_cores=1)
        local, remote = api.links
        for link, name in ((local, "local-model"), (remote, other_model)):
            link.worker_connected, link.info = True, core_pb2.CoreInfoResponse(model_name=name, max_num_seqs=4)
        await remote.adopt()  # the core elsewhere comes up first
        first = (remote.is_serving, remote.waiting_for_model, api.model)
        await local.adopt()
        for _ in range(3):  # the waiting core's turn
            await asyncio.sleep(0)
        result = first, (local.is_serving, remote.is_serving, api.model.info.model_name)
        for link in api.links:
            await link._channel.close()
        return result

    assert asyncio.run(run("local-model")) == ((False, True, None), (True, True, "local-model"))
    assert asyncio.run(run("other-model")) == ((False, True, None), (True, False, "local-model"))
