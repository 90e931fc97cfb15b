"""Tensor parallelism on CPU with gloo, two ranks: greedy parity with transformers through the
offline API and over gRPC (chunked prefill, rollover, prefix hits, preemption, overlap), and a
rank that dies taking the worker down cleanly."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from pagewire import LLM, SamplingParams
from pagewire_common.v1 import generation_pb2 as pb
from tests.service_utils import Proc, descendants, free_port, sampling, stub, wait_until
from tests.test_parity import assert_all_free, hf_greedy
from tests.tiny_models import sample_prompts
from worker_svc.config import ModelConfig

pytestmark = pytest.mark.slow

TP_KINDS = ("gpt2", "llama-gqa", "qwen3")  # GPT-2, Llama with GQA (KV heads split), Qwen3 (one KV head: replicated)
MAX_TOKENS = 24
# 24 blocks of 4 tokens for a batch that needs several times that: rollover, chunked prefill
# (32-token budget) and preemption all happen
ENGINE = dict(block_size=4, max_num_batched_tokens=32, num_kv_blocks=24)


def expected_tokens(model_dir, prompts, max_tokens=MAX_TOKENS) -> list[list[int]]:
    eos = set(ModelConfig.from_pretrained(model_dir).eos_token_ids)
    return [hf_greedy(model_dir, p, max_tokens, eos)[0] for p in prompts]


def short_prompts(model_dir) -> list[list[int]]:
    return [p for p in sample_prompts(model_dir, n=10) if len(p) <= 60][:8]


@pytest.fixture
def keep_threads():
    """LLM(tensor_parallel_size=2) gives this process its share of the cores: restore it after."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("kind", TP_KINDS)
