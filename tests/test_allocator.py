"""Unit tests for kvcache.allocator: exact block ids, eviction order, COW, prefix cache."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest

from kvcache.allocator import (
    Allocation,
    AllocatorIntegrityError,
    AppendResult,
    BlockAllocator,
)

BS = 4  # block size used throughout: small, so block boundaries are easy to read


@pytest.fixture
def make_allocator():
    """Build allocators and check every one's integrity when the test ends."""
    created: list[BlockAllocator] = []

    def make(num_blocks: int = 8, block_size: int = BS, enable_prefix_caching: bool = True) -> BlockAllocator:
        allocator = BlockAllocator(num_blocks, block_size, enable_prefix_caching)
        created.append(allocator)
        return allocator

    yield make
    for allocator in created:
        allocator.check_integrity()


def tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def free_order(allocator: BlockAllocator) -> list[int]:
    """The free list from head (next to be popped) to tail. White-box: walks the links."""
    order = []
    node = allocator._next_free[allocator._sentinel]
    while node != allocator._sentinel:
        order.append(node)
        node = allocator._next_free[node]
    return order


def ref_count(allocator: BlockAllocator, block_id: int) -> int:
    return allocator._ref_counts[block_id]


def fork(allocator: BlockAllocator, parent_seq_id: int, child_seq_id: int) -> None:
    """Share all of a sequence's blocks with a new sequence, the way a parallel-sampling fork
    would. The public API has no fork: prefix hits share only full blocks, and a fully cached
    prompt copies its last block, so a shared *partially filled* last block cannot be built
    through it. This white-box helper builds that state (consistently: integrity holds) to test
    append_slots' copy-on-write path."""
    block_ids = allocator.block_ids(parent_seq_id)
    allocator._seq_block_ids[child_seq_id] = list(block_ids)
    allocator._seq_num_tokens[child_seq_id] = allocator._seq_num_tokens[parent_seq_id]
    allocator._seq_block_hashes[child_seq_id] = list(allocator._seq_block_hashes[parent_seq_id])
    for block_id in block_ids:
        allocator._ref_counts[block_id] += 1
    allocator.check_integrity()


def test_constructor_validates():
    with pytest.raises(ValueError):
        BlockAllocator(0, 16, True)
    with pytest.raises(ValueError):
        BlockAllocator(4, 0, True)
    allocator = BlockAllocator(3, 16, True)
    assert (allocator.num_blocks, allocator.block_size, allocator.enable_prefix_caching) == (3, 16, True)
    assert allocator.num_blocks_for(0) == 0
    assert allocator.num_blocks_for(1) == 1
    assert allocator.num_blocks_for(16) == 1
    assert allocator.num_blocks_for(17) == 2
    allocator.check_integrity()


def test_fresh_allocation_ids(make_allocator):
    allocator = make_allocator(num_blocks=8)
    assert free_order(allocator) == [0, 1, 2, 3, 4, 5, 6, 7]
    assert allocator.allocate(1, tokens(0, 10)) == Allocation([0, 1, 2], 0, [])
    assert allocator.allocate(2, tokens(100, 4)) == Allocation([3], 0, [])
    assert allocator.block_ids(1) == [0, 1, 2]
    assert allocator.has_seq(1) and allocator.has_seq(2) and not allocator.has_seq(3)
    assert (allocator.num_free_blocks, allocator.num_used_blocks, allocator.num_cached_blocks) == (4, 4, 0)
    allocator.check_integrity()


def test_invalid_calls_raise(make_allocator):
    allocator = make_allocator()
    allocator.allocate(1, tokens(0, 5))
    with pytest.raises(ValueError):
        allocator.allocate(1, tokens(0, 5))  # already holds blocks
    with pytest.raises(ValueError):
        allocator.allocate(2, [])
    with pytest.raises(ValueError):
        allocator.append_slots(1, 4)  # shorter than its 5 tokens
    for call in (allocator.free, allocator.block_ids, lambda s: allocator.append_slots(s, 8)):
        with pytest.raises(ValueError):
            call(99)
    with pytest.raises(ValueError):
        allocator.cache_blocks(1, tokens(0, 9), 9)  # more computed tokens than it holds
    assert allocator.block_ids(1) == [0, 1]


