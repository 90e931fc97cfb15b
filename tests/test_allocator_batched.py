"""The allocator's batched walks of its free list (``_pop_free_many`` in ``allocate`` and
``append_slots``, the inlined release in ``free``, the inlined hashing in ``cache_blocks``) against
the one-block-at-a-time reference they replace: the same random traces must leave the same block
tables, refcounts, free-list order, hashes and KV events after every call."""

from __future__ import annotations

import random

import pytest

from kvcache.allocator import BlockAllocator, chain_block_hash


class OneByOneAllocator(BlockAllocator):
    """The reference: every block popped with ``_pop_free``, released with ``_release``, and
    hashed with ``chain_block_hash``, one call each."""

    def _pop_free_many(self, count: int) -> list[int]:
        return [self._pop_free() for _ in range(count)]

    def free(self, seq_id: int) -> None:
        for block_id in reversed(self._blocks_of(seq_id)):
            self._release(block_id)
        del self._seq_block_ids[seq_id]
        del self._seq_num_tokens[seq_id]
        del self._seq_block_hashes[seq_id]

    def cache_blocks(self, seq_id: int, token_ids, num_computed_tokens: int) -> None:
        if not self.enable_prefix_caching:
            return
        block_ids = self._blocks_of(seq_id)
        hashes = self._seq_block_hashes[seq_id]
        for block_index in range(len(hashes), num_computed_tokens // self.block_size):
            parent_hash = hashes[-1] if hashes else 0x70A6E817E
            start = block_index * self.block_size
            block_hash = chain_block_hash(parent_hash, token_ids[start : start + self.block_size])
            hashes.append(block_hash)
            block_id = block_ids[block_index]
            if self._block_hashes[block_id] is None and block_hash not in self._hash_to_block:
                self._block_hashes[block_id] = block_hash
                self._hash_to_block[block_hash] = block_id
                if self._kv_events is not None:
                    self._record_stored(block_hash, parent_hash, token_ids, block_index)


def state(allocator: BlockAllocator) -> tuple:
    events = allocator._kv_events
    return (allocator._seq_block_ids, allocator._seq_num_tokens, allocator._seq_block_hashes, allocator._hash_to_block,
            allocator._block_hashes, allocator._ref_counts, allocator._next_free, allocator._prev_free,
            allocator._num_free, None if events is None else [repr(e) for e in events])


@pytest.mark.parametrize("seed", range(12))
def test_batched_free_list_walks_match_one_by_one(seed: int) -> None:
    rng = random.Random(seed)
    block_size = rng.choice([2, 4, 16])
    num_blocks = rng.choice([8, 24, 64])
    prefix = rng.random() < 0.8
    fast = BlockAllocator(num_blocks, block_size, prefix)
    slow = OneByOneAllocator(num_blocks, block_size, prefix)
    for allocator in (fast, slow):
        allocator.record_kv_events(seed % 2 == 0)
    # a few shared prefixes, so that blocks are hashed, revived from the free list and evicted
    stems = [[rng.randrange(50) for _ in range(rng.randrange(1, 5 * block_size))] for _ in range(4)]
    tokens: dict[int, list[int]] = {}
    next_id = 0
    for _ in range(300):
        op = rng.random()
        live = sorted(tokens)
        if op < 0.4 or not live:
            seq_tokens = rng.choice(stems) + [rng.randrange(50) for _ in range(rng.randrange(0, 3 * block_size))]
            use_cache = rng.random() < 0.9
            got = [a.allocate(next_id, seq_tokens, use_prefix_cache=use_cache) for a in (fast, slow)]
            assert got[0] == got[1]
            if got[0] is not None:
                tokens[next_id] = list(seq_tokens)
            next_id += 1
        elif op < 0.65:
            seq_id = rng.choice(live)
            grown = len(tokens[seq_id]) + rng.randrange(1, 3 * block_size)
            got = [a.append_slots(seq_id, grown) for a in (fast, slow)]
            assert got[0] == got[1]
            if got[0] is not None:
                tokens[seq_id] += [rng.randrange(50) for _ in range(grown - len(tokens[seq_id]))]
        elif op < 0.85:
            seq_id = rng.choice(live)
            num_computed = rng.randrange(len(tokens[seq_id]) + 1)
            for allocator in (fast, slow):
                allocator.cache_blocks(seq_id, tokens[seq_id], num_computed)
        else:
            seq_id = rng.choice(live)
            for allocator in (fast, slow):
                allocator.free(seq_id)
            del tokens[seq_id]
        assert state(fast) == state(slow)
        fast.check_integrity()


def test_pop_free_many_takes_the_head_in_order_and_evicts_hashes() -> None:
    allocator = BlockAllocator(6, 2, True)
    allocator.record_kv_events(True)
    first = allocator.allocate(1, [1, 2, 3, 4])
    assert first.block_ids == [0, 1]
    allocator.cache_blocks(1, [1, 2, 3, 4], 4)
    allocator.free(1)  # the tail of the free list: 2 3 4 5 1 0 (a sequence frees last block first)
    allocator.take_kv_events()
    assert allocator._pop_free_many(5) == [2, 3, 4, 5, 1]
    assert allocator.num_free_blocks == 1
    assert len(allocator.take_kv_events()) == 1  # block 1's hash evicted, one BlockRemoved
    assert allocator._pop_free_many(0) == []
    assert allocator._pop_free_many(1) == [0]
    assert allocator.num_free_blocks == 0 and allocator.num_cached_blocks == 0


def test_grow_within_limit_sets_the_length() -> None:
    allocator = BlockAllocator(4, 4, True)
    allocator.allocate(7, [1, 2, 3])
    limit = allocator.growth_limit(7)
    allocator.grow_within_limit(7, limit)
    assert allocator._seq_num_tokens[7] == limit == 4
    allocator.check_integrity()
