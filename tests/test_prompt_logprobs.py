"""Prompt logprobs (``SamplingParams.prompt_logprobs``) against transformers' own log-softmax over
the prompt (fp32): in one chunk and across chunk boundaries, k = 0 and k = 3, with the prefix cache
bypassed, with n > 1, and the checks on k."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagewire import LLM, SamplingParams
from pagewire_common.sampling import MAX_TOP_LOGPROBS
from tests.test_parity import hf_model
from tests.tiny_models import sample_prompts

KIND = "llama-gqa"


def hf_prompt_logprobs(model_dir, prompt: list[int]) -> torch.Tensor:
    """[P - 1, vocab]: row i is the distribution of prompt token i + 1 given tokens 0..i."""
    with torch.no_grad():
        logits = hf_model(str(model_dir))(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]


def assert_matches(model_dir, prompt, out, k):
    ref = hf_prompt_logprobs(model_dir, prompt)
    own = ref.gather(1, torch.tensor(prompt[1:]).unsqueeze(1)).squeeze(1)
    assert len(out.prompt_logprobs) == len(prompt) - 1
    np.testing.assert_allclose(out.prompt_logprobs, own.numpy(), atol=1e-4)
    if k == 0:
        assert out.prompt_top_logprobs is None
        return
    assert len(out.prompt_top_logprobs) == len(prompt) - 1
    ref_top, ref_ids = ref.topk(k, dim=-1)
    for i, (ids, lps) in enumerate(out.prompt_top_logprobs):
        np.testing.assert_allclose(lps, ref_top[i].numpy(), atol=1e-4)
        # near-ties may swap places: compare the ids where the logprobs are apart
        for j in range(k):
            if all(abs(lps[j] - lps[m]) > 1e-4 for m in range(k) if m != j):
                assert ids[j] == ref_ids[i, j].item(), f"entry {i}, rank {j}"


def long_prompt(model_dir) -> list[int]:
    prompts = sample_prompts(model_dir, n=10)
    return max(prompts, key=len)


@pytest.mark.parametrize("k", [0, 3])
def test_single_chunk_matches_transformers(k, tiny_model_dir):
    model_dir = tiny_model_dir(KIND)
    prompts = [p for p in sample_prompts(model_dir, n=6) if 1 < len(p) <= 60][:3]
    llm = LLM(model_dir, block_size=4, max_num_batched_tokens=256, num_kv_blocks=256)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=k))
    for prompt, out in zip(prompts, outs):
        assert_matches(model_dir, prompt, out, k)
    llm.allocator.check_integrity()


@pytest.mark.parametrize("k", [0, 3])
def test_chunked_prefill_matches_transformers(k, tiny_model_dir):
    model_dir = tiny_model_dir(KIND)
    prompt = long_prompt(model_dir)
    assert len(prompt) > 3 * 16
    # 16-token chunks of 4-token blocks: entries run across several chunk boundaries, and the
    # other request (no prompt logprobs) shares the steps
    llm = LLM(model_dir, block_size=4, max_num_batched_tokens=16, num_kv_blocks=256)
    other = sample_prompts(model_dir, n=3)[1]
    outs = llm.generate([prompt, other], [SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=k),
                                          SamplingParams(temperature=0, max_tokens=3)])
    assert_matches(model_dir, prompt, outs[0], k)
    assert outs[1].prompt_logprobs is None and outs[1].prompt_top_logprobs is None
    llm.allocator.check_integrity()


def test_repeated_prompt_bypasses_prefix_cache(tiny_model_dir):
    model_dir = tiny_model_dir(KIND)
    prompt = long_prompt(model_dir)
    llm = LLM(model_dir, block_size=4, max_num_batched_tokens=32, num_kv_blocks=256)
    params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2)
    first = llm.generate([prompt], params)[0]
    second = llm.generate([prompt], params)[0]
    assert second.num_cached_tokens == 0  # computed again, not served from the cache
    assert second.prompt_logprobs == pytest.approx(first.prompt_logprobs, abs=1e-5)
    assert second.token_ids == first.token_ids
    assert_matches(model_dir, prompt, second, 2)
    # its blocks were cached all the same: a request without prompt logprobs hits them
    plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4))[0]
    assert plain.num_cached_tokens == min(len(prompt) // 4 * 4, len(prompt) - 1)  # all full blocks
    assert plain.token_ids == first.token_ids
    llm.allocator.check_integrity()


def test_n_samples_get_them_on_sample_0(tiny_model_dir):
    model_dir = tiny_model_dir(KIND)
    prompt = sample_prompts(model_dir, n=4)[2]
    llm = LLM(model_dir, block_size=4, max_num_batched_tokens=32, num_kv_blocks=256)
    out = llm.generate([prompt], SamplingParams(temperature=1.0, seed=7, n=3, max_tokens=3, prompt_logprobs=1))[0]
    assert [s.index for s in out.samples] == [0, 1, 2]
    assert_matches(model_dir, prompt, out.samples[0], 1)
    assert all(s.prompt_logprobs is None for s in out.samples[1:])


def test_one_token_prompt_has_no_entries(tiny_model_dir):
    model_dir = tiny_model_dir(KIND)
    llm = LLM(model_dir, block_size=4, num_kv_blocks=64)
    out = llm.generate([[5]], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3))[0]
    assert out.prompt_logprobs == [] and out.prompt_top_logprobs == []


@pytest.mark.parametrize("k", [-1, MAX_TOP_LOGPROBS + 1, 1.5, True])
def test_out_of_range_is_value_error(k):
    with pytest.raises(ValueError, match=r"prompt_logprobs must be an integer in \[0, 20\]"):
        SamplingParams(prompt_logprobs=k)


def test_wire_round_trip():
    from pagewire_common import wire

    for k in (None, 0, 5):
        assert wire.sampling_from_pb(wire.sampling_to_pb(SamplingParams(prompt_logprobs=k))).prompt_logprobs == k


def test_preempted_prompts_still_match(tiny_model_dir):
    """24 blocks of 4 tokens for prompts that need several times that: sequences are preempted
    (some mid-prompt) and computed again; every entry is still transformers'."""
    model_dir = tiny_model_dir(KIND)
    prompts = [p for p in sample_prompts(model_dir, n=10) if 1 < len(p) <= 60][:6]
    llm = LLM(model_dir, block_size=4, max_num_batched_tokens=32, num_kv_blocks=24)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, prompt_logprobs=2))
    assert llm.engine.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        assert_matches(model_dir, prompt, out, 2)
    llm.allocator.check_integrity()