def test_append_slots_rollover(make_allocator):
    allocator = make_allocator()
    allocator.allocate(1, tokens(0, 6))  # blocks [0, 1], 2 free slots in block 1
    assert allocator.append_slots(1, 6) == AppendResult(2, [], [])
    assert allocator.append_slots(1, 7) == AppendResult(2, [], [])
    assert allocator.append_slots(1, 8) == AppendResult(2, [], [])  # block 1 now exactly full
    assert allocator.append_slots(1, 9) == AppendResult(2, [2], [])  # rollover
    assert allocator.append_slots(1, 17) == AppendResult(3, [3, 4], [])  # a chunk spanning two blocks
    assert allocator.block_ids(1) == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError):
        allocator.append_slots(1, 16)
    allocator.check_integrity()


def test_decode_growth_in_bulk_and_into_fresh_blocks(make_allocator):
    """The scheduler's plain decodes: growth up to growth_limit in place (many at once), and a
    rollover of a sequence whose blocks are full into one fresh block."""
    allocator = make_allocator(num_blocks=4)
    allocator.allocate(1, tokens(0, 6))  # blocks [0, 1]
    allocator.allocate(2, tokens(50, 3))  # block [2]
    assert (allocator.growth_limit(1), allocator.growth_limit(2)) == (2 * BS, BS)
    with pytest.raises(ValueError, match="not full"):
        allocator.append_block(2)  # 3 tokens in a block of 4
    allocator.grow_in_place_many([1, 2], [8, 3])
    allocator.check_integrity()
    assert allocator.append_block(1) == 3
    assert allocator.block_ids(1) == [0, 1, 3] and allocator.growth_limit(1) == 3 * BS
    assert allocator.append_slots(1, 9) == AppendResult(3, [], [])  # the fresh block holds token 9
    allocator.grow_in_place_many([2], [BS])
    assert allocator.append_block(2) is None  # none free: nothing changed
    assert allocator.block_ids(2) == [2]
    allocator.free(1)
    allocator.free(2)


def test_not_enough_blocks_returns_none_and_changes_nothing(make_allocator):
    allocator = make_allocator(num_blocks=4)
    assert allocator.allocate(1, tokens(0, 12)) == Allocation([0, 1, 2], 0, [])
    assert allocator.allocate(2, tokens(100, 8)) is None
    assert not allocator.has_seq(2)
    assert free_order(allocator) == [3]
    assert allocator.append_slots(1, 17) is None  # needs 2 blocks, 1 free
    assert allocator.block_ids(1) == [0, 1, 2]
    allocator.check_integrity()
    assert allocator.append_slots(1, 13) == AppendResult(3, [3], [])  # length was left at 12
    assert allocator.append_slots(1, 17) is None
    assert allocator.num_free_blocks == 0
    allocator.check_integrity()


def test_not_enough_blocks_counts_revived_blocks(make_allocator):
    allocator = make_allocator(num_blocks=4)
    prompt = tokens(0, 8)
    allocator.allocate(1, prompt)  # [0, 1]
    allocator.cache_blocks(1, prompt, 8)
    allocator.free(1)  # free list [2, 3, 1, 0], blocks 0 and 1 cached
    assert allocator.allocate(2, tokens(100, 8)) == Allocation([2, 3], 0, [])
    # 2 free blocks, both cached: reviving them leaves nothing for the third (fresh) block.
    assert allocator.allocate(3, prompt + [50]) is None
    assert not allocator.has_seq(3)
    assert free_order(allocator) == [1, 0]
    assert allocator.num_cached_blocks == 2
    assert allocator.num_cached_tokens_for(prompt + [50]) == 8
    allocator.free(2)  # free list [1, 0, 3, 2]
    assert allocator.allocate(3, prompt + [50]) == Allocation([0, 1, 3], 8, [])
    assert free_order(allocator) == [2]
    allocator.check_integrity()


def test_free_releases_last_block_first(make_allocator):
    allocator = make_allocator(num_blocks=8)
    allocator.allocate(1, tokens(0, 12))  # [0, 1, 2]
    allocator.allocate(2, tokens(100, 4))  # [3]
    allocator.free(1)
    assert not allocator.has_seq(1)
    assert free_order(allocator) == [4, 5, 6, 7, 2, 1, 0]
    assert allocator.allocate(3, tokens(200, 28)) == Allocation([4, 5, 6, 7, 2, 1, 0], 0, [])
    allocator.free(2)
    allocator.free(3)
    assert free_order(allocator) == [3, 0, 1, 2, 7, 6, 5, 4]
    allocator.check_integrity()


