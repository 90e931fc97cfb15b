"""The allocator's KV events (what ``SubscribeKVEvents`` publishes): recorded only when asked,
block-stored chains with their parent hashes, removals when a cached block is reused, and the
clear on reset."""

from __future__ import annotations

from tests.test_allocator import BS, make_allocator, tokens  # noqa: F401  (make_allocator: a fixture)


def chain_hashes(token_ids: list[int], block_size: int = BS) -> list[int]:
    """The allocator's chained hashes of the full blocks of ``token_ids``, computed apart."""
    from kvcache.allocator import _ROOT_BLOCK_HASH

    hashes, parent = [], _ROOT_BLOCK_HASH
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[start : start + block_size])))
        hashes.append(parent)
    return hashes


def test_kv_events_are_not_recorded_unless_asked(make_allocator):
    allocator = make_allocator(num_blocks=3)
    prompt = tokens(0, 8)
    allocator.allocate(1, prompt)
    allocator.cache_blocks(1, prompt, 8)
    allocator.free(1)
    allocator.allocate(2, tokens(100, 12))  # evicts both hashes
    allocator.reset()
    assert allocator.take_kv_events() == []
    assert allocator._kv_events is None


def test_kv_events_store_chains_evict_on_reuse_and_clear(make_allocator):
    from pagewire_common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

    allocator = make_allocator(num_blocks=4)
    allocator.record_kv_events(True)
    prompt = tokens(0, 10)  # two full blocks and two tokens
    h0, h1 = chain_hashes(prompt)
    allocator.allocate(1, prompt)  # [0, 1, 2]
    allocator.cache_blocks(1, prompt, 4)  # the first block in one step...
    assert allocator.take_kv_events() == [BlockStored([h0], None, tokens(0, 4), BS)]
    allocator.cache_blocks(1, prompt, 10)  # ...the second in the next: its parent is the first
    assert allocator.take_kv_events() == [BlockStored([h1], h0, tokens(4, 4), BS)]
    assert allocator.take_kv_events() == []

    # a prefix hit registers nothing new; its duplicate last block neither
    allocator.allocate(2, prompt[:8])  # [0, 3]: block 1 is copied to 3 for the last token
    allocator.cache_blocks(2, prompt[:8], 8)
    assert allocator.take_kv_events() == []

    # blocks registered in one call come as one chain
    other = tokens(50, 8)
    allocator.free(2)
    allocator.free(1)  # free list: 3, 2, 1, 0
    allocator.allocate(3, other)  # [3, 2]
    allocator.cache_blocks(3, other, 8)
    assert allocator.take_kv_events() == [BlockStored(chain_hashes(other), None, other, BS)]

    # reuse evicts in free-list order: 1 (h1), then 0 (h0), in one event
    allocator.allocate(4, tokens(200, 8))
    assert allocator.take_kv_events() == [BlockRemoved([h1, h0])]
    allocator.check_integrity()

    allocator.free(4)
    allocator.cache_blocks(3, other, 8)  # nothing new
    allocator.reset()
    assert allocator.take_kv_events() == [AllBlocksCleared()]
    allocator.check_integrity()

    allocator.record_kv_events(False)
    allocator.allocate(5, prompt)
    allocator.cache_blocks(5, prompt, 10)
    assert allocator.take_kv_events() == []
