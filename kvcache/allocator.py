"""KV-cache block allocator: block pool, refcounts, free LRU list, prefix-cache hashes, COW.

The scheduler owns this allocator and decides which physical block ids every sequence uses;
the worker only applies the resulting block tables and ``(src, dst)`` copies. Pure Python
(standard library only): it never imports torch or numpy.

Invariants (checked by ``check_integrity``):

- every block is either free (refcount 0) or used (refcount > 0); free + used == num_blocks;
- a block's refcount equals the number of block-table entries of live sequences naming it;
- the free list holds exactly the refcount-0 blocks, ordered from least to most recently freed;
  allocation pops the head, freeing appends to the tail;
- a block whose refcount is 0 and hash is set is in the free list and can be revived by a
  request with the same prefix; popping it for reuse (eviction) drops its hash;
- ``_hash_to_block`` and the per-block hashes agree both ways; only full blocks whose tokens
  were all computed get a hash, and a hash maps to at most one block (the first registered);
- a sequence of ``n`` tokens holds exactly ``ceil(n / block_size)`` blocks.

Block hashes chain: ``hash((parent_hash, tuple(block_token_ids)))`` with a fixed root value,
so equal hashes mean (up to 64-bit collisions) equal prefixes, not just equal blocks.

KV events (``pagewire_common.kv_events``): while ``record_kv_events(True)``, registering a hash,
evicting one and ``reset`` append an event to a list that ``take_kv_events`` drains; while off
(the default) the only cost is a ``None`` check where a hash is registered or evicted.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from pagewire_common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

# Parent hash of a sequence's first block. An int, because str hashes vary per process.
_ROOT_BLOCK_HASH = 0x70A6E817E
# Link value of a block that is not in the free list (only meaning of -1 in the link arrays).
_DETACHED = -1


def chain_block_hash(parent_hash: int, block_token_ids: Sequence[int]) -> int:
    """The prefix hash of one full block: its parent's hash chained with its token ids."""
    return hash((parent_hash, tuple(block_token_ids)))


