"""The array path (``RunningBatch.plain_decodes``/``take_plain_tokens``) against the plain path
(``Scheduler._schedule_row``/``_apply_token`` for every row): the same random traces (arrivals,
prompt lengths, max_tokens, stop tokens, min_tokens, logprobs, n > 1 forks, prefix-cache hits,
aborts and stop strings, preemption under a small block pool, one or two plans in flight) must
give the same plans, tokens, counters and allocator state, step by step."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import pytest

from kvcache.allocator import BlockAllocator
from pagewire_common.plan import RunningSequence, StepPlan
from pagewire_common.requests import FinishReason
from pagewire_common.sampling import SamplingParams
from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.engine import EngineCore, WorkerInfo
from scheduler_svc.core.running_batch import FAST_DECODE_MIN_ROWS, RunningBatch
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.core.sequence import Sequence
from tests.fake_worker import EOS, VOCAB, DrivenEngine, FakeKVWorker, LaggingLink


def make_engine(min_rows: int | None, *, num_blocks: int, block_size: int, budget: int, prefix: bool,
                max_num_seqs: int):
    """An engine whose scheduler takes the array path from ``min_rows`` rows on (None: never)."""
    worker = FakeKVWorker(num_blocks, block_size)
    info = WorkerInfo("fake", VOCAB, 256, block_size, num_blocks, (EOS,))
    config = SchedulerConfig(max_model_len=256, max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                             enable_prefix_caching=prefix)
    engine = DrivenEngine(EngineCore(config, info), worker)
    engine.scheduler.fast_decode = min_rows is not None
    engine.scheduler.fast_decode_min_rows = min_rows or FAST_DECODE_MIN_ROWS
    return engine, LaggingLink(worker)


def plan_fields(plan: StepPlan) -> tuple:
    return (plan.step_id, plan.new_seqs, plan.running_seq_ids.tolist(), plan.running_num_scheduled_tokens.tolist(),
            [(row, start, list(block_ids)) for row, start, block_ids in plan.block_updates],
            list(plan.finished_seq_ids), [tuple(copy) for copy in plan.block_copies])


def allocator_state(allocator: BlockAllocator) -> str:
    return repr((allocator._seq_block_ids, allocator._seq_num_tokens, allocator._seq_block_hashes,
                 allocator._hash_to_block, allocator._ref_counts, allocator._next_free, allocator._num_free))


def counters(scheduler: Scheduler) -> list[tuple]:
    """Every held sequence's row, checked against the sequence and the allocator on the way."""
    batch, allocator = scheduler.batch, scheduler.allocator
    held = list(scheduler.seqs.values())
    batch.check(held)
    for seq in scheduler.running:
        slot = seq.slot
        assert batch.limit[slot] == allocator.growth_limit(seq.seq_id), "stale growth limit"
        assert batch.slot_tokens[slot] == allocator._seq_num_tokens[seq.seq_id]
    return sorted((seq.seq_id, seq.status.value, *(getattr(batch, name)[seq.slot] for name in
                   ("computed", "pending", "known", "slot_tokens", "hashed", "limit"))) for seq in held)


def random_request(rng: random.Random, prompts: list[list[int]]) -> tuple[list[int], SamplingParams]:
    if prompts and rng.random() < 0.4:  # a prompt seen before, maybe extended: prefix-cache hits
        prompt = list(rng.choice(prompts)) + [rng.randrange(VOCAB - 1) for _ in range(rng.randint(0, 6))]
    else:
        prompt = [rng.randrange(VOCAB - 1) for _ in range(rng.randint(1, 40))]
    prompts.append(prompt)
    kind = rng.random()
    params = SamplingParams(temperature=0, max_tokens=rng.randint(1, 40))
    if kind < 0.15:
        params = SamplingParams(temperature=0, max_tokens=rng.randint(2, 30), n=rng.randint(2, 3))
    elif kind < 0.3:  # stop on tokens the fake model produces often enough to matter
        stops = [rng.randrange(VOCAB - 1) for _ in range(40)]
        params = SamplingParams(temperature=0, max_tokens=40, stop_token_ids=stops, min_tokens=rng.choice([0, 3]))
    elif kind < 0.4:
        params = SamplingParams(temperature=0, max_tokens=rng.randint(1, 40), logprobs=True)
    return prompt, params


@dataclass
class Trace:
    plans: list[tuple] = field(default_factory=list)
    tokens: list[list[tuple]] = field(default_factory=list)  # per result: (seq id, token, finish reason)
    counters: list[list[tuple]] = field(default_factory=list)
    allocator: list[str] = field(default_factory=list)
    num_preemptions: int = 0
    num_array_steps: int = 0  # plans whose running rows took the array path


