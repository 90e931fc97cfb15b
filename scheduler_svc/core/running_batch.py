"""The running sequences' hot state as flat arrays, one row (a *slot*) per sequence.

A steady decode moves every running sequence by one token per step. Kept on ``Sequence`` objects,
that is a Python loop over objects per token in the schedule, the update and the delivery; here it
is a few numpy operations per step over these arrays, and only the unusual sequences (a new block,
a prompt chunk, a stop, logprobs) take the per-sequence path.

Invariants:

- a sequence is in a slot exactly while it is in ``Scheduler.running``: ``seqs[slot] is seq`` and
  ``seq.slot == slot``; ``order()`` lists the slots in the order of ``Scheduler.running``;
- while a sequence is in a slot, its counters live here, not on the object (``Sequence``'s
  properties read and write them): ``computed`` (num_computed_tokens), ``pending``
  (num_pending_tokens), ``slot_tokens`` (num_slot_tokens), ``hashed`` (num_hashed_blocks);
- ``known[slot] == len(seqs[slot].token_ids)`` and ``token_lists[slot] is seqs[slot].token_ids``;
- ``limit[slot] == allocator.growth_limit(seq_id)``: a decode whose new token fits under it needs
  no block; the scheduler refreshes it after each ``append_slots`` of that sequence;
- ``max_tokens``, ``num_prompt`` and ``slow_update`` do not change while running;
- a slot freed by ``remove`` is reused only after the next ``order()``, so a slot never appears
  twice in one step's arrays.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from scheduler_svc.core.sequence import Sequence

_INT_FIELDS = ("seq_id", "computed", "pending", "known", "slot_tokens", "hashed", "limit", "max_tokens",
               "num_prompt")
# the counters a Sequence keeps in its slot while it runs: its own attribute -> the array here
COUNTERS = {"_num_computed_tokens": "computed", "_num_pending_tokens": "pending",
            "_num_slot_tokens": "slot_tokens", "_num_hashed_blocks": "hashed"}


class RunningBatch:
    """The slots of the running sequences (the module docstring states the invariants). Grows by
    doubling; ``Scheduler`` adds a sequence when it starts running and removes it when it stops."""

    def __init__(self, capacity: int = 64):
        self.capacity = 0
        self._grow(capacity)
        self.reset()

    def reset(self) -> None:
        """Detach every sequence (their counters go back to the objects) and free every slot."""
        for seq in getattr(self, "seqs", ()):
            if seq is not None:
                self._detach(seq)
        self.seqs: list[Sequence | None] = [None] * self.capacity
        self.token_lists: list[list[int] | None] = [None] * self.capacity
        self.alive[:] = False
        self._free = list(range(self.capacity - 1, -1, -1))  # popped from the end: lowest first
        self._released: list[int] = []  # freed this step: reusable after the next order()
        self._order = np.zeros(0, dtype=np.int64)
        self._appended: list[int] = []
        self._order_dirty = False
        self._lookup: tuple[np.ndarray, np.ndarray] | None = None

    def _grow(self, capacity: int) -> None:
        old = self.capacity
        for name in _INT_FIELDS:
            array = np.zeros(capacity, dtype=np.int64)
            if old:
                array[:old] = getattr(self, name)
            setattr(self, name, array)
        for name in ("alive", "slow_update"):
            array = np.zeros(capacity, dtype=bool)
            if old:
                array[:old] = getattr(self, name)
            setattr(self, name, array)
        # Python-int views (``<name>_view``) for the per-sequence path, Sequence's properties among
        # them: indexing a numpy array gives numpy ints, and costs three times as much
        for name in _INT_FIELDS:
            setattr(self, f"{name}_view", memoryview(getattr(self, name)))
        if old:
            self.seqs.extend([None] * (capacity - old))
            self.token_lists.extend([None] * (capacity - old))
            self._free[:0] = range(capacity - 1, old - 1, -1)
        self.capacity = capacity

    # ---- membership ---------------------------------------------------------------------

    def add(self, seq: Sequence, growth_limit: int) -> None:
        """Give a sequence that starts running a slot (at the end of the running order); its
        counters move here."""
        if not self._free:
            self._grow(2 * self.capacity)
        slot = self._free.pop()
        for attr, name in COUNTERS.items():
            getattr(self, f"{name}_view")[slot] = getattr(seq, attr)
        self.seq_id_view[slot] = seq.seq_id
        self.known_view[slot] = len(seq.token_ids)
        self.limit_view[slot] = growth_limit
        self.max_tokens_view[slot] = seq.max_num_tokens
        self.num_prompt_view[slot] = seq.num_prompt_tokens
        self.slow_update[slot] = bool(seq.sampling.logprobs or seq.sampling.top_logprobs)
        self.alive[slot] = True
        self.seqs[slot] = seq
        self.token_lists[slot] = seq.token_ids
        seq.slot = slot
        seq.batch = self
        self._appended.append(slot)
        self._lookup = None

    def remove(self, seq: Sequence) -> None:
        """The sequence stops running: its counters go back to the object, its slot is freed."""
        slot = seq.slot
        self._detach(seq)
        self.alive[slot] = False
        self.seqs[slot] = None
        self.token_lists[slot] = None
        self._released.append(slot)
        self._order_dirty = True
        self._lookup = None

    def _detach(self, seq: Sequence) -> None:
        slot = seq.slot
        seq.slot = -1
        seq.batch = None
        for attr, name in COUNTERS.items():
            setattr(seq, attr, getattr(self, f"{name}_view")[slot])

    def order(self) -> np.ndarray:
        """The slots in running order (int64). Call once per step, before reading rows."""
        if self._appended:
            self._order = np.concatenate((self._order, np.asarray(self._appended, dtype=np.int64)))
            self._appended = []
        if self._order_dirty:
            self._order = self._order[self.alive[self._order]]
            self._order_dirty = False
            self._free.extend(self._released)
            self._released = []
        return self._order

    def slots_of(self, seq_ids: np.ndarray) -> np.ndarray:
        """The slot of each sequence id, -1 for ids not running."""
        if self._lookup is None:
            live = self.alive.nonzero()[0]
            ids = self.seq_id[live]
            by_id = np.argsort(ids)
            self._lookup = (ids[by_id], live[by_id])
        ids, slots = self._lookup
        if not len(ids):
            return np.full(len(seq_ids), -1, dtype=np.int64)
        at = np.minimum(np.searchsorted(ids, seq_ids), len(ids) - 1)
        return np.where(ids[at] == seq_ids, slots[at], -1)

    def check(self, running: list[Sequence]) -> None:
        """Assert the invariants that tie the arrays to ``running`` (tests call this)."""
        order = self.order().tolist()
        assert [self.seqs[slot] for slot in order] == running, "slot order differs from the running list"
        assert int(self.alive.sum()) == len(running), "a slot is alive with no running sequence"
        for slot in order:
            seq = self.seqs[slot]
            assert seq.slot == slot and seq.batch is self
            assert self.known[slot] == len(seq.token_ids) and self.token_lists[slot] is seq.token_ids
            assert self.seq_id[slot] == seq.seq_id


@dataclass(slots=True)
class StepTokens:
    """The sequences that received a token in one step (one each): the plain decodes as arrays
    (``seq_ids`` and ``token_ids``; ``rows``: their rows in the step's result; ``slots`` in
    ``batch``), which did not finish, asked for no logprobs and got a token that is not their
    first, and the others as objects with their result rows (finished ones included, with
    ``finish_reason`` set). The slots are valid until the batch changes (the next ``finish`` or
    ``schedule``)."""

    batch: RunningBatch
    rows: np.ndarray
    slots: np.ndarray
    seq_ids: np.ndarray
    token_ids: np.ndarray
    other_rows: list[int]
    others: list[Sequence]

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
