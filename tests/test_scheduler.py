"""Scheduling core against a torch-free worker whose output depends on what it reads back
through the block tables (tests/fake_worker.py)."""

from __future__ import annotations

import random

import pytest

from pagewire_common.requests import FinishReason
from pagewire_common.sampling import SamplingParams
from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.engine import EngineCore, WorkerInfo
from tests.fake_worker import EOS, VOCAB, DrivenEngine, FakeKVWorker, LaggingLink, reference_tokens


def make_engine(num_blocks=64, block_size=4, budget=16, max_num_seqs=64, prefix=True, max_model_len=512, pacing=0):
    worker = FakeKVWorker(num_blocks, block_size)
    info = WorkerInfo("fake", VOCAB, max_model_len, block_size, num_blocks, (EOS,))
    config = SchedulerConfig(
        max_model_len=max_model_len,
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        enable_prefix_caching=prefix,
        prefill_pacing_steps=pacing,
    )
    return DrivenEngine(EngineCore(config, info), worker), worker


def make_prompts(n, seed=0, lengths=None):
    rng = random.Random(seed)
    lengths = lengths or [rng.randint(1, 120) for _ in range(n)]
    return [[rng.randrange(VOCAB - 1) for _ in range(L)] for L in lengths]


def run_all(engine, prompts, params):
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    outs = {}
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", prompt_token_ids=p, sampling=sp)
        outs[f"r{i}"] = []
    finals = {}
    steps = 0
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id].extend(o.token_ids)
            if o.finished:
                finals[o.request_id] = o
        engine.allocator.check_integrity()
        steps += 1
        assert steps < 10_000, "engine did not finish"
    return [outs[f"r{i}"] for i in range(len(prompts))], [finals[f"r{i}"] for i in range(len(prompts))]


def assert_all_free(engine):
    engine.allocator.check_integrity()
    assert engine.allocator.num_free_blocks == engine.allocator.num_blocks
    assert engine.scheduler.num_running == 0 and engine.scheduler.num_waiting == 0


def test_batched_chunked_prefill_matches_reference():
    engine, worker = make_engine(num_blocks=256, block_size=4, budget=16)
    prompts = make_prompts(10, lengths=[1, 2, 4, 5, 17, 33, 64, 100, 121, 8])
    sp = SamplingParams(temperature=0, max_tokens=12)
    outs, finals = run_all(engine, prompts, sp)
    for p, o, f in zip(prompts, outs, finals):
        assert o == reference_tokens(p, 12)
        assert f.finish_reason is FinishReason.LENGTH
        assert f.usage.prompt_tokens == len(p) and f.usage.completion_tokens == 12
    assert_all_free(engine)
    assert all(p.num_scheduled_tokens <= 16 for p in worker.plans)
    # the long prompts really were split across steps
    assert any(s.num_scheduled_tokens < len(s.token_ids) for p in worker.plans for s in p.new_seqs)


def test_decodes_keep_flowing_during_long_prefill():
    engine, worker = make_engine(num_blocks=256, block_size=4, budget=8)
    engine.add_request("short", prompt_token_ids=[1, 2, 3], sampling=SamplingParams(temperature=0, max_tokens=60))
    engine.step()  # prefill the short one, it is now decoding
    engine.add_request("long", prompt_token_ids=list(range(200)), sampling=SamplingParams(temperature=0, max_tokens=2))
    decoded_each_step = []
    while engine.has_unfinished():
        engine.step()
        plan = worker.plans[-1]
        if any(s.seq_id == 1 for s in plan.new_seqs) or any(
            d.seq_id == 1 and d.num_scheduled_tokens > 1 for d in plan.running_seqs
        ):
            # a step that carries a chunk of the long prompt also carries the short one's decode
            decoded_each_step.append(any(d.seq_id == 0 for d in plan.running_seqs))
    # 200 prompt tokens in chunks of 7 (budget 8 minus the decode) while the short one decodes
    assert len(decoded_each_step) == 29
    assert all(decoded_each_step)
    assert_all_free(engine)


