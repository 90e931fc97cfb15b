"""The decode fast path over the running batch's arrays against the per-sequence path: the same
random workloads (prefix sharing, preemption, aborts, n > 1, stop tokens, min_tokens, overlap)
must give identical plans, outputs and allocator state, step by step."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvcache.allocator import BlockAllocator
from pagewire_common.plan import RunningSequence, StepPlan
from pagewire_common.sampling import SamplingParams
from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.engine import EngineCore, WorkerInfo
from scheduler_svc.core.running_step import FAST_DECODE_MIN_ROWS
from tests.fake_worker import EOS, VOCAB, DrivenEngine, FakeKVWorker, LaggingLink


def make_engine(fast: bool, *, num_blocks: int, block_size: int, budget: int, prefix: bool, max_num_seqs: int):
    worker = FakeKVWorker(num_blocks, block_size)
    info = WorkerInfo("fake", VOCAB, 256, block_size, num_blocks, (EOS,))
    config = SchedulerConfig(max_model_len=256, max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                             enable_prefix_caching=prefix)
    engine = DrivenEngine(EngineCore(config, info), worker)
    engine.scheduler.fast_decode = fast
    engine.scheduler.fast_decode_min_rows = 1  # the arrays even for a single sequence
    return engine, LaggingLink(worker)


def allocator_state(allocator: BlockAllocator) -> tuple:
    return (allocator._seq_block_ids, allocator._seq_num_tokens, allocator._seq_block_hashes,
            allocator._hash_to_block, allocator._ref_counts, allocator._next_free, allocator._num_free)


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
        params = SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[rng.randrange(VOCAB - 1) for _ in range(40)],
                                min_tokens=rng.choice([0, 3]))
    elif kind < 0.4:
        params = SamplingParams(temperature=0, max_tokens=rng.randint(1, 40), logprobs=True)
    return prompt, params


def run_workload(fast: bool, seed: int, depth: int, threshold: int | None = 1, **engine_args):
    """Drive one engine through a random workload; returns every plan, every output and the
    allocator state after every step (``threshold``: the scheduler's fast_decode_min_rows, None
    for its default)."""
    rng = random.Random(seed)
    engine, link = make_engine(fast, **engine_args)
    engine.scheduler.fast_decode_min_rows = FAST_DECODE_MIN_ROWS if threshold is None else threshold
    prompts: list[list[int]] = []
    plans, outputs, states = [], [], []
    live: set[str] = set()
    for step in range(300):
        if step < 240 and rng.random() < 0.5:
            rid = f"q{step}"
            prompt, params = random_request(rng, prompts)
            engine.add_request(rid, prompt_token_ids=prompt, sampling=params)
            live.add(rid)
        if live and rng.random() < 0.04:
            victim = rng.choice(sorted(live))
            engine.abort(victim)
            live.discard(victim)
        plan = engine.next_plan(depth)
        if plan is not None:
            link.send(plan)
            plans.append(plan)
        if engine.should_receive(plan is not None, depth):
            for seq in engine.on_result(link.receive()).sequences():
                outputs.append((seq.seq_id, seq.token_ids[-1], seq.finish_reason))
                if seq.finish_reason is not None:
                    live.discard(engine.names[seq.seq_id])
        engine.allocator.check_integrity()
        engine.scheduler.batch.check(engine.scheduler.running)
        states.append(repr(allocator_state(engine.allocator)))
    return plans, outputs, states, engine.scheduler.num_preemptions


@pytest.mark.parametrize("prefix", [True, False])
@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("budget", [24, 7])  # 7: fewer than the decodes, which the budget then cuts
def test_fast_decode_matches_the_per_sequence_path(seed, depth, prefix, budget):
    engine_args = dict(num_blocks=48, block_size=4, budget=budget, prefix=prefix, max_num_seqs=12)
    fast = run_workload(True, seed, depth, **engine_args)
    slow = run_workload(False, seed, depth, **engine_args)
    assert len(fast[0]) == len(slow[0])
    for step, (a, b) in enumerate(zip(fast[0], slow[0])):
        assert a == b, f"plan {step} differs"
    assert fast[1] == slow[1]
    assert fast[2] == slow[2]
    assert fast[3] == slow[3]


def test_workloads_exercise_the_unusual_paths():
    """The random workloads above preempt, roll over into new blocks, cut decodes by the budget
    and finish on stop tokens (else the comparison proves little)."""
    plans, outputs, _, preemptions = run_workload(True, 0, 2, num_blocks=48, block_size=4, budget=24, prefix=True,
                                                  max_num_seqs=12)
    assert preemptions > 0
    assert any(plan.block_updates for plan in plans)
    assert any(reason is not None and reason.value == "stop" for _, _, reason in outputs)
    many = [plan for plan in plans if len(plan.running_seq_ids) >= 8]
    assert many, "the batches stay small"


def test_plain_decodes_take_no_per_sequence_path():
    """A steady decode of many sequences is scheduled and updated over the arrays: the
    per-sequence path runs only for a decode that needs a block it cannot get in place."""
    engine, link = make_engine(True, num_blocks=256, block_size=16, budget=512, prefix=True, max_num_seqs=64)
    for i in range(32):
        engine.add_request(f"r{i}", prompt_token_ids=[1 + i, 2, 3], sampling=SamplingParams(temperature=0, max_tokens=40))
    scheduler = engine.scheduler
    calls = []
    slow = scheduler._schedule_one
    scheduler._schedule_one = lambda seq, budget: calls.append(seq.seq_id) or slow(seq, budget)
    tokens = 0
    while engine.has_unfinished() or engine.num_in_flight:
        tokens += sum(len(o.token_ids) for o in engine.pipeline_step(link, 2))
        engine.allocator.check_integrity()
    assert tokens == 32 * 40
    assert calls == []


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


@pytest.mark.parametrize("depth", [1, 2])
def test_small_batches_take_the_loop_and_agree(depth):
    """Under ``fast_decode_min_rows`` running sequences (or results) a step is a loop over them,
    since the array operations' fixed cost is more than they save; plans, outputs and allocator
    state stay the same whichever way a step goes."""
    args = dict(num_blocks=48, block_size=4, budget=24, prefix=True, max_num_seqs=12)
    arrays = run_workload(True, 3, depth, **args)
    assert FAST_DECODE_MIN_ROWS > 12
    assert run_workload(True, 3, depth, threshold=None, **args)[:3] == arrays[:3]
    assert run_workload(True, 3, depth, threshold=6, **args)[:3] == arrays[:3]