def test_prefix_hit_revives_freed_blocks(make_allocator):
    allocator = make_allocator(num_blocks=8)
    prompt = tokens(0, 10)
    allocator.allocate(1, prompt)  # [0, 1, 2]
    allocator.cache_blocks(1, prompt, 10)  # full blocks 0 and 1; block 2 holds 2 tokens
    assert allocator.num_cached_blocks == 2
    allocator.free(1)
    assert free_order(allocator) == [3, 4, 5, 6, 7, 2, 1, 0]
    assert allocator.num_free_blocks == 8 and allocator.num_cached_blocks == 2  # cached-but-free

    new_prompt = prompt[:8] + [99, 98, 97]
    assert allocator.num_cached_tokens_for(new_prompt) == 8
    assert allocator.allocate(2, new_prompt) == Allocation([0, 1, 3], 8, [])
    assert [ref_count(allocator, b) for b in (0, 1, 3)] == [1, 1, 1]
    assert free_order(allocator) == [4, 5, 6, 7, 2]
    assert (allocator.num_free_blocks, allocator.num_used_blocks) == (5, 3)
    allocator.check_integrity()


def test_sharing_between_live_sequences(make_allocator):
    allocator = make_allocator(num_blocks=8)
    prompt = tokens(0, 10)
    allocator.allocate(1, prompt)  # [0, 1, 2]
    allocator.cache_blocks(1, prompt, 10)
    assert allocator.allocate(2, prompt[:8] + [99]) == Allocation([0, 1, 3], 8, [])
    assert [ref_count(allocator, b) for b in (0, 1, 2, 3)] == [2, 2, 1, 1]
    assert allocator.num_used_blocks == 4
    allocator.check_integrity()

    allocator.free(1)  # only block 2 drops to 0; 0 and 1 stay with seq 2
    assert [ref_count(allocator, b) for b in (0, 1, 2, 3)] == [1, 1, 0, 1]
    assert free_order(allocator) == [4, 5, 6, 7, 2]
    allocator.check_integrity()
    allocator.free(2)
    assert free_order(allocator) == [4, 5, 6, 7, 2, 3, 1, 0]
    assert allocator.num_cached_blocks == 2
    allocator.check_integrity()


def test_eviction_takes_least_recently_freed_cached_block(make_allocator):
    allocator = make_allocator(num_blocks=4)
    prompt_a, prompt_b = tokens(0, 4), tokens(100, 4)
    allocator.allocate(1, prompt_a)  # [0]
    allocator.cache_blocks(1, prompt_a, 4)
    allocator.allocate(2, prompt_b)  # [1]
    allocator.cache_blocks(2, prompt_b, 4)
    allocator.free(1)
    allocator.free(2)
    assert free_order(allocator) == [2, 3, 0, 1]
    assert allocator.num_cached_blocks == 2

    # Three fresh blocks: the two never-cached ones, then block 0 (freed before block 1).
    assert allocator.allocate(3, tokens(200, 12)) == Allocation([2, 3, 0], 0, [])
    assert allocator.num_cached_blocks == 1
    assert allocator.num_cached_tokens_for(prompt_a + [7]) == 0  # evicted: its hash is gone
    assert allocator.num_cached_tokens_for(prompt_b + [7]) == 4
    allocator.check_integrity()

    allocator.free(3)  # free list [1, 0, 3, 2]
    assert allocator.allocate(4, prompt_a + [7]) == Allocation([1, 0], 0, [])  # no hit; evicts 1
    assert allocator.num_cached_blocks == 0
    assert allocator.num_cached_tokens_for(prompt_b + [7]) == 0
    allocator.check_integrity()