def test_preemption_keeps_outputs_exact():
    # 12 blocks of 4 tokens = 48 slots: far too few for 6 sequences of ~30 tokens at once
    engine, worker = make_engine(num_blocks=12, block_size=4, budget=32, prefix=False)
    prompts = make_prompts(6, seed=3, lengths=[9, 14, 5, 20, 11, 7])
    sp = SamplingParams(temperature=0, max_tokens=16)
    outs, _ = run_all(engine, prompts, sp)
    assert engine.scheduler.num_preemptions > 0
    for p, o in zip(prompts, outs):
        assert o == reference_tokens(p, 16)
    assert_all_free(engine)


def test_preemption_with_prefix_cache_keeps_outputs_exact():
    engine, _ = make_engine(num_blocks=14, block_size=4, budget=12, prefix=True)
    base = make_prompts(1, seed=9, lengths=[12])[0]
    prompts = [base + [i] * (i + 1) for i in range(6)]
    outs, _ = run_all(engine, prompts, SamplingParams(temperature=0, max_tokens=14))
    assert engine.scheduler.num_preemptions > 0
    for p, o in zip(prompts, outs):
        assert o == reference_tokens(p, 14)
    assert_all_free(engine)


def test_prefix_cache_second_run_hits_and_matches():
    engine, worker = make_engine(num_blocks=256, block_size=4, budget=64)
    prompts = make_prompts(5, seed=5, lengths=[3, 16, 23, 40, 64])
    sp = SamplingParams(temperature=0, max_tokens=8)
    first, f1 = run_all(engine, prompts, sp)
    second, f2 = run_all(engine, prompts, sp)
    assert first == second == [reference_tokens(p, 8) for p in prompts]
    assert [f.usage.cached_prompt_tokens for f in f1] == [0] * 5
    # full blocks are reused; a prompt made of full blocks only recomputes its last token
    assert [f.usage.cached_prompt_tokens for f in f2] == [0, 15, 20, 39, 63]
    assert_all_free(engine)
    assert engine.allocator.num_cached_blocks > 0


def test_fully_cached_prompt_copies_shared_last_block_before_writing():
    engine, worker = make_engine(num_blocks=64, block_size=4, budget=64)
    prompt = list(range(10, 26))  # 16 tokens: exactly 4 full blocks
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    engine.add_request("a", prompt_token_ids=prompt, sampling=sp)
    engine.step()  # prefill a: its 4 blocks are computed and cached
    engine.add_request("b", prompt_token_ids=prompt, sampling=sp)
    engine.step()
    plan = worker.plans[-1]
    (new,) = plan.new_seqs
    assert new.num_computed_tokens == 15
    a_blocks = engine.allocator.block_ids(0)
    assert new.block_ids[:3] == a_blocks[:3]  # shared
    src, dst = plan.block_copies[0]
    assert src == a_blocks[3] and new.block_ids[3] == dst != src
    outs, _ = {}, None
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.token_ids)
    assert_all_free(engine)
    assert worker.copies == [(src, dst)]


def test_stop_token_ids_eos_and_model_length():
    engine, _ = make_engine(num_blocks=256, block_size=4, budget=64, max_model_len=40)
    prompt = make_prompts(1, seed=11, lengths=[10])[0]
    ref = reference_tokens(prompt, 40)
    stop_tok = ref[4]
    cut = ref.index(stop_tok) + 1
    outs, finals = run_all(
        engine,
        [prompt, prompt, prompt],
        [
            SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_tok]),
            SamplingParams(temperature=0, max_tokens=7),
            SamplingParams(temperature=0, max_tokens=1000),
        ],
    )
    assert outs[0] == ref[:cut] and finals[0].finish_reason is FinishReason.STOP
    assert outs[1] == ref[:7] and finals[1].finish_reason is FinishReason.LENGTH
    assert len(prompt) + len(outs[2]) == 40 and finals[2].finish_reason is FinishReason.LENGTH
    assert_all_free(engine)


