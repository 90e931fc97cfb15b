"""Structured output (json_schema, regex, grammar): every constrained output matches its grammar,
from a tiny model with random weights and from SmolLM2, in batches mixed with unconstrained
requests, with overlap on and off, under preemption, with n > 1; the masks cost nothing to the
rows and steps that have no grammar."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

from pagewire import LLM, SamplingParams
from tests.test_parity import assert_all_free, eos_ids
from tests.test_sampling_controls import run, run_n
from tests.tiny_models import sample_prompts
from worker_svc.structured import GrammarMasks

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "ok": {"type": "boolean"},
        "size": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
    },
    "required": ["name", "ok", "size", "tags"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,5}-[0-9]{1,3}(\.[0-9])?"
# GBNF (llama.cpp): a sum of small numbers
GBNF = 'root ::= num (" + " num){0,2}\nnum ::= [1-9] [0-9]?\n'
GBNF_PATTERN = r"[1-9][0-9]?( \+ [1-9][0-9]?){0,2}"
# Lark (llguidance's native syntax)
LARK = 'start: "(" item ("," item){0,3} ")"\nitem: /[xyz]{1,3}/\n'
LARK_PATTERN = r"\([xyz]{1,3}(,[xyz]{1,3}){0,3}\)"


def check_schema(value, schema) -> None:
    """Assert ``value`` satisfies ``schema`` (the keywords SCHEMA uses)."""
    if "enum" in schema:
        assert value in schema["enum"]
        return
    kind = schema["type"]
    if kind == "object":
        assert isinstance(value, dict)
        assert set(schema["required"]) <= set(value) <= set(schema["properties"])
        for key, item in value.items():
            check_schema(item, schema["properties"][key])
    elif kind == "array":
        assert isinstance(value, list) and len(value) <= schema.get("maxItems", len(value))
        for item in value:
            check_schema(item, schema["items"])
    elif kind == "string":
        assert isinstance(value, str) and len(value) <= schema.get("maxLength", len(value))
    elif kind == "integer":
        assert isinstance(value, int) and not isinstance(value, bool)
        assert schema.get("minimum", value) <= value <= schema.get("maximum", value)
    elif kind == "boolean":
        assert isinstance(value, bool)
    else:
        raise AssertionError(f"unexpected schema type {kind}")


def outside_strings(text: str) -> str:
    """The characters of JSON ``text`` that are not inside a string literal."""
    return re.sub(r'"(?:[^"\\]|\\.)*"', "", text)


def check_output(out, sp: SamplingParams, llm: LLM) -> None:
    """A constrained output ended at its grammar's end (EOS) and its text matches the grammar."""
    eos = eos_ids(llm)
    assert out.finish_reason == "stop", (sp.structured_output, out.token_ids)
    assert out.token_ids[-1] in eos and not eos & set(out.token_ids[:-1])
    output = llm.tokenizer.decode(out.token_ids[:-1])
    assert out.text in ("", output)  # empty where the test drove the engine itself (no detokenizer)
    kind, text = sp.structured_output
    if kind == "json_schema":
        check_schema(json.loads(output), json.loads(text))
        assert not re.search(r"\s", outside_strings(output)), output  # no free whitespace
    elif kind == "regex":
        assert re.fullmatch(text, output), output
    else:
        assert re.fullmatch(GBNF_PATTERN if "::=" in text else LARK_PATTERN, output), output


def structured(i: int, **kwargs) -> SamplingParams:
    """Request i of a mixed batch: json_schema, regex, GBNF, Lark, or none (greedy)."""
    kind = i % 5
    grammar = [dict(json_schema=SCHEMA), dict(regex=REGEX), dict(grammar=GBNF), dict(grammar=LARK), {}][kind]
    if not grammar:
        return SamplingParams(temperature=0, max_tokens=12)
    return SamplingParams(temperature=1.0, seed=100 + i, max_tokens=80, **grammar, **kwargs)


@pytest.fixture(scope="module")
def random_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny Llama's config and tokenizer with freshly initialised (random) weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    source = tiny_model_dir("llama-gqa")
    out = tmp_path_factory.mktemp("random-llama")
    for path in source.iterdir():
        if path.name != "model.safetensors":
            shutil.copy(path, out / path.name)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source)).save_pretrained(out)
    return out


@pytest.mark.parametrize("overlap", [False, True])
def test_outputs_match_their_grammar_in_a_mixed_batch_under_preemption(random_model_dir, overlap):
    prompts = sample_prompts(random_model_dir, n=20)
    params = [structured(i) for i in range(len(prompts))]
    roomy = LLM(random_model_dir, block_size=16, num_kv_blocks=400)
    expected = roomy.generate(prompts, params)
    # 4-token blocks, too few for every sequence at once, a small budget: chunked prefill,
    # preemption (matchers rebuilt from the tokens), many sequences per step
    llm = LLM(random_model_dir, block_size=4, max_num_batched_tokens=48, num_kv_blocks=55)
    outs = run(llm, prompts, params, overlap)
    assert llm.engine.scheduler.num_preemptions > 0
    for i, (out, want, sp) in enumerate(zip(outs, expected, params)):
        # seeded: the same tokens whatever the batch, the preemptions and the overlap
        assert out.token_ids == want.token_ids, f"request {i}"
        if sp.structured_output is not None:
            check_output(out, sp, llm)
    # without the constrained requests, the unconstrained ones come out the same
    plain = [(p, sp) for p, sp in zip(prompts, params) if sp.structured_output is None]
    alone = roomy.generate([p for p, _ in plain], [sp for _, sp in plain])
    assert [o.token_ids for o in alone] == [o.token_ids for o, sp in zip(outs, params) if sp.structured_output is None]
    assert_all_free(llm)
    assert llm.runner.adjuster.num_adjusted == 0 and llm.runner.adjuster.grammars.num_active == 0


