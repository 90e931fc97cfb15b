"""NullRunner: follows step plans like ModelRunner without model math, rejects the same bad plans,
and serves through the real scheduler over gRPC."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from pagewire_common.plan import NewSequence, RunningSequence, StepPlan
from pagewire_common.sampling import SamplingParams
from worker_svc.null_runner import DEFAULT_NULL_KV_BLOCKS, NullRunner
from worker_svc.runner import ModelRunner, RunnerConfig

BLOCK_SIZE = 4
NUM_BLOCKS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama-gqa")


@pytest.fixture()
def runner(model_dir):
    return NullRunner(model_dir, RunnerConfig(block_size=BLOCK_SIZE, num_kv_blocks=NUM_BLOCKS))


@pytest.fixture(scope="module")
def real_runner(model_dir):
    return ModelRunner(model_dir, RunnerConfig(block_size=BLOCK_SIZE, num_kv_blocks=NUM_BLOCKS, device="cpu"))


def cycle_token(runner: NullRunner, position: int) -> int:
    """The token the null runner emits at ``position`` (0-based index in the sequence)."""
    return runner.token_cycle[position % len(runner.token_cycle)]


def new_seq(seq_id, token_ids, block_ids, num_scheduled, num_computed=0) -> NewSequence:
    return NewSequence(seq_id, list(token_ids), list(block_ids), num_computed, num_scheduled, GREEDY)


def test_interface_matches_what_the_worker_server_uses(runner, model_dir, real_runner):
    from worker_svc.dtypes import dtype_name
    from worker_svc.server import WorkerServicer

    info = WorkerServicer(runner, "tiny", tuple(runner.model_config.eos_token_ids)).info_response()
    assert info.model_type == "llama"
    assert (info.block_size, info.num_kv_blocks) == (BLOCK_SIZE, NUM_BLOCKS)
    assert info.max_model_len == 256
    # "auto" resolves as the real worker's does on this host (bfloat16 on a CPU with native bf16)
    assert (info.dtype, info.device) == (dtype_name(real_runner.dtype), "null")
    for dtype in ("float32", "bfloat16"):
        assert NullRunner(model_dir, RunnerConfig(block_size=BLOCK_SIZE, num_kv_blocks=NUM_BLOCKS, dtype=dtype)).dtype == dtype
    assert b"<|im_end|>" in info.tokenizer_files["tokenizer.json"]
    assert runner.model_dir == model_dir and runner.num_seqs == 0
    default = NullRunner(model_dir)
    assert default.num_kv_blocks == DEFAULT_NULL_KV_BLOCKS


def test_kv_cache_memory_sizes_blocks_like_the_real_runner(model_dir, real_runner):
    budget = 1 << 20
    null = NullRunner(model_dir, RunnerConfig(block_size=BLOCK_SIZE, kv_cache_bytes=budget))
    real = ModelRunner(model_dir, RunnerConfig(block_size=BLOCK_SIZE, kv_cache_bytes=budget, device="cpu"))
    assert null.num_kv_blocks == real.num_kv_blocks


def test_token_cycle_is_ordinary_and_positional(runner):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(runner.model_dir / "tokenizer.json"))
    special = {tid for tid, t in tok.get_added_tokens_decoder().items() if t.special}
    assert len(runner.token_cycle) > 1
    assert not set(runner.token_cycle) & (special | set(runner.model_config.eos_token_ids))
    # the token at position p is cycle[p % len(cycle)], whatever the sequence's tokens
    cycle = runner.token_cycle
    prompts = {1: [3], 2: [9, 9], 3: [4] * len(cycle)}
    blocks = {1: [0], 2: [1], 3: list(range(2, 2 + -(-len(cycle) // BLOCK_SIZE)))}
    r = runner.execute(StepPlan(1, new_seqs=[new_seq(i, prompts[i], blocks[i], len(prompts[i])) for i in prompts]))
    assert (r.seq_ids, r.token_ids) == ([1, 2, 3], [cycle[1], cycle[2], cycle[0]])


def test_follows_chunked_prefill_decode_rollover_and_finish(runner):
    prompt = [5, 6, 7, 8, 9, 10]
    # chunk 1: 4 of 6 prompt tokens, nothing sampled
    r = runner.execute(StepPlan(1, new_seqs=[new_seq(1, prompt, [0, 1], num_scheduled=4)]))
    assert (r.seq_ids, r.token_ids) == ([], [])
    # chunk 2 reaches the end of the prompt: one token, for position 6
    r = runner.execute(StepPlan(2, running_seqs=[RunningSequence(1, 2)]))
    assert (r.seq_ids, r.token_ids) == ([1], [cycle_token(runner, 6)])
    # decodes compute positions 6 and 7 (the last slot of block 1) and sample positions 7 and 8
    r = runner.execute(StepPlan(3, running_seqs=[RunningSequence(1, 1)]))
    assert r.token_ids == [cycle_token(runner, 7)]
    r = runner.execute(StepPlan(4, running_seqs=[RunningSequence(1, 1)]))
    assert r.token_ids == [cycle_token(runner, 8)]
    # computing position 8 needs a third block: without it the plan is rejected...
    with pytest.raises(ValueError, match="too few blocks"):
        runner.execute(StepPlan(5, running_seqs=[RunningSequence(1, 1)]))
    runner.reset()
    assert runner.num_seqs == 0
    # ...with it (appended at index 2) the sequence goes on; a second sequence joins the step
    sampled = [cycle_token(runner, 6), cycle_token(runner, 7)]
    runner.execute(StepPlan(1, new_seqs=[new_seq(1, prompt + sampled, [0, 1], 8)]))
    r = runner.execute(StepPlan(
        2,
        new_seqs=[new_seq(2, [11, 12, 13], [3], 3)],
        running_seqs=[RunningSequence(1, 1, block_table_start=2, block_ids=[2])],
    ))
    assert (r.seq_ids, r.token_ids) == ([2, 1], [cycle_token(runner, 3), cycle_token(runner, 9)])
    # copy-on-write replaces the last block; finished sequences are dropped first
    r = runner.execute(StepPlan(3, running_seqs=[RunningSequence(2, 1, block_table_start=0, block_ids=[4])],
                                finished_seq_ids=[1], block_copies=[(3, 4)]))
    assert (r.seq_ids, r.token_ids) == ([2], [cycle_token(runner, 4)])
    assert runner.num_seqs == 1 and runner.num_block_copies == 1
    assert runner.execute(StepPlan(4, finished_seq_ids=[2])).token_ids == []
    assert runner.num_seqs == 0


def test_prefix_cache_hit_starts_from_computed_tokens(runner):
    r = runner.execute(StepPlan(1, new_seqs=[new_seq(7, [1, 2, 3, 4, 5], [9, 10], num_scheduled=1, num_computed=4)]))
    assert (r.seq_ids, r.token_ids) == ([7], [cycle_token(runner, 5)])


BAD_PLANS = {
    "unknown running sequence": (
        [], StepPlan(1, running_seqs=[RunningSequence(99, 1)]), KeyError, "not known"),
    "scheduled past the known tokens": (
        [], StepPlan(1, new_seqs=[new_seq(1, [5, 6, 7], [0], num_scheduled=4)]), ValueError, "past the known tokens"),
    "too few blocks": (
        [], StepPlan(1, new_seqs=[new_seq(1, [5, 6, 7, 8, 9], [0], num_scheduled=5)]), ValueError, "too few blocks"),
    "decode past the sampled token": (
        [StepPlan(1, new_seqs=[new_seq(1, [5, 6], [0], num_scheduled=2)])],
        StepPlan(2, running_seqs=[RunningSequence(1, 2)]), ValueError, "past the known tokens"),
    "new sequence already known": (
        [StepPlan(1, new_seqs=[new_seq(1, [5, 6], [0], num_scheduled=2)])],
        StepPlan(2, new_seqs=[new_seq(1, [5, 6], [1], num_scheduled=2)]), ValueError, "already known"),
    "gap in the block table": (
        [StepPlan(1, new_seqs=[new_seq(1, [5, 6], [0], num_scheduled=2)])],
        StepPlan(2, running_seqs=[RunningSequence(1, 1, block_table_start=2, block_ids=[3])]), ValueError,
        "leaves a gap"),
    "more blocks than the model length": (  # 256 tokens / 4 per block = 64 blocks at most
        [], StepPlan(1, new_seqs=[new_seq(1, [5, 6], list(range(65)), num_scheduled=2)]), ValueError,
        "at most 64 fit"),
    "finished then running": (
        [StepPlan(1, new_seqs=[new_seq(1, [5, 6], [0], num_scheduled=2)])],
        StepPlan(2, running_seqs=[RunningSequence(1, 1)], finished_seq_ids=[1]), KeyError, "not known"),
    "negative block table start": (
        [StepPlan(1, new_seqs=[new_seq(1, [5, 6], [0], num_scheduled=2)])],
        StepPlan(2, running_seqs=[RunningSequence(1, 1, block_table_start=-1, block_ids=[3])]), ValueError,
        "edit at -1 leaves a gap after 1 blocks"),
    "running edit past the model length": (
        [StepPlan(1, new_seqs=[new_seq(1, [5, 6], [0], num_scheduled=2)])],
        StepPlan(2, running_seqs=[RunningSequence(1, 1, block_table_start=1, block_ids=[1] * 64)]), ValueError,
        "needs 65 blocks; at most 64 fit"),
    "new sequence block id outside the cache": (
        [], StepPlan(1, new_seqs=[new_seq(1, [5, 6], [0, NUM_BLOCKS], num_scheduled=2)]), ValueError,
        f"block id {NUM_BLOCKS} is outside the cache"),
    "negative block id": (
        [], StepPlan(1, new_seqs=[new_seq(1, [5, 6], [-1], num_scheduled=2)]), ValueError,
        "block id -1 is outside the cache"),
    "running edit block id outside the cache": (
        [StepPlan(1, new_seqs=[new_seq(1, [5, 6], [0], num_scheduled=2)])],
        StepPlan(2, running_seqs=[RunningSequence(1, 1, block_table_start=1, block_ids=[NUM_BLOCKS + 5])]),
        ValueError, "outside the cache"),
    "block copy outside the cache": (
        [], StepPlan(1, new_seqs=[new_seq(1, [5, 6], [0], 2)], block_copies=[(0, -1)]), ValueError,
        "block id -1 is outside the cache"),
    "computed tokens beyond the known ones": (
        [], StepPlan(1, new_seqs=[new_seq(1, [5, 6], [0], num_scheduled=1, num_computed=3)]), ValueError,
        "3 computed tokens out of 2"),
    "negative computed tokens": (
        [], StepPlan(1, new_seqs=[new_seq(1, [5, 6], [0], num_scheduled=1, num_computed=-1)]), ValueError,
        "-1 computed tokens out of 2"),
    "one bad sequence among good ones": (
        [StepPlan(1, new_seqs=[new_seq(1, [5, 6], [0], num_scheduled=2)])],
        StepPlan(2, new_seqs=[new_seq(2, [7, 8, 9], [1], num_scheduled=3)],
                 running_seqs=[RunningSequence(1, 2, block_table_start=1, block_ids=[2])]),
        ValueError, "past the known tokens"),
}


@pytest.mark.parametrize("case", list(BAD_PLANS))
def test_rejects_bad_plans_like_the_real_runner(case, runner, real_runner):
    """Both runners apply and check plans with the same code (plan_state.SequenceStates): the
    same exception type and message, and nothing half-computed left behind."""
    setup, bad, error, message = BAD_PLANS[case]
    raised = []
    for r in (runner, real_runner):
        r.reset()
        for plan in setup:
            r.execute(plan)
        computed = {seq_id: r.seqs.get(seq_id).num_computed_tokens for seq_id in (1, 2) if seq_id in r.seqs}
        computed.update({s.seq_id: s.num_computed_tokens for s in bad.new_seqs if s.seq_id not in computed})
        with pytest.raises(error, match=message) as info:
            r.execute(bad)
        raised.append((type(info.value), str(info.value)))
        # a step rejected before its compute leaves every computed count as it was
        for seq_id, n in computed.items():
            if seq_id in r.seqs:
                assert r.seqs.get(seq_id).num_computed_tokens == n
        r.reset()
        assert r.num_seqs == 0
    assert raised[0] == raised[1]


def test_a_rejected_new_sequence_takes_no_block_table_row(runner, real_runner):
    for r in (runner, real_runner):
        r.reset()
        tables = r.seqs.tables
        free = len(tables._free_rows)
        with pytest.raises(ValueError, match="at most 64 fit"):
            r.execute(StepPlan(1, new_seqs=[new_seq(1, [5, 6], [0] * 65, num_scheduled=2)]))
        assert len(tables._free_rows) == free and 1 not in r.seqs


# ---- through the real scheduler over gRPC ---------------------------------------------------------


@pytest.mark.slow
def test_serves_through_the_real_scheduler(model_dir, tmp_path):
    from pagewire_common.v1 import generation_pb2 as pb
    from tests.service_utils import sampling, start_scheduler, start_worker, stub, wait_until

    cycle = NullRunner(model_dir).token_cycle
    worker, worker_addr = start_worker(model_dir, tmp_path, extra=["--worker", "null", "--block-size", "4"])
    scheduler = None
    try:
        scheduler, addr = start_scheduler(worker_addr, tmp_path, extra=["--max-num-seqs", "8"])
        client = stub(addr)
        info = client.GetModelInfo(pb.ModelInfoRequest())
        assert (info.device, info.block_size, info.num_kv_blocks) == ("null", 4, DEFAULT_NULL_KV_BLOCKS)

        def run(prompt_ids):
            req = pb.GenerateRequest(prompt_token_ids=prompt_ids, sampling=sampling(max_tokens=20, ignore_eos=True))
            ids, last = [], None
            for resp in client.Generate(req):
                ids += list(resp.token_ids)
                last = resp
            return ids, last

        prompts = [[3 + (i * 7 + j) % 200 for j in range(1 + 5 * i)] for i in range(16)]
        with ThreadPoolExecutor(16) as pool:
            outputs = list(pool.map(run, prompts))
        for prompt, (ids, last) in zip(prompts, outputs):
            n = len(prompt)
            assert ids == [cycle[(n + k) % len(cycle)] for k in range(20)]
            assert last.finish_reason == pb.LENGTH
            assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (n, 20)
        # text prompts go through the tokenizer read from the model directory
        text = "".join(r.text for r in client.Generate(pb.GenerateRequest(
            prompt="The lighthouse keeper", sampling=sampling(max_tokens=6, ignore_eos=True))))
        assert text
        # logprobs asked of the null worker: its tokens are certain; a top list is the token, then others
        # (a request asking for them once crashed the core's delivery, failing every stream)
        params = sampling(max_tokens=5, ignore_eos=True, logprobs=True)
        params.top_logprobs = 3
        responses = list(client.Generate(pb.GenerateRequest(prompt_token_ids=[5, 6, 7], sampling=params)))
        ids = [t for r in responses for t in r.token_ids]
        assert [lp for r in responses for lp in r.logprobs] == [0.0] * 5
        tops = [top for r in responses for top in r.top_logprobs]
        assert [list(top.token_ids)[0] for top in tops] == ids and all(len(set(top.token_ids)) == 3 for top in tops)
        assert all(list(top.logprobs) == [0.0, -1e4, -1e4] for top in tops)
        stats = wait_until(lambda: (s := client.GetStats(pb.StatsRequest())).num_running == 0 and s)
        assert stats.num_free_blocks == stats.num_total_blocks
        assert stats.num_requests_finished == 18
    finally:
        if scheduler is not None:
            scheduler.stop()
        worker.stop()


def test_constrained_sequences_follow_their_grammar(runner, model_dir):
    """The cycle's token where the grammar allows it, else EOS where allowed, else an allowed one."""
    import json
    import re

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    eos = set(runner.model_config.eos_token_ids)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    params = [SamplingParams(max_tokens=30, json_schema=schema),
              SamplingParams(max_tokens=30, regex="[a-z]{2,5}-[0-9]{1,3}"),
              SamplingParams(max_tokens=30, regex="[a-z ]+", ignore_eos=True)]
    prompt = [5, 6, 7]
    r = runner.execute(StepPlan(0, new_seqs=[NewSequence(i, prompt, list(range(8 * i, 8 * i + 8)), 0, 3, sp)
                                             for i, sp in enumerate(params)]))
    out = {i: [t] for i, t in zip(r.seq_ids, r.token_ids)}
    for step in range(1, 26):
        r = runner.execute(StepPlan(step, running_seqs=[RunningSequence(i, 1) for i in out]))
        for i, t in zip(r.seq_ids, r.token_ids):
            out[i].append(t)
    for i in (0, 1):
        end = next(j for j, t in enumerate(out[i]) if t in eos)
        assert set(out[i][end:]) <= eos  # a complete grammar allows only EOS
        text = tok.decode(out[i][:end])
        assert json.loads(text) in ({"ok": True}, {"ok": False}) if i == 0 else re.fullmatch(params[1].regex, text)
    # every cycle token is a lowercase word or a space: the grammar lets the cycle through, never EOS
    assert out[2] == [cycle_token(runner, p) for p in range(3, 3 + 26)]
    assert re.fullmatch("[a-z ]+", tok.decode(out[2]))
    runner.execute(StepPlan(26, finished_seq_ids=[0, 1, 2]))
    assert runner.grammars.num_active == 0