def test_abort_frees_blocks_and_worker_drops_state():
    engine, worker = make_engine(num_blocks=64, block_size=4, budget=64)
    for i in range(4):
        engine.add_request(f"r{i}", prompt_token_ids=list(range(1, 12 + i)), sampling=SamplingParams(max_tokens=50))
    for _ in range(3):
        engine.step()
    assert engine.abort("r1") and engine.abort("r2")
    assert not engine.abort("r1")
    engine.allocator.check_integrity()
    engine.step()
    assert sorted(worker.plans[-1].finished_seq_ids) == [1, 2]
    assert set(worker.seqs) == {0, 3}
    for rid in ("r0", "r3"):
        engine.abort(rid)
    assert_all_free(engine)
    assert engine.num_aborted == 4


def test_a_worker_that_gives_no_logprobs_leaves_nan_not_a_crash():
    """The fake worker, like a worker without them, answers no logprobs: a sequence that asked gets
    NaN and an empty top list per token (delivery reads one per token), not an IndexError that would
    fail every request in flight."""
    import math

    engine, worker = make_engine(num_blocks=64, block_size=4, budget=64)
    engine.add_request("a", prompt_token_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=3, logprobs=True,
                                                                                 top_logprobs=2, ignore_eos=True))
    outs = []
    while not engine.engine.is_idle():
        outs += engine.step()
    assert [t for o in outs for t in o.token_ids] == reference_tokens([1, 2, 3], 3)
    assert all(math.isnan(lp) for o in outs for lp in o.logprobs) and len(outs) == 3
    assert [o.top_logprobs for o in outs] == [[([], [])]] * 3
    assert_all_free(engine)


def test_max_num_seqs_caps_running():
    engine, worker = make_engine(num_blocks=256, block_size=4, budget=256, max_num_seqs=3)
    prompts = make_prompts(8, seed=2, lengths=[5] * 8)
    outs, _ = run_all(engine, prompts, SamplingParams(temperature=0, max_tokens=5))
    assert max(len(p.new_seqs) + len(p.running_seqs) for p in worker.plans) == 3
    assert outs == [reference_tokens(p, 5) for p in prompts]
    assert_all_free(engine)


@pytest.mark.parametrize("budget, max_num_seqs, n", [(1, 64, 4), (4, 64, 4), (16, 2, 2), (3, 3, 3)])
def test_forked_samples_keep_to_the_budget_and_max_num_seqs(budget, max_num_seqs, n):
    """n > 1: the samples forked once a prompt is computed start as the step's token budget and
    max_num_seqs leave room, the others in later steps; every sample is the greedy reference."""
    engine, worker = make_engine(num_blocks=256, block_size=4, budget=budget, max_num_seqs=max_num_seqs)
    prompts = make_prompts(2, seed=3, lengths=[8, 5])
    outs: dict[tuple[str, int], list[int]] = {}
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", prompt_token_ids=p, sampling=SamplingParams(temperature=0, max_tokens=4, n=n,
                                                                                ignore_eos=True))
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault((o.request_id, o.index), []).extend(o.token_ids)
        engine.allocator.check_integrity()
    assert max(sum(s.num_scheduled_tokens for s in p.new_seqs) + int(p.running_num_scheduled_tokens.sum())
               for p in worker.plans) <= budget
    assert max(len(p.new_seqs) + len(p.running_seq_ids) for p in worker.plans) <= max_num_seqs
    # the fake worker names sample k of request r "r#k"
    assert outs == {(f"r{i}#{k}" if k else f"r{i}", k): reference_tokens(p, 4)
                    for i, p in enumerate(prompts) for k in range(n)}
    assert_all_free(engine)


