"""How the running sequences advance in one step: the part of ``Scheduler`` that gives each its
slice of the token budget, over the ``RunningBatch``'s arrays or, for a few sequences, in a loop.

Both give the plan and allocator state that a loop over ``Scheduler.running`` calling
``_schedule_one`` on each would (tests compare them): the rows whose order matters (block
allocations, prefix-cache offers, preemption) are taken one by one in running order either way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvcache.allocator import BlockAllocator
from pagewire_common.plan import StepPlan
from scheduler_svc.core.running_batch import RunningBatch

if TYPE_CHECKING:
    from scheduler_svc.core.sequence import Sequence

# below this many running sequences (or results), a step takes them one by one: the array
# operations cost more per step than they save
FAST_DECODE_MIN_ROWS = 64


class RunningStep:
    """Mixed into ``Scheduler``, whose state it uses: ``batch``, ``allocator``, ``running``,
    ``fast_decode`` and ``fast_decode_min_rows``, and whose per-sequence steps it calls
    (``_schedule_one``, ``_offer_blocks``)."""

    batch: RunningBatch
    allocator: BlockAllocator
    running: list[Sequence]
    fast_decode: bool
    fast_decode_min_rows: int
    _caching: bool
    _block_size: int

    def _schedule_running(self, plan: StepPlan, budget: int) -> int:
        """Give the running sequences their slices of ``budget``, in running order; returns what is
        left of it. Plain decodes (one token that fits in the sequence's blocks) are scheduled over
        the batch's arrays. A decode whose blocks are full takes a fresh block, and a decode that
        completes a block offers it to the prefix cache, one by one; prompt chunks and the rest go
        through ``_schedule_one``. Both in running order, as a loop over ``running`` would: an
        allocation may evict a cached block whose hash a later offer registers again. With fewer
        than ``fast_decode_min_rows`` sequences running, ``_schedule_each`` loops over them instead."""
        batch = self.batch
        order = batch.order()
        if not self.fast_decode or len(order) < self.fast_decode_min_rows:
            return self._schedule_each(plan, budget, order)
        computed, pending, known = batch.computed[order], batch.pending[order], batch.known[order]
        total = known + pending
        num_new = total - computed
        # nothing to compute, or a token still in flight already ends the sequence (another one
        # would only be thrown away)
        skip = (num_new <= 0) | ((pending > 0) & (total >= batch.max_tokens[order]))
        decode = ~skip & (num_new == 1)
        plain = decode & (computed < batch.limit[order])
        events = (~skip & ~plain).nonzero()[0]  # rows taken one by one
        if self._caching:
            offers = (plain & (known // self._block_size > batch.hashed[order])).nonzero()[0]
            if len(offers):
                events = np.sort(np.concatenate((events, offers)))
        scheduled: list[tuple[int, int, int, list[int]]] = []  # (row, tokens, block_table_start, new block ids)
        if len(events):
            rank = np.cumsum(plain, dtype=np.int64) - plain  # plain decodes before each row: the budget they take
            used, end, rolled = self._schedule_events(plan, budget, order, events, decode[events], rank[events],
                                                      scheduled)
            rows = (plain[:end] & (rank[:end] < budget - used)).nonzero()[0]
        else:
            used, rolled = 0, []
            rows = plain.nonzero()[0][:budget]
        # the plain decodes within the budget, and the rollovers: one token each
        num_plain = len(rows)
        if rolled:
            rows = np.concatenate((rows, rolled))
        slots = order[rows]
        new_computed = computed[rows] + 1
        batch.computed[slots] = new_computed
        batch.pending[slots] = pending[rows] + 1  # the worker samples a token this step
        num_slot_tokens = np.maximum(batch.slot_tokens[slots], new_computed)
        batch.slot_tokens[slots] = num_slot_tokens
        self.allocator.grow_in_place_many(batch.seq_id[slots].tolist(), num_slot_tokens.tolist())
        counts = np.ones(len(rows), dtype=np.int64)
        if scheduled:
            rows = np.concatenate((rows[:num_plain], [pos for pos, _, _, _ in scheduled]))
            counts = np.concatenate((counts[:num_plain], [num for _, num, _, _ in scheduled]))
            by_row = np.argsort(rows, kind="stable")
            rows, counts = rows[by_row], counts[by_row]
            at = np.searchsorted(rows, [pos for pos, _, _, block_ids in scheduled if block_ids]).tolist()
            plan.block_updates.extend((row, start, block_ids) for row, (_, _, start, block_ids)
                                      in zip(at, [u for u in scheduled if u[3]]))
        plan.running_seq_ids = batch.seq_id[order[rows]]
        plan.running_num_scheduled_tokens = counts
        return budget - num_plain - used

    def _schedule_each(self, plan: StepPlan, budget: int, order: np.ndarray) -> int:
        """``_schedule_running`` as a loop over the running sequences: for a few of them, cheaper
        than the array operations' fixed cost per step. Plain decodes and rollovers are done here
        (unless ``fast_decode`` is off), the rest in ``_schedule_one``."""
        batch, allocator, block_size = self.batch, self.allocator, self._block_size
        fast, caching = self.fast_decode, self._caching
        computed, pending, known, limits = batch.computed_view, batch.pending_view, batch.known_view, batch.limit_view
        slot_tokens, max_tokens, hashed = batch.slot_tokens_view, batch.max_tokens_view, batch.hashed_view
        seq_ids: list[int] = []
        counts: list[int] = []
        for slot in order.tolist():
            seq = batch.seqs[slot]
            if budget <= 0 or seq is None:
                break  # the budget is spent, or preemption took this sequence and the rest
            num_pending = pending[slot]
            num_tokens = known[slot] + num_pending
            num_computed = computed[slot]
            # nothing to compute, or a token still in flight already ends the sequence
            if num_tokens <= num_computed or (num_pending and num_tokens >= max_tokens[slot]):
                continue
            if fast and num_tokens - num_computed == 1:
                growth = None
                plain = num_computed < limits[slot]
                if plain:  # its slot exists or fits in its blocks
                    if num_computed >= slot_tokens[slot]:
                        slot_tokens[slot] = num_computed + 1
                        allocator.grow_in_place(seq.seq_id, num_computed + 1)
                    if caching and known[slot] // block_size > hashed[slot]:
                        self._offer_blocks(seq, known[slot])
                else:
                    growth = self._roll_over(seq, slot)
                if plain or growth is not None:
                    computed[slot] = num_computed + 1
                    pending[slot] = num_pending + 1  # the worker samples a token this step
                    if growth is not None:
                        plan.block_updates.append((len(seq_ids), *growth))
                    seq_ids.append(seq.seq_id)
                    counts.append(1)
                    budget -= 1
                    continue
            step = self._schedule_one(seq, budget)
            if seq.batch is None:
                break  # seq itself was preempted, and it was the newest: nothing after it
            if step is not None:
                num, growth = step
                if growth.block_ids:
                    plan.block_updates.append((len(seq_ids), growth.block_table_start, list(growth.block_ids)))
                    plan.block_copies.extend(growth.copies)
                seq_ids.append(seq.seq_id)
                counts.append(num)
                budget -= num
        plan.running_seq_ids = np.array(seq_ids, dtype=np.int64)
        plan.running_num_scheduled_tokens = np.array(counts, dtype=np.int64)
        return budget

    def _roll_over(self, seq: Sequence, slot: int) -> tuple[int, list[int]] | None:
        """A decode whose blocks are all full takes a fresh block for its next token (and offers
        the full ones to the prefix cache): ``(block_table_start, [block id])`` for the plan, or
        None when its blocks are not all full or none is free (``_schedule_one`` then decides)."""
        batch, block_size = self.batch, self._block_size
        limit = batch.limit_view[slot]
        if not (batch.computed_view[slot] == limit == batch.slot_tokens_view[slot] and limit % block_size == 0):
            return None
        block_id = self.allocator.append_block(seq.seq_id)
        if block_id is None:
            return None
        batch.limit_view[slot] = limit + block_size
        batch.slot_tokens_view[slot] = limit + 1
        self._offer_blocks(seq, batch.known_view[slot])
        return limit // block_size, [block_id]

    def _schedule_events(self, plan: StepPlan, budget: int, order: np.ndarray, events: np.ndarray,
                         is_decode: np.ndarray, num_plain_before: np.ndarray,
                         scheduled: list[tuple[int, int, int, list[int]]]) -> tuple[int, int, list[int]]:
        """The rows of ``_schedule_running`` taken one by one, in running order (``events``: their
        positions in ``order``): plain decodes that complete a block offer it to the prefix cache;
        decodes whose blocks are all full take a fresh block; the rest go through ``_schedule_one``.
        Appends what it schedules to ``scheduled``; returns the budget those rows took, how many
        rows of ``order`` are still running (preemption takes them off the end), and the rows of
        the rollovers (scheduled, and advanced by the caller with the plain decodes)."""
        batch, allocator = self.batch, self.allocator
        limits, computed = batch.limit_view, batch.computed_view
        used = 0
        end = len(order)
        rolled: list[int] = []
        for pos, slot, decode, num_before in zip(events.tolist(), order[events].tolist(), is_decode.tolist(),
                                                 num_plain_before.tolist()):
            if pos >= end or num_before >= budget - used:
                break  # preempted, or the budget ran out before this row
            seq = batch.seqs[slot]
            limit = limits[slot]
            if decode and computed[slot] < limit:  # a plain decode that completes a block: offer it now
                allocator.grow_in_place(seq.seq_id, computed[slot] + 1)
                self._offer_blocks(seq, batch.known_view[slot])
                continue
            if decode and (growth := self._roll_over(seq, slot)) is not None:
                scheduled.append((pos, 1, *growth))
                rolled.append(pos)
                used += 1
                continue
            step = self._schedule_one(seq, budget - num_before - used)
            end = len(self.running)
            if seq.batch is None:
                break  # seq itself was preempted, and it was the newest: nothing after it
            if step is not None:
                num, growth = step
                scheduled.append((pos, num, growth.block_table_start, list(growth.block_ids)))
                plan.block_copies.extend(growth.copies)
                used += num
        return used, end, rolled