def run_trace(min_rows: int | None, seed: int, depth: int, num_steps: int = 300, burst: int = 1,
              **engine_args) -> Trace:
    """Drive one engine through a random trace (up to ``burst`` arrivals a step, each with
    probability 1/2), recording everything after every step."""
    rng = random.Random(seed)
    engine, link = make_engine(min_rows, **engine_args)
    scheduler = engine.scheduler
    prompts: list[list[int]] = []
    trace = Trace()
    live: set[str] = set()
    for step in range(num_steps):
        for arrival in range(burst if step < num_steps - 60 else 0):
            if rng.random() < 0.5:
                name = f"q{step}.{arrival}"
                prompt, params = random_request(rng, prompts)
                engine.add_request(name, prompt_token_ids=prompt, sampling=params)
                live.add(name)
        if live and rng.random() < 0.04:
            engine.abort(victim := rng.choice(sorted(live)))
            live.discard(victim)
        if live and rng.random() < 0.02:  # a stop string found by the reader
            engine.finish(ended := rng.choice(sorted(live)), FinishReason.STOP)
            live.discard(ended)
        num_running = scheduler.num_running
        plan = engine.next_plan(depth)
        if plan is not None:
            link.send(plan)
            trace.plans.append(plan_fields(plan))
            trace.num_array_steps += scheduler.fast_decode and num_running >= scheduler.fast_decode_min_rows
        if engine.should_receive(plan is not None, depth):
            tokens = engine.on_result(link.receive())
            got = [(seq.seq_id, seq.token_ids[-1], seq.finish_reason) for seq in tokens.sequences()]
            plain = zip(tokens.slots.tolist(), tokens.seq_ids.tolist(), tokens.token_ids.tolist())
            for slot, seq_id, token_id in plain:
                seq = scheduler.batch.seqs[slot]  # a plain token: not a first, not a last, no logprobs
                assert seq.seq_id == seq_id and seq.token_ids[-1] == token_id
                assert seq.num_output_tokens > 1 and seq.finish_reason is None and not seq.sampling.logprobs
            trace.tokens.append(got)
            for seq_id, _, reason in got:
                if reason is not None:
                    live.discard(engine.names[seq_id])
        engine.allocator.check_integrity()
        trace.counters.append(counters(scheduler))
        trace.allocator.append(allocator_state(engine.allocator))
    while engine.has_unfinished() or engine.num_in_flight:
        for name in sorted(live):
            engine.abort(name)
        live.clear()
        engine.pipeline_step(link, depth)
    engine.drain()
    engine.allocator.check_integrity()
    assert engine.allocator.num_free_blocks == engine.allocator.num_blocks
    trace.num_preemptions = scheduler.num_preemptions
    return trace


def assert_same(a: Trace, b: Trace) -> None:
    assert len(a.plans) == len(b.plans)
    for step, (x, y) in enumerate(zip(a.plans, b.plans)):
        assert x == y, f"plan {step} differs"
    for step, (x, y) in enumerate(zip(a.tokens, b.tokens)):
        assert x == y, f"result {step} differs"
    for step, (x, y) in enumerate(zip(a.counters, b.counters)):
        assert x == y, f"counters after step {step} differ"
    for step, (x, y) in enumerate(zip(a.allocator, b.allocator)):
        assert x == y, f"allocator state after step {step} differs"
    assert (len(a.tokens), a.num_preemptions) == (len(b.tokens), b.num_preemptions)


SMALL = dict(num_blocks=48, block_size=4, prefix=True, max_num_seqs=12)


@pytest.mark.parametrize("prefix", [True, False])
@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("budget", [24, 7])  # 7: fewer than the decodes, which the budget then cuts
def test_array_path_matches_the_plain_path(seed, depth, prefix, budget):
    args = dict(SMALL, budget=budget, prefix=prefix)
    plain = run_trace(None, seed, depth, **args)
    arrays = run_trace(1, seed, depth, **args)  # the array path for every step, even one row
    assert arrays.num_array_steps > 100
    assert_same(arrays, plain)


@pytest.mark.parametrize("depth", [1, 2])
def test_many_rows_cross_the_threshold_and_agree(depth):
    """With the scheduler's own threshold, a trace whose batch grows past ``FAST_DECODE_MIN_ROWS``
    and shrinks again takes both paths; a small pool preempts at full size."""
    args = dict(num_blocks=500, block_size=4, budget=256, prefix=True, max_num_seqs=128)
    plain = run_trace(None, 5, depth, num_steps=200, burst=8, **args)
    mixed = run_trace(FAST_DECODE_MIN_ROWS, 5, depth, num_steps=200, burst=8, **args)
    assert 20 < mixed.num_array_steps < len(mixed.plans) - 20
    assert mixed.num_preemptions > 0
    assert_same(mixed, plain)


