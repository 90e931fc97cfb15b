"""The offline ``LLM`` and the garbage collector: what it built is kept out of full collections, as
the served processes do once ready, and generating keeps no object per token."""

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


def test_generate_keeps_no_object_per_token(tiny_model_dir, monkeypatch):
    """Each sample's deltas are merged as they arrive: however many tokens a request has had,
    only the latest step's deltas are alive (kept, there would be one per token, young objects
    that every garbage collection walks again)."""
    import pagewire.llm as llm_module
    from pagewire import LLM, SamplingParams
    from pagewire_common.requests import TextDelta

    alive: list[int] = []
    run_step = llm_module.run_step

    def counting_run_step(*args, **kwargs):
        alive.append(sum(isinstance(o, TextDelta) for o in gc.get_objects()))
        return run_step(*args, **kwargs)

    monkeypatch.setattr(llm_module, "run_step", counting_run_step)
    llm = LLM(tiny_model_dir("llama-gqa"), block_size=4, num_kv_blocks=100)
    try:
        out = llm.generate([[5, 6, 7], [8, 9]], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
        assert [len(o.token_ids) for o in out] == [40, 40]
        assert len(alive) >= 40 and max(alive) <= 2  # one delta per sample from the step before
    finally:
        llm.close()
        gc.unfreeze()