def test_fully_cached_prompt_copies_last_block(make_allocator):
    allocator = make_allocator(num_blocks=8)
    prompt = tokens(0, 8)
    allocator.allocate(1, prompt)  # [0, 1]
    allocator.cache_blocks(1, prompt, 8)
    allocator.free(1)
    assert free_order(allocator) == [2, 3, 4, 5, 6, 7, 1, 0]
    assert allocator.num_cached_tokens_for(prompt) == 7

    # Block 0 is revived; the last token is recomputed into a private copy (2) of block 1.
    assert allocator.allocate(2, prompt) == Allocation([0, 2], 7, [(1, 2)])
    assert [ref_count(allocator, b) for b in (0, 1, 2)] == [1, 0, 1]
    # The source stays cached and free; it was just read, so it moves to the free-list tail.
    assert free_order(allocator) == [3, 4, 5, 6, 7, 1]
    assert allocator.num_cached_blocks == 2
    allocator.check_integrity()

    # Once computed, the copy has the same hash as block 1: the first mapping is kept.
    allocator.cache_blocks(2, prompt, 8)
    assert allocator.num_cached_blocks == 2
    assert allocator.num_cached_tokens_for(prompt + [9]) == 8
    assert allocator.allocate(3, prompt + [9]) == Allocation([0, 1, 3], 8, [])
    assert [ref_count(allocator, b) for b in (0, 1, 2, 3)] == [2, 1, 1, 1]
    allocator.check_integrity()


def test_fully_cached_prompt_shared_with_live_sequence(make_allocator):
    allocator = make_allocator(num_blocks=8)
    prompt = tokens(0, 8)
    allocator.allocate(1, prompt)  # [0, 1], still running
    allocator.cache_blocks(1, prompt, 8)
    assert allocator.allocate(2, prompt) == Allocation([0, 2], 7, [(1, 2)])
    assert [ref_count(allocator, b) for b in (0, 1, 2)] == [2, 1, 1]
    assert free_order(allocator) == [3, 4, 5, 6, 7]
    allocator.check_integrity()


def test_fully_cached_prompt_pins_free_source_block(make_allocator):
    # A free COW source is not available as the destination (dst must differ from src).
    allocator = make_allocator(num_blocks=2)
    prompt = tokens(0, 8)
    allocator.allocate(1, prompt)
    allocator.cache_blocks(1, prompt, 8)
    allocator.free(1)  # free list [1, 0]
    assert allocator.allocate(2, prompt) is None  # revive 0 + a dst other than 1: needs 3 blocks
    assert free_order(allocator) == [1, 0] and allocator.num_cached_blocks == 2
    allocator.check_integrity()

    allocator = make_allocator(num_blocks=3)
    allocator.allocate(1, prompt)
    allocator.cache_blocks(1, prompt, 8)
    allocator.free(1)  # free list [2, 1, 0]
    assert allocator.allocate(2, prompt) == Allocation([0, 2], 7, [(1, 2)])
    assert free_order(allocator) == [1]
    allocator.check_integrity()


def test_append_slots_copies_shared_partial_block(make_allocator):
    # See fork(): the public API cannot share a partially filled block, so the state is built
    # white-box. The public copy-on-write path is test_fully_cached_prompt_copies_last_block.
    allocator = make_allocator(num_blocks=8)
    allocator.allocate(1, tokens(0, 6))  # [0, 1], block 1 holds 2 tokens
    fork(allocator, 1, 2)
    assert [ref_count(allocator, b) for b in (0, 1)] == [2, 2]

    assert allocator.append_slots(2, 7) == AppendResult(1, [2], [(1, 2)])
    assert allocator.block_ids(2) == [0, 2]
    assert [ref_count(allocator, b) for b in (0, 1, 2)] == [2, 1, 1]
    assert allocator.append_slots(2, 7) == AppendResult(2, [], [])  # no new token, no copy
    assert allocator.append_slots(2, 8) == AppendResult(2, [], [])  # block 2 is private now
    assert allocator.append_slots(1, 9) == AppendResult(2, [3], [])  # block 1 private again
    allocator.check_integrity()

    fork(allocator, 1, 3)  # seq 1 and 3 share [0, 1, 3]; 9 tokens, block 3 holds 1
    # The copy and a rollover in one call: the table is rewritten from index 2.
    assert allocator.append_slots(3, 13) == AppendResult(2, [4, 5], [(3, 4)])
    assert allocator.block_ids(3) == [0, 1, 4, 5]
    assert [ref_count(allocator, b) for b in range(6)] == [3, 2, 1, 1, 1, 1]
    allocator.check_integrity()

    fork(allocator, 1, 4)
    allocator.allocate(5, tokens(100, 8))  # [6, 7]: the pool is empty
    assert allocator.append_slots(4, 10) is None  # the copy needs a block
    assert allocator.block_ids(4) == [0, 1, 3]
    assert allocator.append_slots(4, 9) == AppendResult(3, [], [])  # no new token, no copy
    allocator.check_integrity()