def test_traces_exercise_the_unusual_paths():
    """The random traces above preempt, roll over into new blocks, copy blocks, fork, cut decodes
    by the budget and finish on stop tokens (else the comparison proves little)."""
    trace = run_trace(1, 0, 2, **SMALL, budget=24)
    assert trace.num_preemptions > 0
    assert any(block_updates for _, _, _, _, block_updates, _, _ in trace.plans)
    assert any(copies for *_, copies in trace.plans)
    assert any(new.num_computed_tokens > 0 for _, new_seqs, *_ in trace.plans for new in new_seqs)
    assert any(reason is FinishReason.STOP for result in trace.tokens for _, _, reason in result)
    assert any(len(seq_ids) >= 8 for _, _, seq_ids, *_ in trace.plans), "the batches stay small"


def test_plain_decodes_go_over_the_arrays():
    """A steady decode of many sequences is scheduled and applied over the arrays: one by one go
    only the rows that take a block or complete one, and the first and last tokens."""
    engine, link = make_engine(1, num_blocks=256, block_size=16, budget=512, prefix=True, max_num_seqs=64)
    for i in range(32):
        engine.add_request(f"r{i}", prompt_token_ids=[1 + i, 2, 3],
                           sampling=SamplingParams(temperature=0, max_tokens=40))
    scheduler, batch = engine.scheduler, engine.scheduler.batch
    one_by_one, applied = [], []
    schedule_row, apply_token = scheduler._schedule_row, scheduler._apply_token

    def spy_row(seq, *args):
        slot = seq.slot
        completes = (batch.computed[slot] + 1) % 16 == 0 or batch.known[slot] // 16 > batch.hashed[slot]
        one_by_one.append(batch.computed[slot] >= batch.limit[slot] or completes)
        return schedule_row(seq, *args)

    def spy_token(seq, result, i):
        applied.append(len(seq.token_ids) - seq.num_prompt_tokens)
        return apply_token(seq, result, i)

    scheduler._schedule_row, scheduler._apply_token = spy_row, spy_token
    tokens = 0
    while engine.has_unfinished() or engine.num_in_flight:
        tokens += sum(len(o.token_ids) for o in engine.pipeline_step(link, 2))
        engine.allocator.check_integrity()
    assert tokens == 32 * 40
    assert all(one_by_one) and len(one_by_one) <= 32 * 4  # two rollovers and two full blocks each
    assert sorted(applied) == [0] * 32 + [39] * 32  # the first token, and the last


@pytest.mark.parametrize("depth", [1, 2])
def test_small_batches_take_the_loop_and_agree(depth):
    """Under ``fast_decode_min_rows`` running sequences (or results) a step is a loop over them,
    since the array operations' fixed cost is more than they save; plans, tokens and allocator
    state stay the same whichever way a step goes."""
    args = dict(SMALL, budget=24)
    arrays = run_trace(1, 3, depth, **args)
    assert FAST_DECODE_MIN_ROWS > 12
    assert_same(run_trace(FAST_DECODE_MIN_ROWS, 3, depth, **args), arrays)
    assert_same(run_trace(6, 3, depth, **args), arrays)


def test_slots_are_reused_from_the_next_recycle():
    batch = RunningBatch(capacity=2)
    seqs = [Sequence(100 + i, [1, 2, 3], SamplingParams(max_tokens=4)) for i in range(3)]
    assert [batch.add(seq) for seq in seqs] == [0, 1, 2]  # grew past its capacity
    assert batch.capacity == 4 and batch.known[2] == 3
    batch.computed[1] = 7
    batch.remove(seqs[0])
    assert seqs[0].slot == -1
    assert batch.slots_of(np.array([100, 101, 102, 5])).tolist() == [-1, 1, 2, -1]
    later = Sequence(200, [4], SamplingParams())
    assert batch.add(later) == 3  # slot 0 is not reused before recycle: a StepTokens may name it
    batch.recycle()
    assert batch.add(Sequence(201, [4], SamplingParams())) == 0
    assert batch.computed[1] == 7 and batch.computed[0] == 0
    batch.check([seqs[1], seqs[2], later, batch.seqs[0]])


def test_step_plan_rows_as_objects_and_arrays_agree():
    rows = [RunningSequence(3, 1), RunningSequence(5, 4, block_table_start=2, block_ids=[7, 8])]
    plan = StepPlan(1, running_seqs=rows)
    assert plan.running_seq_ids.tolist() == [3, 5]
    assert plan.running_num_scheduled_tokens.tolist() == [1, 4]
    assert plan.block_updates == [(1, 2, [7, 8])]
    assert plan.running_seqs == rows
    assert plan.num_scheduled_tokens == 5
    same = StepPlan(1, running_seq_ids=np.array([3, 5]), running_num_scheduled_tokens=[1, 4],
                    block_updates=[(1, 2, [7, 8])])
    assert same == plan


def test_a_sequence_keeps_no_counters():
    """A sequence's progress has one home, its row in the batch: ``Sequence`` has no counter of
    its own, nor a way to reach the batch."""
    names = set(Sequence.__slots__) | set(dir(Sequence))
    assert not names & {"num_computed_tokens", "num_pending_tokens", "num_slot_tokens", "num_hashed_blocks",
                        "num_tokens", "batch"}