def prefix_block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The chained hashes of the full blocks at the start of ``token_ids``, as the allocator
    registers them (the API servers' router compares them with the cores' KV events)."""
    hashes: list[int] = []
    parent_hash = _ROOT_BLOCK_HASH
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent_hash = chain_block_hash(parent_hash, token_ids[start : start + block_size])
        hashes.append(parent_hash)
    return hashes


class Allocation(NamedTuple):
    block_ids: list[int]  # the sequence's full block table after allocation
    num_cached_tokens: int  # tokens whose K/V is already in the cache (prefix hit)
    copies: list[tuple[int, int]]  # (src, dst) block copies the worker must do BEFORE computing


class AppendResult(NamedTuple):
    block_table_start: int  # index in the block table from which `block_ids` replaces/extends it
    block_ids: list[int]  # new block ids written at [block_table_start:] (empty if none needed)
    copies: list[tuple[int, int]]  # (src, dst) copy-on-write pairs (empty normally)


class AllocatorIntegrityError(AssertionError):
    """Raised by ``BlockAllocator.check_integrity`` when an invariant does not hold."""


_NO_BLOCKS: list[int] = []  # shared empty results of the fast path: callers must not modify them
_NO_COPIES: list[tuple[int, int]] = []


class BlockAllocator:
    """Fixed pool of ``num_blocks`` KV-cache blocks of ``block_size`` tokens each (the engine
    passes the settings' values: no default here to drift from theirs)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._kv_events: list[KVEvent] | None = None  # recorded events, or None when not recording
        self.reset()

    def reset(self) -> None:
        """Drop all sequences and all hashes; the free list goes back to 0, 1, ..., num_blocks-1."""
        n = self.num_blocks
        self._ref_counts = [0] * n
        self._block_hashes: list[int | None] = [None] * n
        self._hash_to_block: dict[int, int] = {}
        # Circular doubly-linked free list; index n is the sentinel (head = next[n], tail = prev[n]).
        self._sentinel = n
        self._next_free = list(range(1, n + 1)) + [0]
        self._prev_free = [n] + list(range(0, n))
        self._num_free = n
        self._seq_block_ids: dict[int, list[int]] = {}
        self._seq_num_tokens: dict[int, int] = {}
        # Chained hashes of the sequence's first blocks, computed whether or not they were
        # registered (a duplicate stays unhashed but its hash is still the next block's parent).
        self._seq_block_hashes: dict[int, list[int]] = {}
        # blocks whose hash was registered for the plan being built (``cache_blocks``, until
        # ``begin_plan``): their K/V is written by that plan's step, after the copies it carries
        self._written_by_this_plan: set[int] = set()
        if self._kv_events is not None:
            self._kv_events[:] = [AllBlocksCleared()]  # what was recorded before no longer matters

    def begin_plan(self) -> None:
        """A new step plan is being built: the blocks registered for the plan before are written
        by a step that runs before this one's block copies."""
        self._written_by_this_plan.clear()

    # ---- KV events ----------------------------------------------------------------------
    def record_kv_events(self, on: bool) -> None:
        """Start or stop recording KV events; stopping drops what was not taken."""
        if not on:
            self._kv_events = None
        elif self._kv_events is None:
            self._kv_events = []

    def take_kv_events(self) -> list[KVEvent]:
        """The events recorded since the last call, oldest first (empty when not recording)."""
        events = self._kv_events
        if not events:
            return []
        self._kv_events = []
        return events

    def _record_stored(self, block_hash: int, parent_hash: int, token_ids: Sequence[int], block_index: int) -> None:
        start = block_index * self.block_size
        tokens = token_ids[start : start + self.block_size]
        events = self._kv_events
        last = events[-1] if events else None
        if isinstance(last, BlockStored) and last.block_hashes[-1] == parent_hash:
            last.block_hashes.append(block_hash)  # the chain goes on: one event
            last.token_ids.extend(tokens)
            return
        parent = None if block_index == 0 else parent_hash
        events.append(BlockStored([block_hash], parent, list(tokens), self.block_size))

    def _record_removed(self, block_hash: int) -> None:
        events = self._kv_events
        last = events[-1] if events else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.append(block_hash)
        else:
            events.append(BlockRemoved([block_hash]))

    # ---- counts -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks with refcount 0, cached-but-free ones included."""
        return self._num_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self._num_free

    @property
    def num_cached_blocks(self) -> int:
        """Blocks that have a registered hash, free or used."""
        return len(self._hash_to_block)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def has_seq(self, seq_id: int) -> bool:
        return seq_id in self._seq_block_ids

    def block_ids(self, seq_id: int) -> list[int]:
        """A copy of the sequence's block table."""
        return list(self._blocks_of(seq_id))

    # ---- free list ----------------------------------------------------------------------
    def _unlink(self, block_id: int) -> None:
        prev, next_ = self._prev_free[block_id], self._next_free[block_id]
        self._next_free[prev] = next_
        self._prev_free[next_] = prev
        self._prev_free[block_id] = self._next_free[block_id] = _DETACHED
        self._num_free -= 1

    def _append_free(self, block_id: int) -> None:
        tail = self._prev_free[self._sentinel]
        self._next_free[tail] = block_id
        self._prev_free[block_id] = tail
        self._next_free[block_id] = self._sentinel
        self._prev_free[self._sentinel] = block_id
        self._num_free += 1

    def _pop_free(self) -> int:
        """Take the least recently freed block, evicting its cached hash if it has one."""
        block_id = self._next_free[self._sentinel]
        assert block_id != self._sentinel, "free list is empty (need was not checked)"
        self._unlink(block_id)
        block_hash = self._block_hashes[block_id]
        if block_hash is not None:
            del self._hash_to_block[block_hash]
            self._block_hashes[block_id] = None
            if self._kv_events is not None:
                self._record_removed(block_hash)
        self._ref_counts[block_id] = 1
        return block_id

    def _pop_free_many(self, count: int) -> list[int]:
        """``count`` blocks taken as ``count`` calls of ``_pop_free`` would take them (head first,
        evicting their hashes in that order), in one walk of the free list."""
        if count == 1:
            return [self._pop_free()]
        if count <= 0:
            return []
        next_free, prev_free, block_hashes, ref_counts = self._next_free, self._prev_free, self._block_hashes, self._ref_counts
        sentinel = self._sentinel
        assert count <= self._num_free, "free list is short (need was not checked)"
        taken: list[int] = []
        block_id = next_free[sentinel]
        for _ in range(count):
            taken.append(block_id)
            following = next_free[block_id]
            prev_free[block_id] = next_free[block_id] = _DETACHED
            ref_counts[block_id] = 1
            block_hash = block_hashes[block_id]
            if block_hash is not None:
                del self._hash_to_block[block_hash]
                block_hashes[block_id] = None
                if self._kv_events is not None:
                    self._record_removed(block_hash)
            block_id = following
        next_free[sentinel] = block_id
        prev_free[block_id] = sentinel
        self._num_free -= count
        return taken

    def _acquire(self, block_id: int) -> None:
        """Add a reference to a cached block, reviving it from the free list if needed."""
        if self._ref_counts[block_id] == 0:
            self._unlink(block_id)
        self._ref_counts[block_id] += 1

    def _release(self, block_id: int) -> None:
        self._ref_counts[block_id] -= 1
        if self._ref_counts[block_id] == 0:
            self._append_free(block_id)  # keeps its hash: it can be revived

    # ---- prefix cache -------------------------------------------------------------------
    def _block_hash(self, parent_hash: int, token_ids: Sequence[int], block_index: int) -> int:
        start = block_index * self.block_size
        return chain_block_hash(parent_hash, token_ids[start : start + self.block_size])

    def _match_prefix(self, token_ids: Sequence[int]) -> tuple[list[int], list[int]]:
        """Block ids and hashes of the longest chain of cached full blocks at the start."""
        block_ids: list[int] = []
        hashes: list[int] = []
        if not self.enable_prefix_caching:
            return block_ids, hashes
        parent_hash = _ROOT_BLOCK_HASH
        for block_index in range(len(token_ids) // self.block_size):
            parent_hash = self._block_hash(parent_hash, token_ids, block_index)
            block_id = self._hash_to_block.get(parent_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
            hashes.append(parent_hash)
        return block_ids, hashes

    def num_cached_tokens_for(self, token_ids: Sequence[int]) -> int:
        """How many tokens a new sequence with these tokens would get from the cache (a peek)."""
        matched_block_ids, _ = self._match_prefix(token_ids)
        num_matched_tokens = len(matched_block_ids) * self.block_size
        if matched_block_ids and num_matched_tokens == len(token_ids):
            return num_matched_tokens - 1  # the last token is recomputed for its logits
        return num_matched_tokens

    def cache_blocks(self, seq_id: int, token_ids: Sequence[int], num_computed_tokens: int,
                     written_by_this_plan: bool = False) -> None:
        """Register hashes for the sequence's not-yet-hashed full blocks that lie entirely within
        the first ``num_computed_tokens`` of ``token_ids`` (all of the sequence's tokens).
        O(new blocks) per call. A hash already mapped to another block keeps that mapping.
        ``written_by_this_plan``: those tokens are computed by the step of the plan being built
        (the scheduler counts them before the step runs): until ``begin_plan``, a prompt this plan
        admits does not copy such a block (``allocate``)."""
        if not self.enable_prefix_caching:
            return
        block_ids = self._blocks_of(seq_id)
        if num_computed_tokens > self._seq_num_tokens[seq_id] or num_computed_tokens > len(token_ids):
            raise ValueError(
                f"seq {seq_id}: num_computed_tokens={num_computed_tokens} exceeds its length "
                f"{self._seq_num_tokens[seq_id]} or len(token_ids)={len(token_ids)}"
            )
        hashes = self._seq_block_hashes[seq_id]
        block_size, block_hashes, hash_to_block = self.block_size, self._block_hashes, self._hash_to_block
        parent_hash = hashes[-1] if hashes else _ROOT_BLOCK_HASH
        for block_index in range(len(hashes), num_computed_tokens // block_size):
            start = block_index * block_size
            block_hash = chain_block_hash(parent_hash, token_ids[start : start + block_size])
            hashes.append(block_hash)
            block_id = block_ids[block_index]
            if block_hashes[block_id] is None and block_hash not in hash_to_block:
                block_hashes[block_id] = block_hash
                hash_to_block[block_hash] = block_id
                if written_by_this_plan:
                    self._written_by_this_plan.add(block_id)
                if self._kv_events is not None:
                    self._record_stored(block_hash, parent_hash, token_ids, block_index)
            parent_hash = block_hash

    # ---- sequences ----------------------------------------------------------------------
    def _blocks_of(self, seq_id: int) -> list[int]:
        block_ids = self._seq_block_ids.get(seq_id)
        if block_ids is None:
            raise ValueError(f"unknown seq_id {seq_id}")
        return block_ids

    def allocate(self, seq_id: int, token_ids: Sequence[int], use_prefix_cache: bool = True) -> Allocation | None:
        """Give a new sequence blocks for all of ``token_ids``: cached prefix blocks first, fresh
        blocks for the rest. If every token is cached, the last token is recomputed and the last
        (shared) block is copied first. None, with nothing changed, if the free pool is short.
        ``use_prefix_cache=False``: fresh blocks only (the sequence must compute every token, as
        one that wants prompt logprobs); its blocks are cached as they fill all the same."""
        if seq_id in self._seq_block_ids:
            raise ValueError(f"seq_id {seq_id} already holds blocks")
        if len(token_ids) == 0:
            raise ValueError("token_ids is empty")
        matched_block_ids, matched_hashes = self._match_prefix(token_ids) if use_prefix_cache else ([], [])
        num_matched_tokens = len(matched_block_ids) * self.block_size
        if num_matched_tokens == len(token_ids) and matched_block_ids[-1] in self._written_by_this_plan:
            # every token is cached, but the last block's K/V is written by the step being planned,
            # after that plan's copies: copied now it would be unwritten, so it is computed again
            matched_block_ids.pop()
            matched_hashes.pop()
            num_matched_tokens -= self.block_size
        num_fresh = self.num_blocks_for(len(token_ids)) - len(matched_block_ids)
        cow_src = None
        if matched_block_ids and num_matched_tokens == len(token_ids):
            cow_src = matched_block_ids.pop()
            matched_hashes.pop()  # registered again by cache_blocks once recomputed (a duplicate)
            num_fresh += 1
        # Revived blocks leave the free pool too. A free COW source is pinned while dst is taken
        # (so dst is never src itself), which makes it unavailable for this request.
        num_revived = sum(1 for b in matched_block_ids if self._ref_counts[b] == 0)
        num_pinned = 1 if cow_src is not None and self._ref_counts[cow_src] == 0 else 0
        if num_revived + num_fresh > self._num_free - num_pinned:
            return None

        for block_id in matched_block_ids:
            self._acquire(block_id)
        copies: list[tuple[int, int]] = []
        if cow_src is not None:
            self._acquire(cow_src)
            dst = self._pop_free()
            num_fresh -= 1
            self._release(cow_src)  # back to its owners, or to the free-list tail (most recent use)
            copies.append((cow_src, dst))
            matched_block_ids.append(dst)
            num_cached_tokens = len(token_ids) - 1
        else:
            num_cached_tokens = num_matched_tokens
        block_ids = matched_block_ids + self._pop_free_many(num_fresh)
        self._seq_block_ids[seq_id] = block_ids
        self._seq_num_tokens[seq_id] = len(token_ids)
        self._seq_block_hashes[seq_id] = matched_hashes
        return Allocation(list(block_ids), num_cached_tokens, copies)

    def fork(self, parent_id: int, child_id: int, num_tokens: int) -> Allocation | None:
        """Give a new sequence the parent's first ``num_tokens`` tokens of K/V (n samples of one
        prompt): it shares the blocks before the one holding token ``num_tokens - 1`` (their
        refcounts go up) and gets a private copy of that one, where it computes that token again
        to sample its own next token. None, with nothing changed, if no block is free."""
        if child_id in self._seq_block_ids:
            raise ValueError(f"seq_id {child_id} already holds blocks")
        parent = self._blocks_of(parent_id)
        num_blocks = self.num_blocks_for(num_tokens)
        if not 0 < num_tokens <= self._seq_num_tokens[parent_id]:
            raise ValueError(f"seq {parent_id}: cannot fork {num_tokens} of its {self._seq_num_tokens[parent_id]} tokens")
        if self._num_free < 1:
            return None
        shared = parent[: num_blocks - 1]
        for block_id in shared:
            self._acquire(block_id)
        src = parent[num_blocks - 1]
        block_ids = shared + [self._pop_free()]
        self._seq_block_ids[child_id] = block_ids
        self._seq_num_tokens[child_id] = num_tokens
        # the copy's hash is registered again by cache_blocks once it is full (a duplicate)
        self._seq_block_hashes[child_id] = self._seq_block_hashes[parent_id][: num_blocks - 1]
        return Allocation(list(block_ids), num_tokens - 1, [(src, block_ids[-1])])

    def grow_in_place(self, seq_id: int, num_tokens: int) -> bool:
        """The common decode case of ``append_slots``, without building a result: growth to
        ``num_tokens`` whose new tokens all land in the sequence's private last block changes no
        block. Records the new length and returns True; returns False, with nothing changed,
        when blocks must change or the request is not plain growth (``append_slots`` handles
        those, and raises for bad ones)."""
        block_ids = self._seq_block_ids.get(seq_id)
        if block_ids is None:
            return False
        num_old_tokens = self._seq_num_tokens[seq_id]
        num_held = len(block_ids)
        if (
            num_old_tokens <= num_tokens <= num_held * self.block_size
            and num_old_tokens // self.block_size >= num_held - 1
            and self._ref_counts[block_ids[-1]] == 1
        ):
            self._seq_num_tokens[seq_id] = num_tokens
            return True
        return False

    def growth_limit(self, seq_id: int) -> int:
        """The most tokens the sequence can hold with no block changed: its blocks' capacity when
        its last block is private, else its current length. ``grow_in_place`` succeeds exactly up to
        here. Only this sequence's own ``append_slots`` changes it (a block another sequence comes
        to share is full, so the limit is its length either way)."""
        block_ids = self._blocks_of(seq_id)
        if self._ref_counts[block_ids[-1]] == 1:
            return len(block_ids) * self.block_size
        return self._seq_num_tokens[seq_id]

    def append_block(self, seq_id: int) -> int | None:
        """The common rollover of ``append_slots``, without building a result: a sequence whose
        blocks are all full grows by one token into a fresh block, which is returned (appended to
        its table). None, with nothing changed, if no block is free."""
        block_ids = self._blocks_of(seq_id)
        num_tokens = self._seq_num_tokens[seq_id]
        if num_tokens != len(block_ids) * self.block_size:
            raise ValueError(f"seq {seq_id}: its last block is not full ({num_tokens} tokens in {len(block_ids)} blocks)")
        if not self._num_free:
            return None
        block_id = self._pop_free()
        block_ids.append(block_id)
        self._seq_num_tokens[seq_id] = num_tokens + 1
        return block_id

    def grow_within_limit(self, seq_id: int, num_tokens: int) -> None:
        """``grow_in_place`` for growth the caller has checked against ``growth_limit`` (not
        checked again here; ``check_integrity`` finds a length past a sequence's blocks)."""
        self._seq_num_tokens[seq_id] = num_tokens

    def grow_in_place_many(self, seq_ids: list[int], num_tokens: list[int]) -> None:
        """``grow_in_place`` for many sequences at once, for growth the caller has checked against
        ``growth_limit`` (not checked again here; ``check_integrity`` finds a length past a
        sequence's blocks)."""
        self._seq_num_tokens.update(zip(seq_ids, num_tokens))

    def append_slots(self, seq_id: int, num_tokens: int) -> AppendResult | None:
        """Make room for ``num_tokens`` tokens in total: new blocks on rollover, and a private
        copy of the block the first new token lands in if that block is shared (copy-on-write).
        None, with nothing changed, if the free pool is short."""
        block_ids = self._blocks_of(seq_id)
        num_old_tokens = self._seq_num_tokens[seq_id]
        if num_tokens < num_old_tokens:
            raise ValueError(f"seq {seq_id}: num_tokens={num_tokens} < current length {num_old_tokens}")
        if self.grow_in_place(seq_id, num_tokens):
            return AppendResult(len(block_ids), _NO_BLOCKS, _NO_COPIES)
        num_new_blocks = self.num_blocks_for(num_tokens) - len(block_ids)
        write_index = num_old_tokens // self.block_size  # block of the first new token
        needs_copy = (
            num_tokens > num_old_tokens
            and write_index < len(block_ids)
            and self._ref_counts[block_ids[write_index]] > 1
        )
        if num_new_blocks + int(needs_copy) > self._num_free:
            return None

        block_table_start = len(block_ids)
        copies: list[tuple[int, int]] = []
        if needs_copy:
            src = block_ids[write_index]
            dst = self._pop_free()
            self._release(src)  # refcount > 1, so it stays used by its other owners
            block_ids[write_index] = dst
            copies.append((src, dst))
            block_table_start = write_index
        block_ids.extend(self._pop_free_many(num_new_blocks))
        self._seq_num_tokens[seq_id] = num_tokens
        return AppendResult(block_table_start, block_ids[block_table_start:], copies)

    def free(self, seq_id: int) -> None:
        """Release the sequence's blocks last block first, so a prompt's tail is evicted before
        its (more often shared) head."""
        block_ids = self._blocks_of(seq_id)
        ref_counts, next_free, prev_free = self._ref_counts, self._next_free, self._prev_free
        sentinel = self._sentinel
        tail = prev_free[sentinel]
        num_freed = 0
        for block_id in reversed(block_ids):  # _release, inlined: the tail grows block by block
            ref_count = ref_counts[block_id] - 1
            ref_counts[block_id] = ref_count
            if ref_count == 0:  # keeps its hash: it can be revived
                next_free[tail] = block_id
                prev_free[block_id] = tail
                tail = block_id
                num_freed += 1
        if num_freed:
            next_free[tail] = sentinel
            prev_free[sentinel] = tail
            self._num_free += num_freed
        del self._seq_block_ids[seq_id]
        del self._seq_num_tokens[seq_id]
        del self._seq_block_hashes[seq_id]

    # ---- checks -------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise ``AllocatorIntegrityError`` (an ``AssertionError``) naming the first broken
        invariant."""

        def check(ok: bool, message: str) -> None:
            if not ok:
                raise AllocatorIntegrityError(f"BlockAllocator integrity: {message}")

        n = self.num_blocks
        free_order: list[int] = []
        node = self._sentinel
        while True:
            next_ = self._next_free[node]
            check(0 <= next_ <= n, f"free-list next of {node} is {next_}")
            check(self._prev_free[next_] == node, f"free-list prev of {next_} is not {node}")
            if next_ == self._sentinel:
                break
            check(len(free_order) < n, "free list has a cycle")
            free_order.append(next_)
            node = next_
        free_set = set(free_order)
        check(len(free_set) == len(free_order), "a block appears twice in the free list")
        check(len(free_order) == self._num_free, f"free list length {len(free_order)} != num_free {self._num_free}")

        expected_ref_counts = [0] * n
        for seq_id, block_ids in self._seq_block_ids.items():
            num_tokens = self._seq_num_tokens[seq_id]
            check(
                len(block_ids) == self.num_blocks_for(num_tokens),
                f"seq {seq_id} holds {len(block_ids)} blocks for {num_tokens} tokens",
            )
            check(len(self._seq_block_hashes[seq_id]) <= len(block_ids), f"seq {seq_id} hashed past its blocks")
            for block_index, block_id in enumerate(block_ids):
                check(0 <= block_id < n, f"seq {seq_id} holds invalid block id {block_id}")
                expected_ref_counts[block_id] += 1
                if block_index < len(self._seq_block_hashes[seq_id]) and self._block_hashes[block_id] is not None:
                    check(
                        self._block_hashes[block_id] == self._seq_block_hashes[seq_id][block_index],
                        f"seq {seq_id} block {block_id} hash differs from the sequence's chain",
                    )
        num_used = 0
        for block_id in range(n):
            ref_count = self._ref_counts[block_id]
            check(
                ref_count == expected_ref_counts[block_id],
                f"block {block_id} refcount {ref_count} != {expected_ref_counts[block_id]} table entries",
            )
            check((ref_count == 0) == (block_id in free_set), f"block {block_id} refcount {ref_count} vs free list")
            if ref_count > 0:
                num_used += 1
                check(
                    self._prev_free[block_id] == self._next_free[block_id] == _DETACHED,
                    f"used block {block_id} still has free-list links",
                )
            block_hash = self._block_hashes[block_id]
            if block_hash is not None:
                check(self._hash_to_block.get(block_hash) == block_id, f"block {block_id} hash not indexed to it")
        check(len(free_order) + num_used == n, f"free {len(free_order)} + used {num_used} != total {n}")
        for block_hash, block_id in self._hash_to_block.items():
            check(0 <= block_id < n, f"hash index points at invalid block id {block_id}")
            check(self._block_hashes[block_id] == block_hash, f"hash index entry for block {block_id} disagrees")
        if not self.enable_prefix_caching:
            check(not self._hash_to_block, "hashes registered with prefix caching off")