@pytest.mark.slow
def test_two_ranks_match_transformers(tiny_model_dir):
    model_dir = tiny_model_dir(KIND)
    prompt = long_prompt(model_dir)
    threads = torch.get_num_threads()
    try:
        with LLM(model_dir, tensor_parallel_size=2, block_size=4, max_num_batched_tokens=32, num_kv_blocks=256) as llm:
            out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=3))[0]
    finally:
        torch.set_num_threads(threads)
    assert_matches(model_dir, prompt, out, 3)


def test_step_result_and_core_outputs_round_trip():
    from pagewire_common import wire
    from pagewire_common.core_messages import CoreOutputs
    from pagewire_common.plan import StepResult
    from pagewire_common.requests import PromptLogprobs

    for k in (0, 2):
        result = StepResult(step_id=3, seq_ids=[7], token_ids=[9], prompt_seq_ids=[7, 8], prompt_starts=[0, 16],
                            prompt_counts=[2, 1], prompt_logprobs=np.array([-1.0, -2.0, -3.0], dtype=np.float32),
                            num_prompt_top_logprobs=k,
                            prompt_top_token_ids=np.arange(3 * k, dtype=np.int32).reshape(3, k),
                            prompt_top_logprobs=-np.arange(3 * k, dtype=np.float32).reshape(3, k))
        back = wire.result_from_pb(wire.result_to_pb(result))
        assert (back.prompt_seq_ids, back.prompt_starts, back.prompt_counts) == ([7, 8], [0, 16], [2, 1])
        assert back.num_prompt_top_logprobs == k
        np.testing.assert_array_equal(back.prompt_logprobs, result.prompt_logprobs)
        np.testing.assert_array_equal(back.prompt_top_token_ids, result.prompt_top_token_ids)
        np.testing.assert_array_equal(back.prompt_top_logprobs, result.prompt_top_logprobs)
    assert wire.result_from_pb(wire.result_to_pb(StepResult(step_id=1))).prompt_seq_ids == []

    a = PromptLogprobs(np.array([-1.0, -2.0], dtype=np.float32), np.array([[4, 5], [6, 7]], dtype=np.int32),
                       np.array([[-0.5, -1.0], [-0.25, -2.0]], dtype=np.float32))
    b = PromptLogprobs.empty(1, 3)  # a one-token prompt: no entries
    c = PromptLogprobs(np.array([-3.0], dtype=np.float32), np.zeros((1, 0), dtype=np.int32),
                       np.zeros((1, 0), dtype=np.float32))
    out = CoreOutputs(request_ids=np.array([1, 2, 3]), token_ids=np.array([5, 5, 5], dtype=np.int32),
                      prompt_logprob_ids=[1, 2, 3], prompt_logprobs=[a, b, c])
    back = CoreOutputs.from_bytes(out.to_bytes())
    assert back.prompt_logprob_ids == [1, 2, 3]
    for got, want in zip(back.prompt_logprobs, [a, b, c]):
        assert got.num_top == want.num_top
        np.testing.assert_array_equal(got.logprobs, want.logprobs)
        np.testing.assert_array_equal(got.top_token_ids, want.top_token_ids)
        np.testing.assert_array_equal(got.top_logprobs, want.top_logprobs)