def test_grow_in_place_only_for_growth_inside_a_private_last_block(make_allocator):
    allocator = make_allocator(num_blocks=8)
    allocator.allocate(1, tokens(0, 6))  # [0, 1], block 1 holds 2 tokens
    assert allocator.grow_in_place(1, 7) and allocator.grow_in_place(1, 8)  # fills block 1
    assert not allocator.grow_in_place(1, 9)  # rollover needs a block: append_slots does it
    assert not allocator.grow_in_place(1, 7)  # shrinking is not growth (append_slots raises)
    assert not allocator.grow_in_place(99, 1)  # unknown sequence (append_slots raises)
    assert allocator.append_slots(1, 9) == AppendResult(2, [2], [])  # the length was recorded: 8
    fork(allocator, 1, 2)  # seq 2 shares [0, 1, 2]; block 2 holds 1 token
    assert not allocator.grow_in_place(2, 10)  # shared last block: a copy first
    assert not allocator.grow_in_place(1, 10)
    assert allocator.block_ids(2) == [0, 1, 2] and allocator.append_slots(2, 10) == AppendResult(2, [3], [(2, 3)])
    assert allocator.grow_in_place(2, 12)  # private now
    allocator.check_integrity()


def test_prefix_caching_disabled(make_allocator):
    allocator = make_allocator(num_blocks=8, enable_prefix_caching=False)
    prompt = tokens(0, 8)
    allocator.allocate(1, prompt)  # [0, 1]
    allocator.cache_blocks(1, prompt, 8)
    assert allocator.num_cached_blocks == 0
    allocator.free(1)
    assert allocator.num_cached_tokens_for(prompt) == 0
    assert allocator.allocate(2, prompt) == Allocation([2, 3], 0, [])
    assert allocator.allocate(3, prompt + [1]) == Allocation([4, 5, 6], 0, [])
    allocator.check_integrity()


def test_cache_blocks_registers_only_computed_full_blocks(make_allocator):
    allocator = make_allocator(num_blocks=8)
    prompt = tokens(0, 10)
    allocator.allocate(1, prompt)  # [0, 1, 2]
    assert allocator.num_cached_blocks == 0  # nothing at allocation time
    assert allocator.num_cached_tokens_for(prompt[:8] + [50]) == 0
    expected = {0: 0, 3: 0, 4: 1, 7: 1, 8: 2, 10: 2}  # num_computed_tokens -> cached blocks
    for num_computed_tokens, num_cached_blocks in expected.items():
        allocator.cache_blocks(1, prompt, num_computed_tokens)
        assert allocator.num_cached_blocks == num_cached_blocks
    allocator.check_integrity()

    all_tokens = prompt + [10, 11]  # two generated tokens fill block 2
    allocator.append_slots(1, 12)
    allocator.cache_blocks(1, all_tokens, 11)
    assert allocator.num_cached_blocks == 2
    allocator.cache_blocks(1, all_tokens, 12)
    assert allocator.num_cached_blocks == 3
    assert allocator.num_cached_tokens_for(all_tokens + [50]) == 12
    assert allocator.num_cached_tokens_for(all_tokens[:8] + [51, 52, 53, 54]) == 8
    # Hashes chain: the same second block after a different first block is no hit.
    assert allocator.num_cached_tokens_for([99, 99, 99, 99] + all_tokens[4:]) == 0
    allocator.check_integrity()


