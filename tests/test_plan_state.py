"""SequenceStates: the one implementation of applying and checking a step plan that both runners
(ModelRunner, NullRunner) use."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagewire_common.plan import NewSequence, RunningSequence, StepPlan
from pagewire_common.sampling import SamplingParams
from worker_svc.block_table import BlockTables
from worker_svc.plan_state import SequenceStates

BLOCK_SIZE = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


def states(num_kv_blocks: int = 16, max_blocks_per_seq: int = 4) -> SequenceStates:
    return SequenceStates(BlockTables(max_blocks_per_seq, torch.device("cpu"), initial_rows=2), BLOCK_SIZE,
                          num_kv_blocks)


def new_seq(seq_id, token_ids, block_ids, num_scheduled, num_computed=0) -> NewSequence:
    return NewSequence(seq_id, list(token_ids), list(block_ids), num_computed, num_scheduled, GREEDY)


def test_apply_then_scheduled_in_batch_order():
    s = states()
    plan = StepPlan(1, new_seqs=[new_seq(1, [5, 6, 7, 8, 9], [0, 1], 4), new_seq(2, [1, 2], [2], 2)],
                    block_copies=[(0, 3)])
    assert s.apply(plan) == [(0, 3)]
    assert len(s) == 2 and 1 in s and s.get(1).sampling is GREEDY
    batch = s.scheduled(plan)
    assert [(seq_id, n) for seq_id, _state, n in batch] == [(1, 4), (2, 2)]
    assert batch.starts.tolist() == [0, 0] and batch.seq_lens.tolist() == [4, 2]
    assert batch.num_blocks.tolist() == [2, 1] and batch.sampled == [1]
    assert s.tables.gather(batch.rows, 2).tolist() == [[0, 1], [2, 0]]
    batch.advance()
    assert (s.get(1).num_computed_tokens, s.get(2).num_computed_tokens) == (4, 2)
    # the rest of seq 1's prompt after a rollover; seq 2 finishes and gives its row back
    plan = StepPlan(2, running_seqs=[RunningSequence(1, 1, block_table_start=2, block_ids=[4])],
                    finished_seq_ids=[2])
    assert s.apply(plan) == []
    assert len(s) == 1 and len(s.tables._free_rows) == 1
    batch = s.scheduled(plan)
    assert batch.seq_ids == [1] and batch.num_blocks.tolist() == [3] and batch.sampled == [0]
    s.reset()
    assert len(s) == 0 and len(s.tables._free_rows) == 2


def test_scheduled_checks_every_sequence_before_changing_any():
    s = states()
    s.apply(StepPlan(1, new_seqs=[new_seq(1, [5, 6], [0], 2)]))
    s.scheduled(StepPlan(1, new_seqs=[new_seq(1, [5, 6], [0], 2)])).advance()
    plan = StepPlan(2, new_seqs=[new_seq(2, [1, 2, 3], [1], 3)], running_seqs=[RunningSequence(1, 1)])
    s.apply(plan)
    with pytest.raises(ValueError, match="step 2: scheduled past the known tokens"):
        s.scheduled(plan)  # seq 1 has no sampled token yet
    assert (s.get(1).num_computed_tokens, s.get(2).num_computed_tokens) == (2, 0)


def test_a_bad_block_id_is_named_and_the_sequence_not_added():
    s = states(num_kv_blocks=8, max_blocks_per_seq=8)
    with pytest.raises(ValueError, match=r"step 3: block id 9 is outside the cache \[0, 8\)"):
        s.apply(StepPlan(3, new_seqs=[new_seq(1, [5], [0, 9, -1], 1)]))
    assert 1 not in s and len(s.tables._free_rows) == 2
    with pytest.raises(KeyError, match="step 4: sequence 7 is not known"):
        s.apply(StepPlan(4, running_seqs=[RunningSequence(7, 1)]))
    assert isinstance(s.scheduled(StepPlan(5)).seq_lens, np.ndarray)


def test_a_step_after_new_sequences_has_a_version_of_its_own():
    """New sequences come first in their step's rows; the next step, with the same running ids and
    none new, has other rows under the same running group, so the runner's caches keyed by the
    version (the sampled rows' parameters) must not take it for the same list."""
    s = states(num_kv_blocks=16, max_blocks_per_seq=4)
    s.apply(first := StepPlan(1, new_seqs=[new_seq(1, [5, 6], [0], 1), new_seq(2, [7, 8], [1], 1)]))
    s.scheduled(first).advance()
    plan = StepPlan(2, new_seqs=[new_seq(3, [9, 9, 9], [2], 2)], running_seqs=[RunningSequence(1, 1), RunningSequence(2, 1)])
    s.apply(plan)
    with_new = s.scheduled(plan)
    assert [st for st in with_new.states] == [s.get(3), s.get(1), s.get(2)]
    for st in with_new.states:
        st.token_ids.append(0)
    with_new.advance()
    plan = StepPlan(3, running_seqs=[RunningSequence(1, 1), RunningSequence(2, 1)])
    s.apply(plan)
    after = s.scheduled(plan)
    assert after.states == [s.get(1), s.get(2)] and after.version != with_new.version


def test_kept_running_rows_match_a_fresh_lookup_over_random_plans():
    """The running rows are looked up once and kept while the plan's ids stay the same: over
    random plans (drops, readmissions under the same id, decodes, chunks) every step's batch is
    what a fresh lookup of the states gives."""
    import random

    rng = random.Random(0)
    s = states(num_kv_blocks=64, max_blocks_per_seq=16)
    running: dict[int, int] = {}  # seq_id -> known tokens, as the scheduler sees it
    last_version, last_states = s.version, []
    for step in range(1, 300):
        # 16 blocks of 4 hold 64 tokens: a sequence ends before it needs more
        finished = [seq_id for seq_id in running if rng.random() < 0.1 or len(s.get(seq_id).token_ids) >= 60]
        for seq_id in finished:
            del running[seq_id]
        new = []
        for seq_id in rng.sample(range(12), 3):
            if seq_id not in running and rng.random() < 0.5:  # a dropped id may come back
                n = rng.randint(1, 9)
                new.append(new_seq(seq_id, [seq_id * 100 + i for i in range(n)], list(range(16)),
                                   rng.randint(1, n)))
                running[seq_id] = n
        new_ids = {x.seq_id for x in new}
        rows = []
        for seq_id in running:
            if seq_id in new_ids:
                continue
            state = s.get(seq_id)
            left = len(state.token_ids) - state.num_computed_tokens
            rows.append(RunningSequence(seq_id, rng.randint(1, left) if left > 1 else 1,
                                        block_table_start=1, block_ids=list(range(16, 31))) if rng.random() < 0.2
                        else RunningSequence(seq_id, rng.randint(1, left) if left > 1 else 1))
        plan = StepPlan(step, new_seqs=new, running_seqs=rows, finished_seq_ids=finished)
        s.apply(plan)
        batch = s.scheduled(plan)
        expected = [s.get(x.seq_id) for x in new] + [s.get(r.seq_id) for r in rows]
        assert batch.seq_ids == [x.seq_id for x in new] + [r.seq_id for r in rows]
        assert all(a is b for a, b in zip(batch.states, expected)) and len(batch.states) == len(expected)
        assert batch.rows.tolist() == [st.row for st in expected]
        ends = [st.num_computed_tokens + n for st, n in
                zip(expected, [x.num_scheduled_tokens for x in new] + [r.num_scheduled_tokens for r in rows])]
        assert batch.seq_lens.tolist() == ends
        assert batch.sampled == [i for i, (st, e) in enumerate(zip(expected, ends)) if e == len(st.token_ids)]
        assert batch.num_blocks.tolist() == [int(s.tables.num_blocks[st.row]) for st in expected]
        if batch.version == last_version:  # same version: the same states in the same order as last step
            assert len(batch.states) == len(last_states) and all(a is b for a, b in zip(batch.states, last_states))
        last_version, last_states = batch.version, list(batch.states)
        batch.advance()
        for i in batch.sampled:  # "sample" a token for the sequences that reached their end
            batch.states[i].token_ids.append(step)