def test_offline_two_ranks_match_transformers(kind, tiny_model_dir, keep_threads):
    model_dir = tiny_model_dir(kind)
    prompts = short_prompts(model_dir)
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    with LLM(model_dir, tensor_parallel_size=2, **ENGINE) as llm:
        runner = llm.runner
        mc = runner.model_config
        assert runner.tp.size == 2 and len(runner.local_ranks.procs) == 1
        # each rank's cache holds its KV heads: split, or one replica each when there are fewer heads than ranks
        assert runner.kv_cache.num_kv_heads == max(1, mc.num_kv_heads // 2)
        outs = llm.generate(prompts, sp)
        assert llm.engine.scheduler.num_preemptions > 0
        assert max(map(len, prompts)) > ENGINE["max_num_batched_tokens"]  # chunked prefill
        assert [o.token_ids for o in outs] == expected_tokens(model_dir, prompts)
        # prefix hits: the same prompt again reuses its full blocks on every rank
        prompt = prompts[-1]
        first = llm.generate([prompt], sp)[0]
        second = llm.generate([prompt], sp)[0]
        assert second.num_cached_tokens == min((len(prompt) // 4) * 4, len(prompt) - 1) > 0
        assert second.token_ids == first.token_ids == outs[-1].token_ids
        assert_all_free(llm)
        procs = list(runner.local_ranks.procs)
    assert [p.returncode for p in procs] == [0]  # told to stop, and stopped


def test_sampling_controls_and_n_samples_on_two_ranks_match_one_rank(tiny_model_dir, keep_threads):
    """Only rank 0 samples: penalties, bias, min_tokens, top logprobs, n samples (forked blocks) and
    grammar masks see the gathered logits as one rank sees its own."""
    from tests.test_structured_output import REGEX, SCHEMA

    model_dir = tiny_model_dir("llama-gqa")
    prompts = short_prompts(model_dir)[2:6]
    sp = SamplingParams(temperature=0, max_tokens=16, repetition_penalty=1.3, presence_penalty=0.5,
                        frequency_penalty=0.2, logit_bias={7: 2.0}, min_tokens=4, top_logprobs=3, logprobs=True)
    samples = SamplingParams(temperature=1.0, seed=11, n=3, max_tokens=12, ignore_eos=True)
    constrained = [SamplingParams(temperature=1.0, seed=20 + i, max_tokens=60,
                                  **(dict(json_schema=SCHEMA) if i % 2 else dict(regex=REGEX))) for i in range(4)]
    one = LLM(model_dir, **ENGINE)
    expected = one.generate(prompts, sp)
    expected_samples = one.generate(prompts[:1], samples)[0].samples
    expected_constrained = one.generate(prompts, constrained)
    with LLM(model_dir, tensor_parallel_size=2, **ENGINE) as llm:
        got = llm.generate(prompts, sp)
        got_samples = llm.generate(prompts[:1], samples)[0].samples
        got_constrained = llm.generate(prompts, constrained)
    assert [o.token_ids for o in got_constrained] == [o.token_ids for o in expected_constrained]
    assert {o.finish_reason for o in got_constrained} == {"stop"}
    for e, g in zip(expected, got):
        assert g.token_ids == e.token_ids
        assert g.logprobs == pytest.approx(e.logprobs, abs=1e-4)
        assert [ids for ids, _ in g.top_logprobs] == [ids for ids, _ in e.top_logprobs]
        assert [lp for _, lps in g.top_logprobs for lp in lps] == pytest.approx(
            [lp for _, lps in e.top_logprobs for lp in lps], abs=1e-4)
    assert [o.token_ids for o in got_samples] == [o.token_ids for o in expected_samples]
    assert len(got_samples) == 3 and len({tuple(o.token_ids) for o in got_samples}) > 1  # different samples


def test_one_rank_runs_no_collectives(tiny_model_dir):
    import torch.distributed as dist

    from worker_svc.runner import ModelRunner

    llm = LLM(tiny_model_dir("qwen3"), **ENGINE)
    assert type(llm.runner) is ModelRunner and llm.runner.tp.size == 1
    assert not dist.is_initialized()
    prompts = short_prompts(tiny_model_dir("qwen3"))[:4]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    assert [o.token_ids for o in outs] == expected_tokens(tiny_model_dir("qwen3"), prompts)


def test_heads_that_do_not_split_are_one_error_before_any_rank_starts(tiny_model_dir, tmp_path):
    """4 query heads over 3 ranks, or --quantization int8 over 2: offline a ValueError before any
    rank process starts; through serve one line and exit code 2, not ranks that fail apart."""
    import subprocess
    import sys

    model_dir = tiny_model_dir("llama-gqa")
    assert ModelConfig.from_pretrained(model_dir).num_heads == 4
    before = set(descendants(os.getpid()))
    for settings, message in (({"tensor_parallel_size": 3}, "the number of attention heads 4 does not split over 3"),
                              ({"tensor_parallel_size": 2, "quantization": "int8"},
                               "--quantization int8 runs on CPU with one rank")):
        with pytest.raises(ValueError, match=message):
            LLM(model_dir, **settings)
        assert set(descendants(os.getpid())) <= before
    argv = [sys.executable, "-m", "pagewire.cli", "serve", "--model", str(model_dir), "--tensor-parallel-size", "3",
            "--listen", f"127.0.0.1:{free_port()}", "--http-listen", "off"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("pagewire: error: the number of attention heads 4 does not split over 3") == 1
    assert "Traceback" not in done.stderr and "terminate called" not in done.stderr


# ---- over gRPC: pagewire serve --tensor-parallel-size 2 ----------------------------------------


def start_serve(model_dir, tmp_path, num_kv_blocks: int = ENGINE["num_kv_blocks"]) -> tuple[Proc, str]:
    port = free_port()
    argv = ["serve", "--model", str(model_dir), "--listen", f"127.0.0.1:{port}", "--tensor-parallel-size", "2",
            "--block-size", "4", "--max-num-batched-tokens", "32", "--num-kv-blocks", str(num_kv_blocks)]
    proc = Proc(argv, tmp_path / "serve.log")
    proc.wait_for_output("pagewire ready", timeout=180)
    return proc, f"127.0.0.1:{port}"


def generate(addr, prompt, max_tokens=MAX_TOKENS) -> list[int]:
    responses = stub(addr).Generate(pb.GenerateRequest(prompt_token_ids=prompt, sampling=sampling(max_tokens=max_tokens)))
    return [t for r in responses for t in r.token_ids]


def ranks_of(serve: Proc) -> dict[str, int]:
    found = {}
    for pid, argv in descendants(serve.proc.pid):
        if " worker --listen" in argv:
            found["rank 0"] = pid
        elif " worker --rank 1 " in argv:
            found["rank 1"] = pid
    return found


def is_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("kind", TP_KINDS)
def test_serve_two_ranks_match_transformers_with_overlap(kind, tiny_model_dir, tmp_path):
    """serve's core keeps one plan in flight ahead (overlap is its default): the decodes of plan
    N+1 take the ids sampled in step N, which rank 1 learns from plan N+1's hand-off."""
    model_dir = tiny_model_dir(kind)
    prompts = short_prompts(model_dir)
    expected = expected_tokens(model_dir, prompts)
    serve, addr = start_serve(model_dir, tmp_path)
    try:
        assert set(ranks_of(serve)) == {"rank 0", "rank 1"}
        with ThreadPoolExecutor(len(prompts)) as pool:  # all at once: one batch, preempting
            got = list(pool.map(lambda p: generate(addr, p), prompts))
        assert got == expected
        before = stub(addr).GetStats(pb.StatsRequest())
        assert before.num_preemptions > 0
        assert generate(addr, prompts[-1]) == expected[-1]
        cached = stub(addr).GetStats(pb.StatsRequest())
        assert generate(addr, prompts[-1]) == expected[-1]  # its blocks are cached now: a prefix hit
        after = stub(addr).GetStats(pb.StatsRequest())
        assert after.num_prefix_cache_hit_tokens - cached.num_prefix_cache_hit_tokens == (len(prompts[-1]) // 4) * 4
    finally:
        serve.stop(30)


def test_killing_a_rank_fails_calls_unavailable_and_leaves_no_process(tiny_model_dir, tmp_path):
    model_dir = tiny_model_dir("llama-gqa")
    serve, addr = start_serve(model_dir, tmp_path, num_kv_blocks=300)
    pids = []
    try:
        ranks = ranks_of(serve)
        pids = [pid for pid, _ in descendants(serve.proc.pid)]
        s = stub(addr)
        req = pb.GenerateRequest(prompt_token_ids=[5, 6, 7], sampling=sampling(max_tokens=200, ignore_eos=True))
        calls = [s.Generate(req) for _ in range(3)]
        for c in calls:
            next(c)
        t0 = time.monotonic()
        os.kill(ranks["rank 1"], signal.SIGKILL)
        for c in calls:
            with pytest.raises(grpc.RpcError) as err:
                list(c)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - t0 < 5
        # the whole group went down: rank 0 exited, serve starts a new group that serves
        wait_until(lambda: not is_alive(ranks["rank 0"]), timeout=15)
        assert "tensor-parallel rank 1 exited with code -9" in serve.output()

        def serves_again():
            try:
                return generate(addr, [5, 6, 7], 6)
            except grpc.RpcError:
                return None

        assert wait_until(serves_again, timeout=90, interval=0.5) == expected_tokens(model_dir, [[5, 6, 7]], 6)[0]
        new_ranks = ranks_of(serve)
        assert set(new_ranks) == {"rank 0", "rank 1"} and not set(new_ranks.values()) & set(ranks.values())
        pids += [pid for pid, _ in descendants(serve.proc.pid)]
        serve.signal(signal.SIGTERM)
        assert serve.proc.wait(60) == 0
        assert [pid for pid in pids if is_alive(pid)] == []
    finally:
        serve.kill()


def test_ranks_started_apart_join_at_the_store_address(tiny_model_dir, tmp_path):
    """--rank/--world-size/--distributed-init, as on several machines (here two processes on one)."""
    from tests.service_utils import start_scheduler

    model_dir = tiny_model_dir("qwen3")
    store = f"127.0.0.1:{free_port()}"
    common = ["--model", str(model_dir), "--world-size", "2", "--distributed-init", store, "--block-size", "4",
              "--num-kv-blocks", "64"]
    rank1 = Proc(["worker", "--rank", "1", *common], tmp_path / "rank1.log")
    port = free_port()
    rank0 = Proc(["worker", "--rank", "0", "--listen", f"127.0.0.1:{port}", *common], tmp_path / "rank0.log")
    sched = None
    try:
        rank0.wait_for_output("worker ready on", timeout=120)
        assert "2 tensor-parallel ranks" in rank0.output()
        assert descendants(rank0.proc.pid) == []  # it started no rank itself
        sched, addr = start_scheduler(f"127.0.0.1:{port}", tmp_path)
        assert generate(addr, [5, 6, 7], 8) == expected_tokens(model_dir, [[5, 6, 7]], 8)[0]
        sched.stop()
        sched = None
        assert rank0.stop() == 0
        assert rank1.proc.wait(15) == 0  # rank 0 told it to stop
        assert "tensor-parallel rank 1 stopping" in rank1.output()
    finally:
        for proc in (sched, rank0, rank1):
            if proc is not None:
                proc.kill()