def test_duplicate_hash_keeps_first_block(make_allocator):
    allocator = make_allocator(num_blocks=8)
    prompt = tokens(10, 5)
    allocator.allocate(1, prompt)  # [0, 1]
    allocator.allocate(2, prompt)  # [2, 3]: nothing computed yet, so no hit
    allocator.cache_blocks(1, prompt, 5)
    allocator.cache_blocks(2, prompt, 5)  # block 2 has the same hash as block 0: stays unhashed
    assert allocator.num_cached_blocks == 1
    allocator.check_integrity()

    # Seq 2's chain continues through its unhashed duplicate: block 3 gets the next hash.
    all_tokens = prompt + [15, 16, 17]
    assert allocator.append_slots(2, 8) == AppendResult(2, [], [])
    allocator.cache_blocks(2, all_tokens, 8)
    assert allocator.num_cached_blocks == 2
    assert allocator.allocate(3, all_tokens + [99]) == Allocation([0, 3, 4], 8, [])
    assert [ref_count(allocator, b) for b in range(5)] == [2, 1, 1, 2, 1]
    allocator.check_integrity()

    allocator.free(1)  # 1 drops to 0; 0 is still held by seq 3
    allocator.free(2)  # 3 is still held by seq 3; 2 drops to 0
    allocator.free(3)  # 4, 3, 0
    assert free_order(allocator) == [5, 6, 7, 1, 2, 4, 3, 0]
    assert allocator.num_cached_blocks == 2
    allocator.check_integrity()


def test_reset(make_allocator):
    allocator = make_allocator(num_blocks=6)
    prompt = tokens(0, 9)
    allocator.allocate(1, prompt)
    allocator.cache_blocks(1, prompt, 9)
    allocator.allocate(2, tokens(100, 5))
    allocator.free(1)
    allocator.reset()
    assert (allocator.num_free_blocks, allocator.num_used_blocks, allocator.num_cached_blocks) == (6, 0, 0)
    assert not allocator.has_seq(1) and not allocator.has_seq(2)
    assert free_order(allocator) == [0, 1, 2, 3, 4, 5]
    assert allocator.num_cached_tokens_for(prompt) == 0
    assert allocator.allocate(2, prompt) == Allocation([0, 1, 2], 0, [])
    allocator.check_integrity()


def _corrupt_ref_count(allocator: BlockAllocator) -> None:
    allocator._ref_counts[0] += 1


def _corrupt_hash_index(allocator: BlockAllocator) -> None:
    allocator._hash_to_block[12345] = 3


def _corrupt_free_list(allocator: BlockAllocator) -> None:
    allocator._prev_free[allocator._next_free[allocator._sentinel]] = 5


def _corrupt_block_table(allocator: BlockAllocator) -> None:
    allocator._seq_block_ids[1].append(7)


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (_corrupt_ref_count, "refcount"),
        (_corrupt_hash_index, "hash index"),
        (_corrupt_free_list, "free-list"),
        (_corrupt_block_table, "holds 3 blocks for 5 tokens"),
    ],
)
def test_check_integrity_detects_corruption(corrupt, message):
    allocator = BlockAllocator(8, BS, True)
    prompt = tokens(0, 5)
    allocator.allocate(1, prompt)  # [0, 1]
    allocator.cache_blocks(1, prompt, 5)
    allocator.check_integrity()
    corrupt(allocator)
    with pytest.raises(AssertionError, match=message) as excinfo:
        allocator.check_integrity()
    assert isinstance(excinfo.value, AllocatorIntegrityError)


