"""What a worker holds per sequence between steps, and the one place a step plan is applied to it
and checked against it.

Both runners (``ModelRunner`` and ``NullRunner``) keep their sequences in a ``SequenceStates``, so
a plan that contradicts the worker's state is rejected by the same code, with the same exception
and message, whether or not a model runs: ``KeyError`` for a sequence the worker does not hold,
``ValueError`` for anything else (the worker server maps both to INVALID_ARGUMENT).

A step goes through two calls:

- ``apply(plan)`` drops the finished sequences, adds the new ones, applies the block-table edits
  (each sequence's table is one row of a ``BlockTables``), checks every block id lies inside the
  cache, and returns the block copies for the runner to perform;
- ``scheduled(plan)`` gathers the sequences the step computes, in batch order (new sequences, then
  running ones), and checks that none is scheduled past its known tokens or past its blocks before
  anything is changed. ``ScheduledSeqs.advance()`` then marks the scheduled tokens computed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pagewire_common.plan import StepPlan
from pagewire_common.sampling import SamplingParams
from worker_svc.block_table import BlockTables


@dataclass(slots=True)
class SeqState:
    """What the worker keeps per sequence between steps; its block table is row ``row`` of
    ``SequenceStates.tables``."""

    token_ids: list[int]
    row: int
    num_computed_tokens: int
    sampling: SamplingParams
    num_prompt_tokens: int = 0
    # the ids masked until sampling.min_tokens are generated (sent only when min_tokens is set)
    stop_token_ids: tuple[int, ...] = ()
    # logits adjustment state (worker_svc.logits_adjust): whether any applies, the slot of the
    # sequence's token counts (penalties), its grammar matcher (structured output)
    is_adjusted: bool = False
    penalty_slot: int | None = None
    matcher: object | None = None


@dataclass(slots=True)
class ScheduledSeqs:
    """The sequences one step computes, in batch order, already checked against their state.

    Iterating yields ``(seq_id, state, num_tokens)`` rows. The int64 arrays (one entry per
    sequence) are what the model runner builds its inputs from without per-token Python loops.
    """

    seq_ids: list[int]
    states: list[SeqState]
    num_tokens: list[int]  # tokens this step computes per sequence
    ends: list[int]  # computed tokens after this step
    sampled: list[int]  # indices of the sequences that reach the end of their known tokens
    rows: np.ndarray  # [S] block-table rows
    seq_lens: np.ndarray  # [S] == ends
    num_blocks: np.ndarray  # [S] blocks in each sequence's table

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self):
        return zip(self.seq_ids, self.states, self.num_tokens)

    @property
    def query_lens(self) -> np.ndarray:
        return np.asarray(self.num_tokens, dtype=np.int64)

    @property
    def starts(self) -> np.ndarray:
        """[S] tokens computed before this step (as long as ``advance`` has not run)."""
        return self.seq_lens - self.query_lens

    def advance(self) -> None:
        """Mark this step's tokens computed (after the step's inputs are built)."""
        for state, end in zip(self.states, self.ends):
            state.num_computed_tokens = end


class SequenceStates:
    """The sequences a worker holds, keyed by seq_id, with their block tables in ``tables``."""

    def __init__(self, tables: BlockTables, block_size: int, num_kv_blocks: int):
        self.tables = tables
        self.block_size = block_size
        self.num_kv_blocks = num_kv_blocks
        self._seqs: dict[int, SeqState] = {}

    def __len__(self) -> int:
        return len(self._seqs)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def get(self, seq_id: int) -> SeqState | None:
        return self._seqs.get(seq_id)

    def reset(self) -> None:
        """Drop every sequence (the scheduler reconnected and starts from scratch)."""
        tables = self.tables
        for state in self._seqs.values():
            tables.release(state.row)
        self._seqs.clear()

    def apply(self, plan: StepPlan) -> list[tuple[int, int]]:
        """Apply ``plan``'s drops, new sequences and block-table edits; return its block copies
        (``(src, dst)`` pairs, checked) for the runner to perform before computing."""
        step_id = plan.step_id
        seqs = self._seqs
        tables = self.tables
        num_kv_blocks = self.num_kv_blocks
        for seq_id in plan.finished_seq_ids:
            state = seqs.pop(seq_id, None)
            if state is not None:
                tables.release(state.row)
        for new in plan.new_seqs:
            if new.seq_id in seqs:
                raise ValueError(f"step {step_id}: sequence {new.seq_id} is already known to this worker")
            tables.check_edit(0, 0, len(new.block_ids))
            _check_block_ids(new.block_ids, num_kv_blocks, step_id)
            if not 0 <= new.num_computed_tokens <= len(new.token_ids):
                raise ValueError(
                    f"step {step_id}: sequence {new.seq_id} has {new.num_computed_tokens} computed tokens "
                    f"out of {len(new.token_ids)}"
                )
            seqs[new.seq_id] = SeqState(
                token_ids=list(new.token_ids),
                row=tables.add(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                sampling=new.sampling,
                num_prompt_tokens=new.num_prompt_tokens or len(new.token_ids),
                stop_token_ids=tuple(new.stop_token_ids),
            )
        for diff in plan.running_seqs:
            state = seqs.get(diff.seq_id)
            if state is None:
                raise KeyError(f"step {step_id}: sequence {diff.seq_id} is not known to this worker")
            if diff.block_ids:
                row = state.row
                tables.check_edit(int(tables.num_blocks[row]), diff.block_table_start, len(diff.block_ids))
                _check_block_ids(diff.block_ids, num_kv_blocks, step_id)
                tables.set(row, diff.block_table_start, diff.block_ids)
        tables.sync()
        copies = plan.block_copies
        for pair in copies:
            _check_block_ids(pair, num_kv_blocks, step_id)
        return copies

    def scheduled(self, plan: StepPlan) -> ScheduledSeqs:
        """The sequences ``plan`` computes (after ``apply(plan)``), every one checked before any
        is changed: none may be scheduled past its known tokens or past its blocks."""
        seqs = self._seqs
        seq_ids: list[int] = []
        states: list[SeqState] = []
        num_tokens: list[int] = []
        ends: list[int] = []
        rows: list[int] = []
        sampled: list[int] = []
        for group in (plan.new_seqs, plan.running_seqs):
            for s in group:
                state = seqs[s.seq_id]
                n = s.num_scheduled_tokens
                end = state.num_computed_tokens + n
                known = len(state.token_ids)
                if end >= known:
                    if end > known:
                        raise ValueError(f"step {plan.step_id}: scheduled past the known tokens of a sequence")
                    sampled.append(len(states))
                seq_ids.append(s.seq_id)
                states.append(state)
                num_tokens.append(n)
                ends.append(end)
                rows.append(state.row)
        row_array = np.array(rows, dtype=np.int64)
        seq_lens = np.array(ends, dtype=np.int64)
        num_blocks = self.tables.num_blocks[row_array]
        if (seq_lens > num_blocks * self.block_size).any():
            raise ValueError(f"step {plan.step_id}: a sequence has too few blocks for its tokens")
        return ScheduledSeqs(seq_ids, states, num_tokens, ends, sampled, row_array, seq_lens, num_blocks)


def _check_block_ids(block_ids, num_kv_blocks: int, step_id: int) -> None:
    # an id outside the cache would index out of the cache tensors (or silently alias a block)
    if block_ids and (min(block_ids) < 0 or max(block_ids) >= num_kv_blocks):
        bad = next(b for b in block_ids if not 0 <= b < num_kv_blocks)
        raise ValueError(f"step {step_id}: block id {bad} is outside the cache [0, {num_kv_blocks})")
