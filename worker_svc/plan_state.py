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

The running rows are read from the plan's arrays (``running_seq_ids``), never as per-row objects.
Their states and block-table rows are looked up once and kept (a ``_RunningGroup``) for as long as
the plan's running ids stay the same and no sequence is dropped, which in a run of decode steps is
every step; ``version`` changes whenever the group, or the set of sequences, changes.
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
    query_lens: np.ndarray  # [S] tokens this step computes per sequence
    seq_lens: np.ndarray  # [S] computed tokens after this step
    sampled: list[int]  # indices of the sequences that reach the end of their known tokens
    rows: np.ndarray  # [S] block-table rows
    num_blocks: np.ndarray  # [S] blocks in each sequence's table
    # SequenceStates.version when built: equal versions hold the same states in the same order
    version: int = 0

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self):
        return zip(self.seq_ids, self.states, self.query_lens.tolist())

    @property
    def starts(self) -> np.ndarray:
        """[S] tokens computed before this step (as long as ``advance`` has not run)."""
        return self.seq_lens - self.query_lens

    def advance(self) -> None:
        """Mark this step's tokens computed (after the step's inputs are built)."""
        for state, end in zip(self.states, self.seq_lens.tolist()):
            state.num_computed_tokens = end


@dataclass(slots=True)
class _RunningGroup:
    """The states of a plan's running rows, looked up once and kept while they stay the same."""

    seq_ids: np.ndarray  # [R] the plan's running_seq_ids
    seq_id_list: list[int]
    states: list[SeqState]
    rows: np.ndarray  # [R] their block-table rows


class SequenceStates:
    """The sequences a worker holds, keyed by seq_id, with their block tables in ``tables``."""

    def __init__(self, tables: BlockTables, block_size: int, num_kv_blocks: int):
        self.tables = tables
        self.block_size = block_size
        self.num_kv_blocks = num_kv_blocks
        self._seqs: dict[int, SeqState] = {}
        # the last plan's running rows: valid until a sequence is dropped (its id may come back
        # as a new state) or the running ids change
        self._running: _RunningGroup | None = None
        self.version = 0  # changes whenever the set of sequences or the running group changes

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
        self._running = None
        self.version += 1

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
                self._running = None
        if plan.new_seqs:
            self.version += 1
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
        running = self._running_group(plan)
        for i, start, block_ids in plan.block_updates:
            if block_ids:
                row = running.states[i].row
                tables.check_edit(int(tables.num_blocks[row]), start, len(block_ids))
                _check_block_ids(block_ids, num_kv_blocks, step_id)
                tables.set(row, start, block_ids)
        tables.sync()
        copies = plan.block_copies
        for pair in copies:
            _check_block_ids(pair, num_kv_blocks, step_id)
        return copies

    def _running_group(self, plan: StepPlan) -> _RunningGroup:
        """The states of ``plan``'s running rows: the kept group when the ids are the same, else
        looked up (``KeyError`` naming the first id this worker does not hold)."""
        ids = plan.running_seq_ids
        group = self._running
        if group is not None and np.array_equal(group.seq_ids, ids):
            return group
        seqs = self._seqs
        id_list = ids.tolist()
        try:
            states = [seqs[seq_id] for seq_id in id_list]
        except KeyError:
            missing = next(seq_id for seq_id in id_list if seq_id not in seqs)
            raise KeyError(f"step {plan.step_id}: sequence {missing} is not known to this worker") from None
        rows = np.fromiter((s.row for s in states), dtype=np.int64, count=len(states))
        self._running = group = _RunningGroup(ids.copy(), id_list, states, rows)
        self.version += 1
        return group

    def scheduled(self, plan: StepPlan) -> ScheduledSeqs:
        """The sequences ``plan`` computes (after ``apply(plan)``), every one checked before any
        is changed: none may be scheduled past its known tokens or past its blocks."""
        seqs = self._seqs
        running = self._running_group(plan)
        new_states = [seqs[s.seq_id] for s in plan.new_seqs]
        if new_states:
            seq_ids = [s.seq_id for s in plan.new_seqs] + running.seq_id_list
            states = new_states + running.states
            query_lens = np.concatenate((
                np.array([s.num_scheduled_tokens for s in plan.new_seqs], dtype=np.int64),
                plan.running_num_scheduled_tokens))
            rows = np.concatenate((np.array([s.row for s in new_states], dtype=np.int64), running.rows))
        else:
            seq_ids, states = running.seq_id_list, running.states
            query_lens, rows = plan.running_num_scheduled_tokens, running.rows
        num_seqs = len(states)
        # the counters live in the states; one pass reads them, the checks are over arrays
        computed = np.fromiter((s.num_computed_tokens for s in states), dtype=np.int64, count=num_seqs)
        known = np.fromiter((len(s.token_ids) for s in states), dtype=np.int64, count=num_seqs)
        seq_lens = computed + query_lens
        if (seq_lens > known).any():
            raise ValueError(f"step {plan.step_id}: scheduled past the known tokens of a sequence")
        num_blocks = self.tables.num_blocks[rows]
        if (seq_lens > num_blocks * self.block_size).any():
            raise ValueError(f"step {plan.step_id}: a sequence has too few blocks for its tokens")
        sampled = np.flatnonzero(seq_lens == known).tolist()
        version = self.version
        if new_states:
            # the next step's rows are the running group alone, without these first: another list
            # of states under the same running group, so it must not share this step's version
            self.version += 1
        return ScheduledSeqs(list(seq_ids), states, query_lens, seq_lens, sampled, rows, num_blocks, version)


def _check_block_ids(block_ids, num_kv_blocks: int, step_id: int) -> None:
    # an id outside the cache would index out of the cache tensors (or silently alias a block)
    if block_ids and (min(block_ids) < 0 or max(block_ids) >= num_kv_blocks):
        bad = next(b for b in block_ids if not 0 <= b < num_kv_blocks)
        raise ValueError(f"step {step_id}: block id {bad} is outside the cache [0, {num_kv_blocks})")
