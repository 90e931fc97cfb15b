"""The offline ``LLM`` keeps what it built out of the garbage collector's full collections, as the
served processes do once ready."""

from __future__ import annotations

import gc


def test_llm_freezes_the_objects_it_built(tiny_model_dir):
    from pagewire import LLM, SamplingParams

    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    llm = LLM(tiny_model_dir("llama-gqa"), block_size=4, num_kv_blocks=50)
    try:
        frozen = gc.get_freeze_count()
        assert frozen > 1000  # the model's modules, torch's and the tokenizer's objects
        out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        assert len(out[0].token_ids) == 3
    finally:
        llm.close()
        gc.unfreeze()
