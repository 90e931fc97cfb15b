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


def test_a_failed_step_leaves_the_engine_usable(tiny_model_dir, monkeypatch):
    """A step that raises halfway (here the runner, on its third step) fails that call; the next
    call finds the engine and the worker in step and gives the same tokens as a fresh engine."""
    from pagewire import LLM, SamplingParams

    llm = LLM(tiny_model_dir("llama-gqa"), block_size=4, num_kv_blocks=100)
    try:
        greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        expected = [o.token_ids for o in llm.generate([[5, 6, 7], [8, 9]], greedy)]
        execute, calls = llm.runner.execute, []

        def failing_execute(plan):
            calls.append(plan.step_id)
            if len(calls) == 3:
                raise RuntimeError("the device fell over")
            return execute(plan)

        monkeypatch.setattr(llm.runner, "execute", failing_execute)
        try:
            llm.generate([[5, 6, 7], [8, 9]], greedy)
            raise AssertionError("the failing step did not raise")
        except RuntimeError as e:
            assert "fell over" in str(e)
        assert llm.engine.is_idle() and llm.runner.num_seqs == 0
        llm.engine.allocator.check_integrity()
        assert [o.token_ids for o in llm.generate([[5, 6, 7], [8, 9]], greedy)] == expected
        llm.engine.allocator.check_integrity()
    finally:
        llm.close()
        gc.unfreeze()


def test_a_prompt_that_is_not_unicode_is_a_value_error(tiny_model_dir):
    import pytest

    from pagewire import LLM, SamplingParams

    llm = LLM(tiny_model_dir("llama-gqa"), block_size=4, num_kv_blocks=50)
    try:
        with pytest.raises(ValueError, match="prompt 1: the prompt is not valid Unicode text: it holds a lone surrogate"):
            llm.generate(["fine", "half an emoji \ud83d"], SamplingParams(max_tokens=2))
        with pytest.raises(ValueError, match="stop_token_ids token id 100000 is outside the vocabulary"):
            llm.generate([[5, 6]], SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=[100000]))
        assert len(llm.generate([[5, 6]], SamplingParams(max_tokens=2, ignore_eos=True))[0].token_ids) == 2
    finally:
        llm.close()
        gc.unfreeze()


def test_prompts_in_the_shapes_vllm_users_pass_and_clear_errors_for_the_rest(tiny_model_dir, capsys):
    """vLLM's prompt dicts and numpy or torch id vectors are prompts; a value that is none of the
    shapes, or sampling params of the wrong type, is refused naming what it got; a closed LLM says so."""
    import numpy as np
    import pytest
    import torch

    from pagewire import LLM, SamplingParams

    llm = LLM(tiny_model_dir("llama-gqa"), block_size=4, num_kv_blocks=50)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    try:
        ids = [5, 6, 7]
        expected = llm.generate([ids], params)[0].token_ids
        text_expected = llm.generate("The sea", params)[0].token_ids
        for one in ({"prompt_token_ids": ids}, np.array(ids), torch.tensor(ids), tuple(ids), [np.int64(t) for t in ids],
                    range(5, 8), [torch.tensor(t) for t in ids]):
            assert llm.generate(one, params)[0].token_ids == expected, one
        assert [o.token_ids for o in llm.generate([{"prompt": "The sea"}, np.array(ids)], params)] == \
            [text_expected, expected]
        assert [o.token_ids for o in llm.generate(iter(["The sea", ids]), params)] == [text_expected, expected]
        # a progress bar of finished samples when asked (on a terminal by default)
        llm.generate([ids, ids], SamplingParams(temperature=0, max_tokens=3, n=2), use_tqdm=True)
        assert "4/4" in capsys.readouterr().err
        llm.generate([ids, ids], params)
        assert capsys.readouterr().err == ""  # stderr is no terminal here
        assert [o.token_ids for o in llm.generate(np.array([ids, ids]), params)] == [expected, expected]
        assert [o.token_ids for o in llm.generate([range(5, 8), ids], (p for p in [params, params]))] == \
            [expected, expected]
        for bad, message in (([1.5], "prompt 0: a prompt is a text or a list of token ids .integers., got float"),
                             (["ok", [1, "x"]], "prompt 1: .* got a list holding 'x'"),
                             ({"text": "hi"}, r"one key, 'prompt' .* got \['text'\]"),
                             ([{"prompt": 3}], r"got \['prompt'\]")):
            with pytest.raises(ValueError, match=message):
                llm.generate(bad, params)
        with pytest.raises(TypeError, match="prompts must be a prompt or a sequence of prompts, got int"):
            llm.generate(5, params)
        with pytest.raises(TypeError, match="sampling_params must be a SamplingParams or a list of them"):
            llm.generate("hi", {"temperature": 0})
    finally:
        llm.close()
        gc.unfreeze()
    with pytest.raises(RuntimeError, match="this LLM is closed"):
        llm.generate("hi", params)
    with pytest.raises(RuntimeError, match="this LLM is closed"):
        llm.chat([{"role": "user", "content": "hi"}], params)
    llm.close()  # twice is harmless


def test_settings_and_sampling_params_refuse_values_of_the_wrong_type():
    import pytest

    from pagewire import SamplingParams
    from pagewire_common.settings import Settings

    with pytest.raises(ValueError, match="must be True or False, got 'false'"):
        Settings(enable_prefix_caching="false")
    with pytest.raises(ValueError, match="--served-model-name .* must not be empty"):
        Settings(served_model_name=" ")
    for kw, message in ((dict(seed=1.5), "seed must be an integer"), (dict(seed="1"), "seed must be an integer"),
                        (dict(logprobs=5), "logprobs must be True or False .top_logprobs=k"),
                        (dict(ignore_eos=1), "ignore_eos must be True or False")):
        with pytest.raises(ValueError, match=message):
            SamplingParams(**kw)
    assert SamplingParams(top_k=-1).top_k == 0  # vLLM's "off"
    with pytest.raises(ValueError, match="top_k must be an integer"):
        SamplingParams(top_k=-1.0)


def test_a_model_without_a_tokenizer_takes_token_ids_and_refuses_stop_strings(tiny_model_dir, tmp_path):
    import shutil

    import pytest

    from pagewire import LLM, SamplingParams

    model_dir = tmp_path / "no-tokenizer"
    shutil.copytree(tiny_model_dir("llama-gqa"), model_dir)
    (model_dir / "tokenizer.json").unlink()
    llm = LLM(model_dir, block_size=4, num_kv_blocks=50)
    try:
        out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
        assert len(out.token_ids) == 3 and out.text == ""
        with pytest.raises(ValueError, match="prompt 0: stop strings need the model's tokenizer"):
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, stop=["x"]))
        with pytest.raises(ValueError, match="no tokenizer"):
            llm.generate("text", SamplingParams(max_tokens=3))
    finally:
        llm.close()
        gc.unfreeze()
