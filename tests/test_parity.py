"""The offline engine against transformers' own greedy ``generate``, token for token (fp32)."""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagewire import LLM, SamplingParams
from tests.tiny_models import TINY_KINDS, sample_prompts

MAX_TOKENS = 24


@functools.lru_cache(maxsize=None)
def hf_model(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_greedy(model_dir, prompt: list[int], max_new_tokens: int, eos_ids: set[int]) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy continuation of one prompt alone, cut after the first EOS (as ours
    stops), and the log-softmax of its logits at each generated step."""
    model = hf_model(str(model_dir))
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    for i, t in enumerate(tokens):
        if t in eos_ids:
            tokens = tokens[: i + 1]
            break
    logprobs = torch.log_softmax(torch.stack(out.logits)[:, 0].float(), dim=-1)
    return tokens, logprobs


def eos_ids(llm: LLM) -> set[int]:
    return set(llm.engine.worker_info.eos_token_ids)


def reference(model_dir, llm, prompts, max_tokens=MAX_TOKENS):
    return [hf_greedy(model_dir, p, max_tokens, eos_ids(llm))[0] for p in prompts]


def assert_all_free(llm: LLM):
    llm.allocator.check_integrity()
    assert llm.allocator.num_free_blocks == llm.allocator.num_blocks


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_greedy_parity_mixed_batch(kind, tiny_model_dir):
    model_dir = tiny_model_dir(kind)
    prompts = sample_prompts(model_dir, n=10)
    assert min(map(len, prompts)) == 1 and max(map(len, prompts)) > 100
    llm = LLM(model_dir, block_size=4, max_num_batched_tokens=32, num_kv_blocks=512)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == reference(model_dir, llm, [prompt])[0], f"prompt of {len(prompt)} tokens"
        assert out.finish_reason == ("stop" if len(out.token_ids) < MAX_TOKENS else "length")
    assert_all_free(llm)
    # chunked prefill and rollover really happened: 32-token budget, 4-token blocks
    assert max(map(len, prompts)) > 32


def test_logprobs_match_transformers(tiny_model_dir):
    model_dir = tiny_model_dir("llama-gqa")
    prompts = sample_prompts(model_dir, n=4)
    llm = LLM(model_dir, block_size=4, max_num_batched_tokens=64, num_kv_blocks=256)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, logprobs=True))
    for prompt, out in zip(prompts, outs):
        tokens, ref_lp = hf_greedy(model_dir, prompt, 8, eos_ids(llm))
        assert out.token_ids == tokens
        expected = [ref_lp[i, t].item() for i, t in enumerate(tokens)]
        assert out.logprobs == pytest.approx(expected, abs=1e-4)


def test_prefix_cache_gives_same_outputs_and_reports_hits(tiny_model_dir):
    model_dir = tiny_model_dir("llama-gqa")
    prompts = sample_prompts(model_dir, n=8)
    # a prompt made of whole blocks: fully cached on the second run, its last block is copied
    prompts.append(prompts[-1][:32])
    sp = SamplingParams(temperature=0, max_tokens=12)
    plain = LLM(model_dir, block_size=4, max_num_batched_tokens=48, num_kv_blocks=512, enable_prefix_caching=False)
    expected = [o.token_ids for o in plain.generate(prompts, sp)]
    llm = LLM(model_dir, block_size=4, max_num_batched_tokens=48, num_kv_blocks=512)
    first = llm.generate(prompts, sp)
    copies_before = llm.runner.num_block_copies
    second = llm.generate(prompts, sp)
    assert [o.token_ids for o in first] == expected
    assert [o.token_ids for o in second] == expected
    assert all(o.num_cached_tokens == 0 for o in first[:-1])
    # every full block of every prompt is reused; a whole-block prompt recomputes its last token
    assert [o.num_cached_tokens for o in second] == [min((len(p) // 4) * 4, len(p) - 1) for p in prompts]
    assert llm.runner.num_block_copies > copies_before
    assert_all_free(llm)


@pytest.mark.parametrize("block_size", [4, 16])
def test_a_prompt_cached_by_the_same_step_is_not_copied_unwritten(block_size, tiny_model_dir):
    """Duplicates of a whole-block prompt, and a whole-block prefix of another prompt, in one call:
    the later ones find every block cached by the step that computes the first. That step writes
    those blocks after its block copies, so the last block is computed again, not copied."""
    model_dir = tiny_model_dir("llama-gqa")
    sp = SamplingParams(temperature=0, max_tokens=6)
    long = list(range(100, 100 + 2 * block_size + 5))
    prompts = [long[: 2 * block_size], long[: 2 * block_size], long, long[: 2 * block_size]]
    for overlap in (True, False):
        llm = LLM(model_dir, block_size=block_size, num_kv_blocks=256, overlap=overlap)
        alone = [llm.generate([p], sp)[0].token_ids for p in prompts[2:3] + prompts[:1]]
        llm = LLM(model_dir, block_size=block_size, num_kv_blocks=256, overlap=overlap)
        outs = llm.generate(prompts, sp)
        assert [o.token_ids for o in outs] == [alone[1], alone[1], alone[0], alone[1]], overlap
        assert outs[1].num_cached_tokens == block_size  # all but the block written by the same step
        assert_all_free(llm)
        # a later call finds every block written: the whole-block prompt copies its last block
        copies = llm.runner.num_block_copies
        (again,) = llm.generate([prompts[0]], sp)
        assert again.token_ids == alone[1] and again.num_cached_tokens == 2 * block_size - 1
        assert llm.runner.num_block_copies == copies + 1


def test_preemption_outputs_equal_reference(tiny_model_dir):
    model_dir = tiny_model_dir("gpt2")
    prompts = [p for p in sample_prompts(model_dir, n=10) if len(p) <= 50][:8]
    # 24 blocks x 4 tokens = 96 slots for 8 sequences of up to ~74 tokens each
    llm = LLM(model_dir, block_size=4, max_num_batched_tokens=64, num_kv_blocks=24)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    assert llm.engine.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == reference(model_dir, llm, [prompt])[0]
    assert_all_free(llm)


def test_seeded_sampling(tiny_model_dir):
    model_dir = tiny_model_dir("qwen2-bias")
    prompts = sample_prompts(model_dir, n=6)
    llm = LLM(model_dir, block_size=4, max_num_batched_tokens=64, num_kv_blocks=512)
    sp = SamplingParams(temperature=1.0, top_p=0.95, top_k=50, seed=1234, max_tokens=20, ignore_eos=True)
    a = llm.generate(prompts, sp)
    # same seed, different batch: alone and in reverse order
    alone = llm.generate([prompts[2]], sp)
    b = llm.generate(prompts[::-1], sp)[::-1]
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert alone[0].token_ids == a[2].token_ids
    # a trained tiny model is confident: compare seeds where sampling has room to differ
    hot = dict(temperature=1.5, max_tokens=20, ignore_eos=True)
    s1 = llm.generate(prompts, SamplingParams(seed=1, **hot))
    assert [o.token_ids for o in llm.generate(prompts, SamplingParams(seed=1, **hot))] == [o.token_ids for o in s1]
    s2 = llm.generate(prompts, SamplingParams(seed=2, **hot))
    assert sum(x.token_ids != y.token_ids for x, y in zip(s1, s2)) >= 5
    greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    top1 = llm.generate(prompts, SamplingParams(temperature=0.8, top_k=1, max_tokens=20, ignore_eos=True))
    assert [o.token_ids for o in top1] == [o.token_ids for o in greedy]
    unseeded = llm.generate(prompts, SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True))
    assert [o.token_ids for o in unseeded] != [o.token_ids for o in greedy]
    assert_all_free(llm)


def test_text_prompts_stop_strings_and_detokenization(tiny_model_dir):
    model_dir = tiny_model_dir("llama-gqa")
    llm = LLM(model_dir, block_size=4, num_kv_blocks=256)
    text_prompt = "The river "
    (out,) = llm.generate(text_prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    assert out.text == llm.tokenizer.decode(out.token_ids)
    # stop on a piece of the text it produces: the output is cut right before it
    stop = out.text[len(out.text) // 2 :][:3]
    (cut,) = llm.generate(text_prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]))
    assert cut.finish_reason == "stop"
    assert cut.text == out.text[: out.text.index(stop)]
    assert stop not in cut.text
    assert_all_free(llm)


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ("", SamplingParams(), "empty"),
        ([], SamplingParams(), "empty"),
        ([1] * 300, SamplingParams(), "maximum model length"),
        ([1, 2], dict(temperature=-0.5), "temperature"),
        ([1, 2], dict(top_p=0.0), "top_p"),
        ([1, 2], dict(top_p=1.5), "top_p"),
        ([1, 2], dict(max_tokens=0), "max_tokens"),
    ],
)
def test_bad_input_raises_value_error_and_engine_keeps_working(prompt, params, message, tiny_model_dir):
    model_dir = tiny_model_dir("gpt2")
    llm = _cached_llm(str(model_dir))
    with pytest.raises(ValueError, match=message):
        sp = params if isinstance(params, SamplingParams) else SamplingParams(**params)
        llm.generate([[5, 6, 7], prompt], sp)
    assert llm.engine.num_requests == 0
    outs = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4))
    assert outs[0].token_ids == reference(model_dir, llm, [[5, 6, 7]], 4)[0]
    assert_all_free(llm)


@functools.lru_cache(maxsize=None)
def _cached_llm(model_dir: str) -> LLM:
    return LLM(model_dir, block_size=4, num_kv_blocks=128)


@pytest.mark.slow
def test_smollm2_parity(smollm2_dir):
    llm = LLM(None, block_size=16, max_num_batched_tokens=64)
    tok = llm.tokenizer
    texts = [
        "The capital of France is",
        "def fibonacci(n):",
        "<|im_start|>user\nWhat is the boiling point of water?<|im_end|>\n<|im_start|>assistant\n",
        "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    ]
    prompts = [tok.encode(t) for t in texts]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == reference(smollm2_dir, llm, [prompt], 32)[0]
        assert out.text == tok.decode(out.token_ids)
    assert_all_free(llm)
