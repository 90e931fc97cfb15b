"""An API server's ``SubscribeKVEvents`` streams: the core's KV event batches fanned out to them.

The core sends its batches only to API servers that have subscribers (``CoreRequests.kv_events``,
sent when the first stream subscribes and when the last one leaves), and records them only while
some API server has. Each stream has a bounded queue: one that falls ``MAX_QUEUED_BATCHES`` behind
is ended with RESOURCE_EXHAUSTED rather than holding memory for it; losing the core ends every
stream with UNAVAILABLE (the router starts over from a fresh subscription).
"""

from __future__ import annotations

from collections.abc import Callable

import grpc

from pagewire_common.eventloop import Outbox
from pagewire_common.kv_events import BlockRemoved, BlockStored, KVEventBatch, to_uint64
from pagewire_common.v1 import generation_pb2 as pb
from scheduler_svc.api.request import Failure

# batches a stream may have waiting before it is dropped (a few seconds of steps)
MAX_QUEUED_BATCHES = 1024


class KVSubscriber:
    """One stream's queue: ``pb.KVEventBatch`` messages, then a ``Failure`` if it was dropped."""

    __slots__ = ("_outbox", "_num_queued")

    def __init__(self) -> None:
        self._outbox = Outbox()
        self._num_queued = 0  # batches put and not taken yet

    async def take(self) -> list:
        """Wait for at least one item; return all that are there, oldest first."""
        items = await self._outbox.take()
        self._num_queued = 0
        return items


class KVEventHub:
    """The API server's subscribers; ``on_change(True)`` when the first comes, ``(False)`` when
    the last goes (the server tells the core)."""

    def __init__(self, on_change: Callable[[bool], None], max_queued: int = MAX_QUEUED_BATCHES):
        self._on_change = on_change
        self._max_queued = max_queued
        self._subscribers: set[KVSubscriber] = set()

    @property
    def has_subscribers(self) -> bool:
        return bool(self._subscribers)

    def subscribe(self) -> KVSubscriber:
        subscriber = KVSubscriber()
        self._subscribers.add(subscriber)
        if len(self._subscribers) == 1:
            self._on_change(True)
        return subscriber

    def unsubscribe(self, subscriber: KVSubscriber) -> None:
        """The stream ended (or was dropped); idempotent."""
        if subscriber in self._subscribers:
            self._subscribers.discard(subscriber)
            if not self._subscribers:
                self._on_change(False)

    def publish(self, batch: KVEventBatch) -> None:
        """Queue one batch from the core on every stream, dropping streams that are full."""
        if not self._subscribers:
            return
        msg = batch_to_pb(batch)
        for subscriber in list(self._subscribers):
            if subscriber._num_queued >= self._max_queued:
                self._drop(subscriber, Failure(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                               f"KV events: this stream fell {self._max_queued} batches behind"))
                continue
            subscriber._num_queued += 1
            subscriber._outbox.put_nowait(msg)

    def fail_all(self, code: grpc.StatusCode, message: str) -> None:
        for subscriber in list(self._subscribers):
            self._drop(subscriber, Failure(code, message))

    def _drop(self, subscriber: KVSubscriber, failure: Failure) -> None:
        subscriber._outbox.put_nowait(failure)
        self.unsubscribe(subscriber)


def batch_to_pb(batch: KVEventBatch) -> pb.KVEventBatch:
    """The public form: hashes as the 64 bits of the allocator's signed values (uint64)."""
    msg = pb.KVEventBatch(core_index=batch.core_index, seq=batch.seq)
    for event in batch.events:
        if isinstance(event, BlockStored):
            stored = pb.BlockStored(block_hashes=[to_uint64(h) for h in event.block_hashes],
                                    token_ids=event.token_ids, block_size=event.block_size)
            if event.parent_block_hash is not None:
                stored.parent_block_hash = to_uint64(event.parent_block_hash)
            msg.events.append(pb.KVEvent(block_stored=stored))
        elif isinstance(event, BlockRemoved):
            msg.events.append(pb.KVEvent(block_removed=pb.BlockRemoved(
                block_hashes=[to_uint64(h) for h in event.block_hashes])))
        else:
            msg.events.append(pb.KVEvent(all_blocks_cleared=pb.AllBlocksCleared()))
    return msg
