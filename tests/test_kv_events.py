"""The API server's SubscribeKVEvents fan-out (``scheduler_svc/api/kv_events.py``)."""

from __future__ import annotations

import asyncio

import grpc

from pagewire_common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from scheduler_svc.api.kv_events import KVEventHub, batch_to_pb
from scheduler_svc.api.request import Failure


def _batch(seq: int) -> KVEventBatch:
    return KVEventBatch(0, seq, [BlockStored([-1 << 63, 5], None, [1, 2, 3, 4], 2), BlockRemoved([-2]),
                                 AllBlocksCleared()])


def test_batch_to_pb_gives_hashes_as_their_64_bits():
    msg = batch_to_pb(KVEventBatch(0, 3, [BlockStored([-1 << 63, 5], 7, [1, 2, 3, 4], 2), BlockRemoved([-2]),
                                          AllBlocksCleared()]))
    assert (msg.core_index, msg.seq) == (0, 3)
    stored, removed, cleared = msg.events
    assert list(stored.block_stored.block_hashes) == [1 << 63, 5]
    assert stored.block_stored.parent_block_hash == 7 and list(stored.block_stored.token_ids) == [1, 2, 3, 4]
    assert list(removed.block_removed.block_hashes) == [(1 << 64) - 2]
    assert cleared.HasField("all_blocks_cleared")
    assert not batch_to_pb(_batch(1)).events[0].block_stored.HasField("parent_block_hash")


def test_a_slow_subscriber_is_dropped_with_resource_exhausted_and_the_last_to_leave_turns_events_off():
    async def main():
        changes: list[bool] = []
        hub = KVEventHub(changes.append, max_queued=3)
        slow, fast = hub.subscribe(), hub.subscribe()
        fast_got = []
        for seq in range(1, 6):
            hub.publish(_batch(seq))
            fast_got += await fast.take()
        slow_got = await slow.take()
        hub.unsubscribe(fast)
        hub.publish(_batch(6))  # nobody left: nothing queued
        return changes, [m.seq for m in fast_got], slow_got, hub.has_subscribers

    changes, fast_seqs, slow_got, has_subscribers = asyncio.run(main())
    assert fast_seqs == [1, 2, 3, 4, 5]
    assert [m.seq for m in slow_got[:3]] == [1, 2, 3]
    assert isinstance(slow_got[3], Failure) and slow_got[3].code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert len(slow_got) == 4
    assert changes == [True, False] and not has_subscribers