def test_unconstrained_output_breaks_the_grammar(random_model_dir):
    """The random model on its own does not write JSON or match the regex: the masks do."""
    prompts = sample_prompts(random_model_dir, n=4)
    llm = LLM(random_model_dir, block_size=16, num_kv_blocks=200)
    free = llm.generate(prompts, SamplingParams(temperature=1.0, seed=5, max_tokens=20))
    for out in free:
        assert not re.fullmatch(REGEX, out.text) and not out.text.startswith("{")


@pytest.mark.parametrize("overlap", [False, True])
def test_n_samples_each_follow_the_schema(random_model_dir, overlap):
    prompts = sample_prompts(random_model_dir, n=3)
    params = [SamplingParams(temperature=1.0, seed=9 + i, max_tokens=80, n=4, json_schema=SCHEMA) for i in range(3)]
    llm = LLM(random_model_dir, block_size=4, max_num_batched_tokens=48, num_kv_blocks=90)
    if overlap:
        samples = run_n(llm, prompts, params)
    else:
        samples = [[s.token_ids for s in o.samples] for o in llm.generate(prompts, params)]
    eos = eos_ids(llm)
    for per_prompt in samples:
        assert len(per_prompt) == 4 and len({tuple(s) for s in per_prompt}) == 4
        for tokens in per_prompt:
            assert tokens[-1] in eos
            check_schema(json.loads(llm.tokenizer.decode(tokens[:-1])), SCHEMA)
    assert_all_free(llm)


def test_the_grammar_ends_the_sequence_under_ignore_eos_and_before_min_tokens(random_model_dir):
    prompt = sample_prompts(random_model_dir, n=1)[0]
    llm = LLM(random_model_dir, block_size=16, num_kv_blocks=100)
    eos = eos_ids(llm)
    # complete after "ok": EOS is all the grammar allows, and ends it (STOP), ignore_eos or not
    for extra in (dict(ignore_eos=True), dict(min_tokens=10)):
        (out,) = llm.generate([prompt], SamplingParams(temperature=1.0, seed=1, max_tokens=20, regex="ok", **extra))
        assert out.text == "ok" and out.finish_reason == "stop" and out.token_ids[-1] in eos
    # ignore_eos keeps an open-ended grammar going: no EOS until max_tokens, and it still matches
    outs = llm.generate([prompt] * 4, [SamplingParams(temperature=1.0, seed=s, max_tokens=30, regex="[a-z ]+",
                                                      ignore_eos=True) for s in range(4)])
    for out in outs:
        assert out.finish_reason == "length" and len(out.token_ids) == 30
        assert not eos & set(out.token_ids) and re.fullmatch("[a-z ]+", out.text)
    assert_all_free(llm)


def test_rows_and_steps_without_a_grammar_pay_nothing(random_model_dir):
    llm = LLM(random_model_dir, block_size=16, num_kv_blocks=200)
    grammars = llm.runner.adjuster.grammars
    masked_rows = []
    original = GrammarMasks.apply
    grammars.apply = lambda logits, states, rows: (masked_rows.append(list(rows)), original(grammars, logits, states, rows))
    started = []
    original_start = GrammarMasks.start
    grammars.start = lambda states: (started.append(len(states)), original_start(grammars, states))
    fills = []
    executor = grammars._executor

    class CountingExecutor:
        def unsafe_compute_mask_ptr(self, jobs, *args):
            fills.append(len(jobs))
            return executor.unsafe_compute_mask_ptr(jobs, *args)

    grammars._executor = CountingExecutor()
    prompts = sample_prompts(random_model_dir, n=4)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6))
    assert masked_rows == [] and started == [] and fills == []
    params = [SamplingParams(temperature=0, max_tokens=6, regex="[a-z]{3,40}" if i == 2 else None) for i in range(4)]
    outs = llm.generate(prompts, params)
    # one mask row a step, the constrained request's, filled once (while the forward pass ran)
    assert masked_rows and all(len(rows) == 1 for rows in masked_rows)
    assert len(masked_rows) == len(outs[2].token_ids) == len(fills) and set(fills) == {1}
    assert re.fullmatch("[a-z]{3,40}", outs[2].text)


