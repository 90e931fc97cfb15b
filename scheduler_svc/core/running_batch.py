"""The scheduler's per-sequence counters, one row (a *slot*) per sequence it holds, as columns of
flat arrays; and the vectorised decode path over them.

These arrays are the only home of a sequence's progress: ``Scheduler`` reads and writes a row as
``batch.computed[seq.slot]`` (memoryviews of the arrays, which give Python ints), and the
vectorised path below reads and writes many rows at once. A steady decode moves every running
sequence by one token per step; with many of them, a loop over rows per step in the schedule and
again in the result costs more than a few numpy operations, so rows that do the common thing (a
*plain decode*, a *plain token*) are taken over the arrays and only the others one by one. Both
give the same plans, tokens and allocator state (tests/test_running_batch.py drives random
workloads both ways and compares every step).

Columns, per slot:

- ``computed``: tokens whose K/V the worker has written, or will have written once the plans
  already sent run: it advances when a step is *scheduled*, not when its result arrives, so the
  next plan can be built before the previous result is back;
- ``pending``: tokens sampled by steps whose results have not arrived yet (the worker knows them,
  the scheduler does not yet);
- ``known``: tokens received, ``len(seq.token_ids)`` (whoever appends a token counts it here);
- ``slot_tokens``: how many tokens the allocator holds slots for (its length of the sequence);
- ``hashed``: full blocks already offered to the prefix cache;
- ``limit``: while running, ``allocator.growth_limit(seq_id)``: a token below it needs no block
  (the scheduler sets it when the sequence starts running and after each ``append_slots``);
- copies of what does not change while the sequence is held, for the array path: ``seq_id``,
  ``max_tokens`` (``seq.max_num_tokens``), ``num_prompt`` and ``slow_apply`` (it asked for
  logprobs, which only the per-sequence path records).

A sequence holds its slot from ``Scheduler.add`` (or its fork) until it finishes, waiting or
running. A slot freed by ``remove`` is reused only from the next ``recycle`` (each schedule), so
a ``StepTokens`` stays valid until then.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from operator import attrgetter

import numpy as np

from kvcache.allocator import BlockAllocator
from pagewire_common.plan import StepResult
from scheduler_svc.core.sequence import Sequence

# from this many running sequences (or results) on, a step takes its plain decodes (and plain
# tokens) over the arrays: below it, the array operations' fixed cost is more than they save
FAST_DECODE_MIN_ROWS = 64

_COLUMNS = ("seq_id", "computed", "pending", "known", "slot_tokens", "hashed", "limit", "max_tokens", "num_prompt",
            "slow_apply")
_slot_of = attrgetter("slot")
_NO_ROWS = np.zeros(0, dtype=np.int64)


def _no_rows() -> np.ndarray:
    return _NO_ROWS


class _Arrays:
    """The columns as numpy arrays, for the array path."""

    __slots__ = _COLUMNS


class RunningBatch:
    """The rows of the sequences the scheduler holds (the module docstring lists the columns).
    ``computed``, ``pending``, ... are memoryviews, indexed by slot; ``seqs[slot]`` is the sequence
    in a slot and ``token_lists[slot]`` its ``token_ids``. Grows by doubling."""

    def __init__(self, capacity: int = 64):
        self.capacity = 0
        self.seqs: list[Sequence | None] = []
        self.token_lists: list[list[int] | None] = []
        self._arrays = _Arrays()
        self._alive = np.zeros(0, dtype=bool)
        self._free: list[int] = []  # popped from the end: lowest slot first
        self._grow(capacity)
        # every token id that ends some sequence held so far (sorted): a plain token is outside it
        # (it only grows: a stale id sends a few tokens down the per-sequence path)
        self._stop_ids: set[int] = set()
        self._stop_id_array = np.zeros(0, dtype=np.int64)
        self.reset()

    def reset(self) -> None:
        """Forget every sequence and free every slot."""
        for seq in self.seqs:
            if seq is not None:
                seq.slot = -1
        self.seqs[:] = [None] * self.capacity
        self.token_lists[:] = [None] * self.capacity
        self._alive[:] = False
        self._free = list(range(self.capacity - 1, -1, -1))
        self._released: list[int] = []  # freed since the last recycle()
        self._lookup: tuple[np.ndarray, np.ndarray] | None = None

    def _grow(self, capacity: int) -> None:
        old = self.capacity
        for name in _COLUMNS:
            array = np.zeros(capacity, dtype=np.int64)
            if old:
                array[:old] = getattr(self._arrays, name)
            setattr(self._arrays, name, array)
            setattr(self, name, memoryview(array))
        alive = np.zeros(capacity, dtype=bool)
        alive[:old] = self._alive
        self._alive = alive
        self.seqs.extend([None] * (capacity - old))
        self.token_lists.extend([None] * (capacity - old))
        self._free[:0] = range(capacity - 1, old - 1, -1)
        self.capacity = capacity

    # ---- membership ---------------------------------------------------------------------

    def add(self, seq: Sequence) -> int:
        """Give a sequence the scheduler takes on a row, its counters at 0; returns its slot."""
        if not self._free:
            self._grow(2 * self.capacity)
        slot = self._free.pop()
        self.seq_id[slot] = seq.seq_id
        self.known[slot] = len(seq.token_ids)
        self.max_tokens[slot] = seq.max_num_tokens
        self.num_prompt[slot] = seq.num_prompt_tokens
        self.slow_apply[slot] = 1 if seq.sampling.logprobs or seq.sampling.top_logprobs else 0
        self.computed[slot] = self.pending[slot] = self.slot_tokens[slot] = self.hashed[slot] = self.limit[slot] = 0
        self._alive[slot] = True
        self.seqs[slot] = seq
        self.token_lists[slot] = seq.token_ids
        seq.slot = slot
        self._lookup = None
        if not seq.stop_token_set <= self._stop_ids:
            self._stop_ids |= seq.stop_token_set
            self._stop_id_array = np.array(sorted(self._stop_ids), dtype=np.int64)
        return slot

    def remove(self, seq: Sequence) -> None:
        """The scheduler lets go of the sequence: its slot is free from the next ``recycle``."""
        slot = seq.slot
        seq.slot = -1
        self._alive[slot] = False
        self.seqs[slot] = None
        self.token_lists[slot] = None
        self._released.append(slot)
        self._lookup = None

    def recycle(self) -> None:
        """Make the slots freed since the last call available again (once per step)."""
        if self._released:
            self._free.extend(self._released)
            self._released = []

    def slots_of(self, seq_ids: np.ndarray) -> np.ndarray:
        """The slot of each sequence id, -1 for ids not held."""
        if self._lookup is None:
            live = self._alive.nonzero()[0]
            ids = self._arrays.seq_id[live]
            by_id = np.argsort(ids)
            self._lookup = (ids[by_id], live[by_id])
        ids, slots = self._lookup
        if not len(ids):
            return np.full(len(seq_ids), -1, dtype=np.int64)
        at = np.minimum(np.searchsorted(ids, seq_ids), len(ids) - 1)
        return np.where(ids[at] == seq_ids, slots[at], -1)

    def check(self, held: list[Sequence]) -> None:
        """Assert that the rows are those of ``held`` (every sequence the scheduler holds) and
        agree with them (tests call this)."""
        assert int(self._alive.sum()) == len(held), "a slot is alive for no sequence the scheduler holds"
        for seq in held:
            slot = seq.slot
            assert slot >= 0 and self.seqs[slot] is seq and self._alive[slot]
            assert self.seq_id[slot] == seq.seq_id and self.known[slot] == len(seq.token_ids)
            assert self.token_lists[slot] is seq.token_ids

    # ---- the array path -----------------------------------------------------------------

    def plain_decodes(self, running: list[Sequence], offer_block_size: int) -> PlainDecodes:
        """Sort this step's running rows (``running``, in running order) out over the arrays, as
        ``Scheduler._schedule_row`` would decide them: rows that get nothing; *plain decodes*,
        whose next token fits under their growth limit and (``offer_block_size``: the block size
        when prefix caching is on, else 0) completes no block, so that the row asks nothing of
        the allocator but a new length; and the others, which ``Scheduler`` takes one by one."""
        arrays = self._arrays
        order = np.fromiter(map(_slot_of, running), dtype=np.int64, count=len(running))
        computed, pending, known = arrays.computed[order], arrays.pending[order], arrays.known[order]
        num_tokens = known + pending
        num_new = num_tokens - computed
        # nothing to compute, or a token still in flight already ends the sequence (another one
        # would only be thrown away)
        idle = (num_new <= 0) | ((pending > 0) & (num_tokens >= arrays.max_tokens[order]))
        plain = ~idle & (num_new == 1) & (computed < arrays.limit[order])
        if offer_block_size:
            plain &= known // offer_block_size <= arrays.hashed[order]
        others = (~idle & ~plain).nonzero()[0]
        num_plain_before = np.cumsum(plain, dtype=np.int64) - plain
        return PlainDecodes(arrays, order, computed, pending, plain, num_plain_before, others.tolist(),
                            num_plain_before[others].tolist())

    def take_plain_tokens(self, result: StepResult) -> tuple[StepTokens, list[int]]:
        """Append the *plain tokens* of a step's result over the arrays: tokens for held sequences
        that wait for one, that are not their first output token, do not end them (no stop token,
        not their last) and come without logprobs, as ``Scheduler._apply_token`` would. Returns
        them as arrays, and the rows of the result left to take one by one."""
        arrays = self._arrays
        seq_ids = np.asarray(result.seq_ids, dtype=np.int64)
        token_ids = np.asarray(result.token_ids, dtype=np.int64)
        slots = self.slots_of(seq_ids)
        at = np.maximum(slots, 0)
        known = arrays.known[at]
        plain = (slots >= 0) & (arrays.pending[at] > 0) & (known + 1 < arrays.max_tokens[at])
        # a first output token goes one by one: its delivery says how much of the prompt was cached
        plain &= (known > arrays.num_prompt[at]) & (arrays.slow_apply[at] == 0)
        stop_ids = self._stop_id_array  # sorted; searchsorted is cheaper than np.isin
        if len(stop_ids):
            plain &= stop_ids[np.minimum(np.searchsorted(stop_ids, token_ids), len(stop_ids) - 1)] != token_ids
        rows = plain.nonzero()[0]
        slots = slots[rows]
        tokens = token_ids[rows]
        arrays.pending[slots] -= 1
        arrays.known[slots] += 1
        # each token onto its sequence's list, with no Python loop body (deque consumes the map)
        deque(map(list.append, map(self.token_lists.__getitem__, slots.tolist()), tokens.tolist()), maxlen=0)
        other_rows = [] if len(rows) == len(seq_ids) else (~plain).nonzero()[0].tolist()
        return StepTokens(self, rows, slots, seq_ids[rows], tokens), other_rows


@dataclass(slots=True)
class PlainDecodes:
    """One step's running rows as ``RunningBatch.plain_decodes`` sorted them out. The step's budget
    goes to the rows in running order: ``others`` are the positions of the rows to take one by
    one, each after the plain decodes before it (``others_num_plain_before``); ``commit`` then
    advances the plain decodes that the rest of the budget reaches."""

    arrays: _Arrays
    order: np.ndarray  # the running rows' slots, in running order
    computed: np.ndarray  # their counters when sorted out (a plain decode's stay so until commit)
    pending: np.ndarray
    plain: np.ndarray  # which are plain decodes
    num_plain_before: np.ndarray  # how many plain decodes come before each
    others: list[int]
    others_num_plain_before: list[int]

    def commit(self, end: int, num_tokens: int, allocator: BlockAllocator, positions: list[int],
               counts: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """Advance the plain decodes that run, one token each: those before position ``end`` (the
        rows from there on were preempted) that ``num_tokens`` (what the other rows left of the
        budget) reaches in running order. ``positions`` and ``counts``: the other rows scheduled
        and their tokens. Returns every row scheduled, in running order, as the plan holds them:
        sequence ids and tokens."""
        arrays = self.arrays
        rows = (self.plain[:end] & (self.num_plain_before[:end] < num_tokens)).nonzero()[0]
        slots = self.order[rows]
        computed = self.computed[rows] + 1
        arrays.computed[slots] = computed
        arrays.pending[slots] = self.pending[rows] + 1  # the worker samples a token this step
        slot_tokens = np.maximum(arrays.slot_tokens[slots], computed)
        arrays.slot_tokens[slots] = slot_tokens
        allocator.grow_in_place_many(arrays.seq_id[slots].tolist(), slot_tokens.tolist())
        if not positions:
            return arrays.seq_id[slots], np.ones(len(rows), dtype=np.int64)
        rows = np.concatenate((rows, positions))
        by_position = np.argsort(rows, kind="stable")
        counts = np.concatenate((np.ones(len(slots), dtype=np.int64), counts))[by_position]
        return arrays.seq_id[self.order[rows[by_position]]], counts


@dataclass(slots=True)
class StepTokens:
    """The sequences that received a token in one step (one each): the plain tokens as arrays
    (``seq_ids`` and ``token_ids``; ``rows``: their rows in the step's result; ``slots`` in
    ``batch``), which did not finish, asked for no logprobs and are not a first output token, and
    the others as objects with their result rows (finished ones included, with ``finish_reason``
    set). The slots are valid until the next schedule."""

    batch: RunningBatch
    rows: np.ndarray = field(default_factory=_no_rows)
    slots: np.ndarray = field(default_factory=_no_rows)
    seq_ids: np.ndarray = field(default_factory=_no_rows)
    token_ids: np.ndarray = field(default_factory=_no_rows)
    other_rows: list[int] = field(default_factory=list)
    others: list[Sequence] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.rows) + len(self.others)

    def sequences(self) -> list[Sequence]:
        """Every sequence that received a token, in the result's order."""
        seqs = self.batch.seqs
        if not self.others:
            return [seqs[slot] for slot in self.slots.tolist()]
        by_row = dict(zip(self.rows.tolist(), (seqs[slot] for slot in self.slots.tolist())))
        by_row.update(zip(self.other_rows, self.others))
        return [by_row[row] for row in sorted(by_row)]
