"""KV-cache events: what a router needs to keep an index of which core holds which prefixes.

The shape is vLLM's KV events. The allocator records them while someone subscribes
(``BlockAllocator.record_kv_events``); the core drains them after each step and sends them as one
``KVEventBatch`` to the API servers with subscribers (``core_messages`` packs it), which stream them
to their ``SubscribeKVEvents`` callers. Standard library only: the allocator imports it.

Hashes are the allocator's chained prefix hashes (``hash((parent_hash, tuple(block_token_ids)))``),
Python ints in the signed 64-bit range. They cross the internal link as int64 and the public API
as ``fixed64``: the same 64 bits, two's complement (``block_hash & 0xFFFF_FFFF_FFFF_FFFF``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

UINT64_MASK = (1 << 64) - 1


@dataclass(slots=True)
class BlockStored:
    """Full blocks whose prefix hashes were registered, as one chain: each block's parent is the
    previous one, the first one's is ``parent_block_hash``."""

    block_hashes: list[int]
    parent_block_hash: int | None  # None: the first block is a sequence's first block
    token_ids: list[int]  # block_size tokens per block, concatenated
    block_size: int


@dataclass(slots=True)
class BlockRemoved:
    """Hashes evicted: their blocks were taken for reuse (no longer a prefix hit)."""

    block_hashes: list[int]


@dataclass(slots=True)
class AllBlocksCleared:
    """Every hash is gone (the block accounting started over, e.g. the worker was lost)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class KVEventBatch:
    """One step's events of one engine core, oldest first."""

    core_index: int  # which engine core (pagewire runs one: 0)
    seq: int  # 1, 2, ... per core: one more for each batch the core sends
    events: list[KVEvent] = field(default_factory=list)


def to_uint64(block_hash: int) -> int:
    """A hash's public wire form (module docstring)."""
    return block_hash & UINT64_MASK