def test_compiled_grammars_are_cached_by_text(random_model_dir):
    llm = LLM(random_model_dir, block_size=16, num_kv_blocks=200)
    grammars = llm.runner.adjuster.grammars
    prompts = sample_prompts(random_model_dir, n=4)
    llm.generate(prompts, [SamplingParams(temperature=1.0, seed=i, max_tokens=40, regex=REGEX) for i in range(4)])
    llm.generate(prompts[:2], SamplingParams(temperature=1.0, max_tokens=80, json_schema=SCHEMA))
    assert list(grammars._templates) == [("regex", REGEX), ("json_schema", json.dumps(SCHEMA))]


def test_invalid_grammars_are_refused_with_the_library_message(random_model_dir):
    llm = LLM(random_model_dir, block_size=16, num_kv_blocks=100)
    with pytest.raises(ValueError, match="invalid regex"):
        llm.generate([[1, 2, 3]], SamplingParams(regex="[a-"))
    with pytest.raises(ValueError, match="invalid grammar"):
        llm.generate([[1, 2, 3]], SamplingParams(grammar="root ::= undefined_rule"))
    assert llm.engine.num_requests == 0


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
DATE = r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"


@pytest.fixture(scope="module")
def smollm2_case(smollm2_dir):
    """SmolLM2 with 24 blocks of 4 tokens (preemption), its prompts and mixed params, and the
    unconstrained requests' greedy outputs alone in a roomy engine."""
    llm = LLM(smollm2_dir, block_size=4, max_num_batched_tokens=64, num_kv_blocks=24)
    chat = "<|im_start|>user\nDescribe a person as JSON.<|im_end|>\n<|im_start|>assistant\n"
    encode = llm.tokenizer.encode
    prompts = [encode(chat)] * 3 + [encode("The date today is ")] * 2 + [encode("Once upon a time")]
    params = [SamplingParams(temperature=0, max_tokens=40, json_schema=PERSON),
              SamplingParams(temperature=0.8, seed=3, max_tokens=40, json_schema=PERSON),
              SamplingParams(temperature=0, max_tokens=12),
              SamplingParams(temperature=0, max_tokens=20, regex=DATE),
              SamplingParams(temperature=1.0, seed=4, max_tokens=20, regex=DATE),
              SamplingParams(temperature=0, max_tokens=12)]
    alone = LLM(smollm2_dir, block_size=16, num_kv_blocks=64).generate([prompts[2], prompts[5]], [params[2], params[5]])
    return llm, prompts, params, [o.token_ids for o in alone]


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [False, True])
def test_smollm2_writes_json_and_dates_in_a_mixed_batch_under_preemption(smollm2_case, overlap):
    llm, prompts, params, alone = smollm2_case
    before = llm.engine.scheduler.num_preemptions
    outs = run(llm, prompts, params, overlap)
    assert llm.engine.scheduler.num_preemptions > before
    for i in (0, 1, 3, 4):
        check_output(outs[i], params[i], llm)
    # the unconstrained requests in the same batch are the plain greedy continuations
    assert [outs[2].token_ids, outs[5].token_ids] == alone
    assert_all_free(llm)


def test_a_model_without_tokenizer_refuses_structured_output(random_model_dir, tmp_path):
    for path in random_model_dir.iterdir():
        if not path.name.startswith("tokenizer"):
            shutil.copy(path, tmp_path / path.name)
    llm = LLM(tmp_path, block_size=16, num_kv_blocks=50)
    assert llm.runner.adjuster.grammars is None
    with pytest.raises(ValueError, match="tokenizer.json"):
        llm.generate([[5, 6, 7]], SamplingParams(regex="[a-z]+"))
    assert llm.engine.num_requests == 0
    # plain requests still run (ignore_eos: a random model may sample its EOS at any step)
    assert len(llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))[0].token_ids) == 3


def test_a_tokenizer_larger_than_the_vocabulary_serves_without_structured_output(random_model_dir, tmp_path, caplog):
    """The grammar engine refuses a tokenizer with more tokens than the model's vocabulary: the
    worker still starts, says why in its log, reports no structured output, and a request for
    one is refused while plain requests run."""
    from tokenizers import Tokenizer as HFTokenizer

    for path in random_model_dir.iterdir():
        shutil.copy(path, tmp_path / path.name)
    tok = HFTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    vocab_size = json.loads((tmp_path / "config.json").read_text())["vocab_size"]
    tok.add_tokens([f"<extra_{i}>" for i in range(vocab_size - tok.get_vocab_size(with_added_tokens=True) + 8)])
    assert tok.get_vocab_size(with_added_tokens=True) > vocab_size
    tok.save(str(tmp_path / "tokenizer.json"))
    with caplog.at_level("WARNING", logger="pagewire.worker"):
        llm = LLM(tmp_path, block_size=16, num_kv_blocks=50)
    assert "structured output is off for this model" in caplog.text
    assert not llm.runner.structured_output and not llm.engine.worker_info.structured_output
    with pytest.raises(ValueError, match="serves no structured output"):
        llm.generate([[5, 6, 7]], SamplingParams(regex="[a-z]+"))
    assert llm.engine.num_requests == 0
    assert len(llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))[0].token_ids) == 3
