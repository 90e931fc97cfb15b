"""--deterministic on CPU: every attention chunk on the C kernel, every unrestricted row drawn the
same way, so a seeded request's tokens do not depend on its batch or on prefix-cache hits."""

from __future__ import annotations

import pytest
import torch

from kvcache import paged
from kvcache.paged import paged_attention
from pagewire import LLM, SamplingParams
from tests.test_cpu_kernels import _batch
from tests.tiny_models import sample_prompts
from worker_svc.cpu import attention, build, features
from worker_svc.sampler import Sampler, SamplingBatch

pytestmark = pytest.mark.skipif(build.compiler() is None, reason="no C compiler on PATH")

# bf16 where the CPU computes it natively (where SDPA and the C kernel round differently); the
# 60-token prompt is one chunk of more than 32 queries either way
DTYPE = "bfloat16" if features.cpu_info().native_bf16 else "float32"
PROMPT_LEN = 60  # 3 full blocks of 16 cached, so a hit leaves a chunk of 12 (<= 32) queries


@pytest.fixture
def sdpa_calls(monkeypatch):
    """The query lengths of the chunks the dispatch sends to torch's SDPA."""
    calls = []
    chunk_attention = paged._chunk_attention

    def spy(query, *args):
        calls.append(query.shape[0])
        return chunk_attention(query, *args)

    monkeypatch.setattr(paged, "_chunk_attention", spy)
    return calls


@pytest.mark.parametrize("every_chunk", [False, True])
def test_registration_picks_where_long_chunks_go(sdpa_calls, every_chunk):
    assert attention.kernel() is not None, "the CPU kernel did not build (see the log)"
    query, kv, meta, scale = _batch([40, 32, 1], [70, 50, 19], 16, 2, 3, torch.bfloat16)
    paged.use_cpu_attention(attention.kernel, every_chunk=every_chunk)
    try:
        out = paged_attention(query, kv, meta, scale)
        in_c = attention.kernel().paged_attention(query, kv, meta.query_start_loc, meta.seq_lens,
                                                  meta.block_tables, scale)
    finally:
        paged.use_cpu_attention(None)
    if every_chunk:
        assert sdpa_calls == []
        assert torch.equal(out, in_c)
    else:  # unchanged: the 40-query chunk in SDPA, the rest in C
        assert sdpa_calls == [40]
        assert torch.equal(out[40:], in_c[40:])


def test_unrestricted_rows_draw_alike_whatever_their_batch_mates():
    sampler = Sampler("cpu", deterministic=True)
    if sampler._cpu is None:
        pytest.skip("the sampler's C draw is not built here")
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 500, generator=gen) * 4
    seeded = SamplingParams(temperature=0.8, seed=3)
    mates = [SamplingParams(temperature=0.7, top_k=50), SamplingParams(temperature=1.1, top_p=0.9),
             SamplingParams(temperature=0.9, min_p=0.1), SamplingParams(temperature=0)]
    for position in range(200):
        alone = sampler(logits, SamplingBatch([seeded], [position], False))[0]
        batch = torch.cat([logits, torch.randn(len(mates), 500, generator=gen)])
        together = sampler(batch, SamplingBatch([seeded, *mates], [position] * 5, False))[0]
        assert int(together[0]) == int(alone[0])


def test_seeded_tokens_alone_batched_and_after_a_prefix_hit(tiny_model_dir):
    model = tiny_model_dir("llama-gqa")
    prompts = sample_prompts(model, lengths=[PROMPT_LEN] + [8 + 3 * i for i in range(16)], seed=5)
    prompt = prompts[0]
    assert len(prompt) == PROMPT_LEN
    # logprobs too: with the setting off, their rounding differs after a hit even where the tokens agree
    seeded = SamplingParams(temperature=0.8, seed=11, max_tokens=24, ignore_eos=True, logprobs=True)
    common = dict(dtype=DTYPE, device="cpu", block_size=16, num_kv_blocks=256, deterministic=True)
    try:
        with LLM(model, **common) as llm:  # prefix cache on
            alone = llm.generate([prompt], seeded)[0]
            again = llm.generate([prompt], seeded)[0]
        assert alone.usage.cached_prompt_tokens == 0
        assert again.usage.cached_prompt_tokens == 48  # a hit: the remaining chunk is 12 queries
        assert again.token_ids == alone.token_ids
        assert again.logprobs == alone.logprobs

        others = [SamplingParams(temperature=0.9, seed=i, max_tokens=24) for i in range(15)]
        others.append(SamplingParams(temperature=0.8, top_k=50, max_tokens=24))
        with LLM(model, enable_prefix_caching=False, **common) as llm:
            batched = llm.generate([prompt, *prompts[1:]], [seeded, *others])[0]
        assert batched.token_ids == alone.token_ids
        assert batched.logprobs == alone.logprobs
    finally:
        paged.use_cpu_attention(attention.kernel)  # as a worker without --deterministic registers it