@pytest.mark.parametrize("num_blocks", [7, 8])
def test_a_waiting_sample_copies_its_parents_block_before_the_parent_lets_it_go(num_blocks):
    """A forked sample that waits for room copies its parent's last prompt block in the first plan
    after the fork all the same: the parent (2 tokens, then done) frees that block while the
    samples wait, and the long request takes it and writes its own K/V there."""
    engine, worker = make_engine(num_blocks=num_blocks, block_size=4, budget=2, max_num_seqs=4, prefix=False)
    long, forked = [12, 12, 22, 8], [17, 2, 46, 31, 77, 5]
    engine.add_request("long", prompt_token_ids=long, sampling=SamplingParams(temperature=0, max_tokens=20,
                                                                              ignore_eos=True))
    engine.add_request("f", prompt_token_ids=forked, sampling=SamplingParams(temperature=0, max_tokens=2, n=4,
                                                                             ignore_eos=True))
    outs: dict[tuple[str, int], list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault((o.request_id, o.index), []).extend(o.token_ids)
        engine.allocator.check_integrity()
    assert outs == {("long", 0): reference_tokens(long, 20),
                    **{(f"f#{k}" if k else "f", k): reference_tokens(forked, 2) for k in range(4)}}
    assert_all_free(engine)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(prompt_token_ids=[]), "empty"),
        (dict(), "needs a prompt"),
        (dict(prompt_token_ids=[1, VOCAB]), "outside the vocabulary"),
        (dict(prompt_token_ids=list(range(100))), "maximum model length"),
    ],
)
def test_bad_requests_raise_and_leave_engine_usable(kwargs, message):
    engine, _ = make_engine(max_model_len=64)
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", sampling=SamplingParams(temperature=0, max_tokens=4), **kwargs)
    outs, _ = run_all(engine, [[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4))
    assert outs == [reference_tokens([1, 2, 3], 4)]
    assert_all_free(engine)


def test_strict_length_rejects_prompt_plus_max_tokens():
    engine, _ = make_engine(max_model_len=64)
    with pytest.raises(ValueError, match="exceeds the maximum model length 64"):
        engine.add_request("x", prompt_token_ids=[1] * 60, sampling=SamplingParams(max_tokens=5), strict_length=True)
    engine.add_request("y", prompt_token_ids=[1] * 60, sampling=SamplingParams(max_tokens=4), strict_length=True)


def test_model_len_capped_to_cache_capacity():
    engine, _ = make_engine(num_blocks=8, block_size=4, max_model_len=512, budget=24, pacing=8)
    assert engine.max_model_len == 32
    # the rest of the policy survives the cap
    assert engine.config.max_num_batched_tokens == 24 and engine.config.prefill_pacing_steps == 8


def test_random_workload_with_aborts_balances_blocks():
    rng = random.Random(1234)
    engine, _ = make_engine(num_blocks=40, block_size=4, budget=24, max_num_seqs=8)
    expected = {}
    got = {}
    live = set()
    for step in range(400):
        if rng.random() < 0.3 and len(live) < 12:
            rid = f"q{step}"
            prompt = [rng.randrange(VOCAB - 1) for _ in range(rng.randint(1, 30))]
            n = rng.randint(1, 20)
            engine.add_request(rid, prompt_token_ids=prompt, sampling=SamplingParams(temperature=0, max_tokens=n))
            expected[rid] = reference_tokens(prompt, n)
            got[rid] = []
            live.add(rid)
        if live and rng.random() < 0.05:
            victim = rng.choice(sorted(live))
            engine.abort(victim)
            live.discard(victim)
            expected.pop(victim)
        for o in engine.step():
            if o.request_id in got:
                got[o.request_id].extend(o.token_ids)
                if o.finished:
                    live.discard(o.request_id)
        engine.allocator.check_integrity()
    while engine.has_unfinished():
        for o in engine.step():
            got[o.request_id].extend(o.token_ids)
    for rid, toks in expected.items():
        assert got[rid] == toks, rid
    assert_all_free(engine)


# ---- prefill pacing ----------------------------------------------------------------------


def _prefill_tokens(plan) -> int:
    """Prompt tokens a plan carries: new sequences' slices and running chunks longer than one."""
    return sum(s.num_scheduled_tokens for s in plan.new_seqs) + sum(
        d.num_scheduled_tokens for d in plan.running_seqs if d.num_scheduled_tokens > 1
    )


def test_prefill_pacing_spreads_a_long_prompt_while_a_stream_decodes():
    results = {}
    for pacing in (0, 8):
        engine, worker = make_engine(num_blocks=256, block_size=4, budget=64, pacing=pacing)
        short = engine.add_request("short", prompt_token_ids=[1, 2, 3], sampling=SamplingParams(temperature=0, max_tokens=90))
        engine.step()  # the short one is decoding now
        long_prompt = make_prompts(1, seed=5, lengths=[200])[0]
        engine.add_request("long", prompt_token_ids=long_prompt, sampling=SamplingParams(temperature=0, max_tokens=3))
        long_out = []
        chunks = []
        while engine.has_unfinished():
            for o in engine.step():
                if o.request_id == "long":
                    long_out += o.token_ids
            plan = worker.plans[-1]
            if _prefill_tokens(plan):
                chunks.append(_prefill_tokens(plan))
                # the stream's decode rides along in every step that carries a chunk
                assert any(d.seq_id == short.seq_id and d.num_scheduled_tokens == 1 for d in plan.running_seqs)
        assert long_out == reference_tokens(long_prompt, 3)
        assert short.token_ids[3:] == reference_tokens([1, 2, 3], 90)
        assert_all_free(engine)
        results[pacing] = chunks
    # unpaced: the budget minus the decode, three times, then the rest
    assert results[0] == [63, 63, 63, 11]
    # paced over 8 steps: an eighth of what is left, rounded up, and never less than 16
    expected, left = [], 200
    while left:
        expected.append(min(left, max(16, -(-left // 8))))
        left -= expected[-1]
    assert results[8] == expected
    assert expected[:3] == [25, 22, 20] and max(expected) < 63


def test_prefill_pacing_gives_the_whole_budget_when_nothing_decodes():
    engine, worker = make_engine(num_blocks=256, block_size=4, budget=64, pacing=8)
    prompts = make_prompts(3, seed=6, lengths=[100, 40, 30])
    outs, _ = run_all(engine, prompts, SamplingParams(temperature=0, max_tokens=4))
    assert outs == [reference_tokens(p, 4) for p in prompts]
    # no stream to protect: the first two steps are full prompt steps, as without pacing
    assert [p.num_scheduled_tokens for p in worker.plans[:2]] == [64, 64]
    assert_all_free(engine)


def test_prefill_pacing_share_grows_with_the_backlog():
    engine, worker = make_engine(num_blocks=512, block_size=4, budget=128, pacing=8)
    engine.add_request("stream", prompt_token_ids=[5, 6], sampling=SamplingParams(temperature=0, max_tokens=40))
    engine.step()
    prompts = make_prompts(12, seed=7, lengths=[40] * 12)
    for i, p in enumerate(prompts):
        engine.add_request(f"q{i}", prompt_token_ids=p, sampling=SamplingParams(temperature=0, max_tokens=2))
    engine.step()
    # 480 prompt tokens waiting: an eighth is 60, more than the 16 a small backlog gets
    assert _prefill_tokens(worker.plans[-1]) == 60
    engine.step()
    assert _prefill_tokens(worker.plans[-1]) == 53  # ceil(420 / 8)
    while engine.has_unfinished():
        engine.step()
    assert_all_free(engine)


@pytest.mark.parametrize("num_blocks", [14, 200])
def test_prefill_pacing_with_overlap_keeps_outputs_exact(num_blocks):
    """Requests arriving every third step while others decode, two plans in flight, paced and not,
    with preemption (14 blocks) and without: the reference tokens, and every block comes back."""
    rng = random.Random(num_blocks)
    prompts = make_prompts(10, seed=8, lengths=[rng.randint(1, 40) for _ in range(10)])  # + output < 56 slots
    requests = [(p, SamplingParams(temperature=0, max_tokens=6 + i)) for i, p in enumerate(prompts)]
    schedules = {}
    for pacing in (0, 4):
        engine, worker = make_engine(num_blocks=num_blocks, block_size=4, budget=32, pacing=pacing)
        link = LaggingLink(worker)
        got = {}
        arrivals = list(enumerate(requests))
        steps = 0
        while arrivals or engine.has_unfinished() or engine.num_in_flight:
            if arrivals and steps % 3 == 0:
                i, (p, sp) = arrivals.pop(0)
                engine.add_request(f"r{i}", prompt_token_ids=p, sampling=sp)
                got[f"r{i}"] = []
            for o in engine.pipeline_step(link, 2):
                got[o.request_id].extend(o.token_ids)
            engine.allocator.check_integrity()
            steps += 1
            assert steps < 2_000
        for i, (p, sp) in enumerate(requests):
            assert got[f"r{i}"] == reference_tokens(p, sp.max_tokens)
        if num_blocks == 14:
            assert engine.scheduler.num_preemptions > 0
        assert_all_free(engine)
        schedules[pacing] = [_prefill_tokens(plan) for plan in worker.plans]
    # pacing changed the schedule: prompt work spread over more steps (with preemption, a
    # recompute while nothing decodes still takes the whole budget)
    assert sum(1 for n in schedules[4] if n) > sum(1 for n in schedules[0] if n)
    if num_blocks == 200:
        assert max(schedules[4]) < max(schedules[0])


def test_prefill_pacing_must_not_be_negative():
    with pytest.raises(ValueError, match="prefill_pacing_steps"):
        SchedulerConfig(max_model_len=64, prefill_pacing_steps=-1)


# ---- one plan in flight (overlap) ---------------------------------------------------------


def run_pipelined(engine, link, max_in_flight, requests, abort_after=None):
    """requests: list of (prompt, params). Returns {request_id: (tokens, final output)}."""
    got, finals = {}, {}
    for i, (p, sp) in enumerate(requests):
        engine.add_request(f"r{i}", prompt_token_ids=p, sampling=sp)
        got[f"r{i}"] = []
    steps = 0
    while engine.has_unfinished() or engine.num_in_flight:
        for o in engine.pipeline_step(link, max_in_flight):
            got[o.request_id].extend(o.token_ids)
            if o.finished:
                finals[o.request_id] = o
        engine.allocator.check_integrity()
        steps += 1
        if abort_after and steps in abort_after:
            for rid in abort_after[steps]:
                engine.abort(rid)
        assert steps < 10_000
    return got, finals, steps


@pytest.mark.parametrize("prefix", [True, False])
def test_overlap_gives_identical_outputs_and_balanced_blocks(prefix):
    prompts = make_prompts(12, seed=21, lengths=[1, 3, 8, 16, 17, 30, 45, 64, 5, 9, 12, 70])
    ref = [reference_tokens(p, 20) for p in prompts]
    stop_at = ref[3][6]
    requests = [
        (p, SamplingParams(temperature=0, max_tokens=5 + i, stop_token_ids=[stop_at] if i == 3 else []))
        for i, p in enumerate(prompts)
    ]
    results = {}
    for depth in (1, 2, 3):
        engine, worker = make_engine(num_blocks=40, block_size=4, budget=24, prefix=prefix)
        link = LaggingLink(worker)
        got, finals, steps = run_pipelined(engine, link, depth, requests)
        assert_all_free(engine)
        results[depth] = (got, {k: (v.finish_reason, v.usage) for k, v in finals.items()}, link.num_sampled)
    assert results[1][0] == results[2][0] == results[3][0]
    assert results[1][1] == results[2][1] == results[3][1]
    for i, p in enumerate(prompts):
        expected = reference_tokens(p, 5 + i)
        if i == 3:
            expected = expected[: expected.index(stop_at) + 1]
        assert results[2][0][f"r{i}"] == expected
    delivered = sum(len(t) for t in results[2][0].values())
    assert results[1][2] == delivered  # without overlap nothing is computed in vain
    # with overlap, max_tokens is foreseen; only the stop-token request costs discarded tokens, up
    # to one per plan in flight past the first: its stop comes one token before its max_tokens,
    # so one here, however many plans are in flight
    assert results[2][2] == delivered + 1
    assert results[3][2] == delivered + 1


@pytest.mark.parametrize("depth", [2, 3])
def test_overlap_preemption_and_aborts(depth):
    prompts = make_prompts(8, seed=4, lengths=[9, 14, 5, 20, 11, 7, 3, 16])
    requests = [(p, SamplingParams(temperature=0, max_tokens=18)) for p in prompts]
    engine, worker = make_engine(num_blocks=14, block_size=4, budget=16, prefix=True)
    got, finals, _ = run_pipelined(engine, LaggingLink(worker), depth, requests, abort_after={6: ["r2"], 9: ["r5"]})
    assert engine.scheduler.num_preemptions > 0
    for i, p in enumerate(prompts):
        if i in (2, 5):
            assert f"r{i}" not in finals
            assert got[f"r{i}"] == reference_tokens(p, 18)[: len(got[f"r{i}"])]
        else:
            assert got[f"r{i}"] == reference_tokens(p, 18)
    assert_all_free(engine)
    # the worker was told to drop every sequence it was given
    dropped = {sid for plan in worker.plans for sid in plan.finished_seq_ids}
    assert not set(worker.seqs) - dropped or not worker.seqs


@pytest.mark.parametrize("interval", [2, 5, 64])
def test_stream_interval_groups_deltas_without_changing_outputs(smollm2_dir, interval):
    """OutputProcessor applies stream_interval to the engine's token deltas: the first token goes
    out alone, then one delta per `interval` tokens, and the last delta at the end. Tokens, text,
    stop strings, stop tokens and finish reasons are what interval 1 gives, token for token and
    character for character; a stop string ends the request in the engine."""
    from scheduler_svc.api.text_stream import OutputProcessor
    from scheduler_svc.api.tokenizer import Tokenizer
    from scheduler_svc.core.delivery import ApiClient, deliver
    from scheduler_svc.core.engine import run_step

    tok = Tokenizer(smollm2_dir)  # the fake worker's token ids (< 1000) are all in its vocabulary
    prompts = make_prompts(4, seed=21, lengths=[6, 9, 13, 30])
    ref = [reference_tokens(p, 60) for p in prompts]
    text1 = tok.decode(ref[1][:40])
    stop = text1[len(tok.decode(ref[1][:25])) :][:3]  # a stop string that first appears mid-stream
    params = [
        SamplingParams(temperature=0, max_tokens=23, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]),
        SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[ref[2][10]]),
        SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
    ]

    def run(stream_interval):
        # the path of a served request: the engine's steps become CoreOutputs for one API server
        # (deliver), and those become text deltas (OutputProcessor)
        engine, _ = make_engine(num_blocks=256, budget=32)
        sent = []
        client = ApiClient(0, send=sent.append)
        processor = OutputProcessor(tok, stream_interval)
        for i, (p, sp) in enumerate(zip(prompts, params)):
            engine.add_request(f"r{i}", prompt_token_ids=p, sampling=sp)
            client.request_ids.add(engine.ids[f"r{i}"])
            processor.add(engine.ids[f"r{i}"], f"r{i}", p, sp)
        deltas = {f"r{i}": [] for i in range(len(prompts))}
        while engine.has_unfinished():
            step = run_step(engine.engine, engine.link, 1)
            deliver(step, {0: client})
            for outputs in sent:
                ready, stopped = processor.apply(outputs)
                for request_id in stopped:
                    assert engine.engine.finish(request_id)
                    client.request_ids.discard(request_id)
                for _, o in ready:
                    deltas[o.request_id].append(o)
            sent.clear()
        engine.drain()
        assert_all_free(engine)
        assert not processor.streams
        return [deltas[f"r{i}"] for i in range(len(prompts))], engine

    (base, _), (grouped, engine) = run(1), run(interval)
    for one, many in zip(base, grouped):
        assert [t for d in many for t in d.token_ids] == [t for d in one for t in d.token_ids]
        assert "".join(d.text for d in many) == "".join(d.text for d in one)
        assert many[-1].finish_reason is one[-1].finish_reason and many[-1].usage == one[-1].usage
        assert all(not d.finished for d in many[:-1])
        sizes = [len(d.token_ids) for d in many]
        assert sizes[0] == 1  # time to first token is not delayed
        assert all(n == interval for n in sizes[1:-1]) and 1 <= sizes[-1] <= max(interval, 1)
    stopped = "".join(d.text for d in grouped[1])
    assert grouped[1][-1].finish_reason is FinishReason.STOP and stop not in stopped
    n_stopped = len([t for d in grouped[1] for t in d.token_ids])
    assert n_stopped < 40  # ended at the stop string
    assert grouped[1][-1].usage.completion_tokens == n_stopped
    assert grouped[2][-1].finish_reason is FinishReason.STOP
    # the stop string counts as a finished request, not an aborted one
    assert engine.num_finished == 4 and engine.num_aborted == 0