def test_randomized_stress_against_simulated_kv_cache():
    """Random allocate/append/compute+cache/free with a simulated physical cache: every cached
    token read by a prefix hit must hold the token the sequence expects there, and no write may
    land in a shared or hashed block."""
    rng = random.Random(1234)
    num_blocks = 24
    allocator = BlockAllocator(num_blocks, BS, True)
    kv: list[list[int | None]] = [[None] * BS for _ in range(num_blocks)]  # token in each slot
    bases = [[rng.randrange(3) for _ in range(20)] for _ in range(4)]  # shared prefixes
    seq_tokens: dict[int, list[int]] = {}
    seq_num_computed: dict[int, int] = {}
    next_seq_id = 0
    counts = {"hit": 0, "cow": 0, "none": 0, "evict": 0}

    def apply_copies(copies: list[tuple[int, int]]) -> None:
        for src, dst in copies:
            assert src != dst
            kv[dst] = list(kv[src])

    def compute(seq_id: int, num_computed: int) -> None:
        block_ids = allocator.block_ids(seq_id)
        owners = [b for s in seq_tokens for b in allocator.block_ids(s)]
        for position in range(seq_num_computed[seq_id], num_computed):
            block_id = block_ids[position // BS]
            assert owners.count(block_id) == 1, f"write into shared block {block_id}"
            assert allocator._block_hashes[block_id] is None, f"write into hashed block {block_id}"
            kv[block_id][position % BS] = seq_tokens[seq_id][position]
        seq_num_computed[seq_id] = num_computed
        allocator.cache_blocks(seq_id, seq_tokens[seq_id], num_computed)

    for _ in range(3000):
        op = rng.random()
        if op < 0.3 or not seq_tokens:
            base = rng.choice(bases)
            prompt = base[: rng.randrange(len(base) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(6))]
            if not prompt:
                prompt = [0]
            num_cached_blocks = allocator.num_cached_blocks
            expected_cached = allocator.num_cached_tokens_for(prompt)
            allocation = allocator.allocate(next_seq_id, prompt)
            if allocation is None:
                counts["none"] += 1
            else:
                counts["hit"] += allocation.num_cached_tokens > 0
                counts["cow"] += bool(allocation.copies)
                counts["evict"] += allocator.num_cached_blocks < num_cached_blocks
                assert allocation.num_cached_tokens == expected_cached
                assert allocation.block_ids == allocator.block_ids(next_seq_id)
                assert len(allocation.block_ids) == allocator.num_blocks_for(len(prompt))
                apply_copies(allocation.copies)
                for position in range(allocation.num_cached_tokens):
                    assert kv[allocation.block_ids[position // BS]][position % BS] == prompt[position]
                seq_tokens[next_seq_id] = list(prompt)
                seq_num_computed[next_seq_id] = allocation.num_cached_tokens
                next_seq_id += 1
        else:
            seq_id = rng.choice(list(seq_tokens))
            if op < 0.55:
                new_tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 7))]
                old_table = allocator.block_ids(seq_id)
                result = allocator.append_slots(seq_id, len(seq_tokens[seq_id]) + len(new_tokens))
                if result is not None:
                    new_table = old_table[: result.block_table_start] + result.block_ids
                    assert new_table == allocator.block_ids(seq_id)
                    apply_copies(result.copies)
                    seq_tokens[seq_id].extend(new_tokens)
            elif op < 0.85:
                num_computed = seq_num_computed[seq_id]
                compute(seq_id, rng.randint(num_computed, len(seq_tokens[seq_id])))
            else:
                allocator.free(seq_id)
                del seq_tokens[seq_id], seq_num_computed[seq_id]
        allocator.check_integrity()

    assert all(count > 10 for count in counts.values()), counts
    for seq_id in list(seq_tokens):
        allocator.free(seq_id)
    assert allocator.num_free_blocks == num_blocks
    allocator.check_integrity()


def test_import_loads_neither_torch_nor_numpy():
    code = 'import sys, kvcache.allocator; assert "torch" not in sys.modules and "numpy" not in sys.modules'
    root = Path(__file__).resolve().parent.parent
    subprocess.run([sys.executable, "-c", code], cwd=root, check=True, timeout=60)


def test_no_copy_of_a_block_the_plan_being_built_writes():
    """A prompt whose every block is cached copies its last block before computing its last
    token; a block registered for the plan being built is written by that plan's step, after its
    copies, so it is left out of the match (computed again) until the next plan."""
    alloc = BlockAllocator(num_blocks=16, block_size=4, enable_prefix_caching=True)
    prompt = list(range(8))
    alloc.begin_plan()
    first = alloc.allocate(1, prompt)
    alloc.cache_blocks(1, prompt, 8, written_by_this_plan=True)  # the step being planned computes both blocks
    same_plan = alloc.allocate(2, prompt)
    assert same_plan.num_cached_tokens == 4 and same_plan.copies == []
    # the first block is shared (that step writes it before any row attends to it); the second is its own
    assert same_plan.block_ids[0] == first.block_ids[0] and same_plan.block_ids[1] != first.block_ids[1]
    alloc.begin_plan()  # a later plan: both blocks are written by then
    later = alloc.allocate(3, prompt)
    assert later.num_cached_tokens == 7 and len(later.copies) == 1
    alloc.check_integrity()
