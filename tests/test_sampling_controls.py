"""Penalties, logit bias, min_tokens, min_p and top logprobs against transformers' own logits
processors (greedy, fp32, token for token), in mixed batches, with overlap on and off, small
blocks, a small budget and preemption."""

from __future__ import annotations

from collections import deque

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from pagewire import LLM, SamplingParams
from pagewire_common.plan import StepPlan
from tests.fake_worker import DrivenEngine
from tests.test_parity import assert_all_free, eos_ids, hf_model
from tests.tiny_models import sample_prompts
from worker_svc.sampler import Sampler, SamplingBatch

MAX_TOKENS = 20


class PresenceFrequencyReference(LogitsProcessor):
    """OpenAI's rule, written out: logit -= frequency * count + presence * (count > 0), counted
    over the generated tokens only."""

    def __init__(self, num_prompt_tokens: int, presence: float, frequency: float):
        self.num_prompt_tokens = num_prompt_tokens
        self.presence = presence
        self.frequency = frequency

    def __call__(self, input_ids, scores):
        generated = input_ids[:, self.num_prompt_tokens:]
        counts = torch.zeros_like(scores)
        counts.scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


def hf_generate(model_dir, prompt: list[int], stop_ids: set[int], max_new_tokens=MAX_TOKENS, **kwargs):
    """transformers' greedy continuation with ``kwargs`` passed to ``generate``, cut after the
    first stop token, and the log-softmax of its unprocessed logits at each step."""
    model = hf_model(str(model_dir))
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens, do_sample=False, output_logits=True, return_dict_in_generate=True,
            eos_token_id=sorted(stop_ids), pad_token_id=min(stop_ids), **kwargs,
        )
    tokens = out.sequences[0, len(prompt):].tolist()
    for i, t in enumerate(tokens):
        if t in stop_ids:
            tokens = tokens[: i + 1]
            break
    return tokens, torch.log_softmax(torch.stack(out.logits)[:, 0].float(), dim=-1)


class ImmediateLink:
    """The worker in this process behind the two-plans-in-flight pipeline (overlap)."""

    def __init__(self, runner):
        self.runner = runner
        self.results = deque()

    def send(self, plan: StepPlan) -> None:
        self.results.append(self.runner.execute(plan))

    def receive(self):
        return self.results.popleft()


def run(llm: LLM, prompts, params, overlap: bool) -> list:
    """Generate with overlap (two plans in flight) or one plan at a time."""
    if not overlap:
        return llm.generate(prompts, params)
    engine = DrivenEngine(llm.engine, llm.runner)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", p, sp)
    link = ImmediateLink(llm.runner)
    collected = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished() or engine.num_in_flight:
        for out in engine.pipeline_step(link, 2):
            collected[out.request_id].append(out)
    engine.drain()
    return [llm._merge(rid, p, collected[rid]) for rid, p in zip(collected, prompts)]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama-gqa")


def _cases(llm, model_dir, prompts):
    """One (SamplingParams, transformers generate kwargs, stop ids) per prompt, mixed settings."""
    eos = eos_ids(llm)
    plain = [hf_generate(model_dir, p, eos)[0] for p in prompts]
    cases = []
    for i, prompt in enumerate(prompts):
        kind = i % 6
        if kind == 0:
            cases.append((SamplingParams(temperature=0, max_tokens=MAX_TOKENS, repetition_penalty=1.8),
                          dict(repetition_penalty=1.8), eos))
        elif kind == 1:
            # favour a token the plain run never picks, and forbid the one it picks first
            favoured = next(t for t in range(5, 100) if t not in plain[i])
            bias = {favoured: 3.5, plain[i][0]: -100.0}
            cases.append((SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logit_bias=bias),
                          dict(sequence_bias={(t,): b for t, b in bias.items()}), eos))
        elif kind == 2:
            # a stop token the plain run produces early, held back until 6 tokens are out
            stop = plain[i][min(1, len(plain[i]) - 1)]
            cases.append((SamplingParams(temperature=0, max_tokens=MAX_TOKENS, min_tokens=6, stop_token_ids=[stop]),
                          dict(min_new_tokens=6), eos | {stop}))
        elif kind == 3:
            ref = PresenceFrequencyReference(len(prompt), presence=0.7, frequency=0.9)
            cases.append((SamplingParams(temperature=0, max_tokens=MAX_TOKENS, presence_penalty=0.7,
                                         frequency_penalty=0.9, top_logprobs=3),
                          dict(logits_processor=LogitsProcessorList([ref])), eos))
        elif kind == 4:
            cases.append((SamplingParams(temperature=0, max_tokens=MAX_TOKENS, top_logprobs=20, logprobs=True),
                          {}, eos))
        else:
            ref = PresenceFrequencyReference(len(prompt), presence=-0.5, frequency=0.3)
            cases.append((SamplingParams(temperature=0, max_tokens=MAX_TOKENS, repetition_penalty=0.7,
                                         presence_penalty=-0.5, frequency_penalty=0.3, logprobs=True),
                          dict(repetition_penalty=0.7, logits_processor=LogitsProcessorList([ref])), eos))
    return cases, plain


@pytest.mark.parametrize("overlap", [False, True])
def test_adjustments_match_transformers_in_one_mixed_batch(model_dir, overlap):
    prompts = sample_prompts(model_dir, n=12)
    # 4-token blocks, a 32-token budget, and too few blocks for every sequence at once: chunked
    # prefill, rollover and preemption (recomputed from the tokens, counts rebuilt) all happen
    llm = LLM(model_dir, block_size=4, max_num_batched_tokens=32, num_kv_blocks=120)
    cases, plain = _cases(llm, model_dir, prompts)
    outs = run(llm, prompts, [c[0] for c in cases], overlap)
    assert llm.engine.scheduler.num_preemptions > 0
    changed = {kind: 0 for kind in range(6)}
    for i, (prompt, out, (sp, kwargs, stops)) in enumerate(zip(prompts, outs, cases)):
        expected, ref_logprobs = hf_generate(model_dir, prompt, stops, **kwargs)
        assert out.token_ids == expected, f"prompt {i} ({sp})"
        changed[i % 6] += expected != plain[i]
        n = len(out.token_ids)
        if sp.logprobs:
            want = [ref_logprobs[j, t].item() for j, t in enumerate(out.token_ids)]
            assert out.logprobs == pytest.approx(want, abs=1e-4)
        if sp.top_logprobs:
            assert len(out.top_logprobs) == n
            for j, (ids, lps) in enumerate(out.top_logprobs):
                values, indices = ref_logprobs[j].topk(sp.top_logprobs)
                assert lps == pytest.approx(values.tolist(), abs=1e-4)
                assert ids == indices.tolist()  # the model's own ranking, whatever the penalties
        else:
            assert out.top_logprobs is None
        if sp.min_tokens:
            assert n > sp.min_tokens and plain[i].index(sp.stop_token_ids[0]) < sp.min_tokens
    # the settings really changed what was generated: the bias and min_tokens cases by
    # construction, the penalties in most cases
    assert changed[1] == changed[2] == 2 and changed[0] + changed[3] + changed[5] >= 3
    assert_all_free(llm)
    assert llm.runner.adjuster.num_adjusted == 0


def test_sequences_without_adjustments_skip_the_stage(model_dir):
    llm = LLM(model_dir, block_size=4, max_num_batched_tokens=64, num_kv_blocks=256)
    prompts = sample_prompts(model_dir, n=4)
    calls = []
    original = llm.runner.adjuster._apply_penalties
    llm.runner.adjuster._apply_penalties = lambda *a: (calls.append(len(a[1])), original(*a))
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4))
    assert calls == [] and llm.runner.adjuster.counts is None
    llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=4, repetition_penalty=1.2 if i == 1 else 1.0)
                           for i in range(4)])
    assert calls and set(calls) == {1}  # one row a step: only the sequence that asked


def test_min_p_keeps_only_tokens_near_the_top():
    logits = torch.log(torch.tensor([0.30, 0.28, 0.20, 0.12, 0.10]))
    rows = 400
    sp = SamplingParams(temperature=1.0, min_p=0.9, seed=None)
    batch = SamplingBatch([sp] * rows, [0] * rows, want_logprobs=False)
    tokens, _ = Sampler("cpu")(logits.expand(rows, -1).contiguous(), batch)
    assert set(tokens.tolist()) == {0, 1}  # 0.28 >= 0.9 * 0.30 > 0.20
    off = SamplingBatch([SamplingParams(temperature=1.0)] * rows, [0] * rows, want_logprobs=False)
    tokens, _ = Sampler("cpu")(logits.expand(rows, -1).contiguous(), off)
    assert len(set(tokens.tolist())) == 5


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(top_logprobs=21), "top_logprobs"),
    (dict(repetition_penalty=-1.0), "repetition_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty"),
    (dict(min_p=1.5), "min_p"),
    (dict(min_tokens=20, max_tokens=10), "min_tokens"),
    (dict(logit_bias={3: 101.0}), "logit_bias"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(n=0), "n must"),
    (dict(regex="a+", json_schema="{}"), "at most one"),
])
def test_bad_values_are_rejected(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        SamplingParams(**kwargs)


def test_engine_rejects_bias_outside_vocabulary_and_n_beyond_max_num_seqs(model_dir):
    llm = LLM(model_dir, block_size=4, num_kv_blocks=64, max_num_seqs=8)
    vocab = llm.engine.worker_info.vocab_size
    with pytest.raises(ValueError, match="logit_bias token id"):
        llm.generate([[1, 2, 3]], SamplingParams(logit_bias={vocab: 1.0}))
    with pytest.raises(ValueError, match="max_num_seqs"):
        llm.generate([[1, 2, 3]], SamplingParams(n=9))
    assert llm.engine.num_requests == 0 and not llm.engine.has_unfinished()


def test_min_tokens_holds_stop_strings_back_as_well(model_dir):
    """A stop string that the first tokens complete ends a request at once, and not one with
    min_tokens past them; that one runs to min_tokens at least."""
    llm = LLM(model_dir, block_size=4, num_kv_blocks=64)
    greedy = dict(temperature=0, max_tokens=12, ignore_eos=True)
    (full,) = llm.generate(["the quick brown fox"], SamplingParams(**greedy))
    first = llm.tokenizer.decode(full.token_ids[:1])
    stop = first.strip()[:1]
    assert stop, full.text
    (early,) = llm.generate(["the quick brown fox"], SamplingParams(**greedy, stop=[stop]))
    assert early.finish_reason == "stop" and len(early.token_ids) == 1
    (held,) = llm.generate(["the quick brown fox"], SamplingParams(**greedy, stop=[stop], min_tokens=6))
    assert len(held.token_ids) >= 6 and held.token_ids == full.token_ids[:len(held.token_ids)]
    assert held.text.startswith(first) and full.text.startswith(held.text)


def test_a_step_after_a_fork_samples_each_row_with_its_own_parameters(model_dir):
    """Two tokens a step: A's n=2 prompt, then its fork (left out of the next step by the budget)
    beside greedy B. B once took the parameters of the step before's rows (A at temperature 5),
    and with logprobs the engine failed (an IndexError in delivery)."""
    a, b = [100, 101, 102], [249, 99, 217]
    alone = LLM(model_dir, block_size=16, num_kv_blocks=64).generate([b], SamplingParams(temperature=0, max_tokens=1))
    for seed in range(4):
        llm = LLM(model_dir, block_size=16, num_kv_blocks=64, max_num_batched_tokens=2)
        outs = llm.generate([a, b], [SamplingParams(temperature=5.0, seed=seed, max_tokens=4, n=2),
                                     SamplingParams(temperature=0, max_tokens=1, logprobs=True)])
        assert outs[1].token_ids == alone[0].token_ids and len(outs[1].logprobs) == 1, seed


# ---- n samples --------------------------------------------------------------------------------


def test_a_stop_string_on_sample_0_leaves_the_samples_it_did_not_fork_running(tiny_model_dir):
    """Two KV blocks hold one sample at a time, so samples 1-3 wait for sample 0 to fork them;
    a stop string that ends sample 0 first once ended them too, silently (no output: offline an
    AttributeError, served a stream that never ended). They run on their own, as after EOS."""
    llm = LLM(tiny_model_dir("gpt2"), block_size=16, num_kv_blocks=2)
    prompt = [19, 70, 41, 21, 383, 8]
    (plain,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=21))
    stop = llm.tokenizer.decode(plain.token_ids[1:3])[:2]
    (single,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=21, stop=[stop]))
    assert single.finish_reason == "stop"
    (out,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=21, n=4, stop=[stop]))
    assert [(s.token_ids, s.finish_reason) for s in out.samples] == [(single.token_ids, "stop")] * 4
    assert llm.engine.is_idle() and llm.engine.allocator.num_free_blocks == 2
    llm.engine.allocator.check_integrity()


def test_n_samples_share_the_prompt_blocks_then_sample_on_their_own(model_dir):
    llm = LLM(model_dir, block_size=4, max_num_batched_tokens=64, num_kv_blocks=200)
    engine, allocator = DrivenEngine(llm.engine, llm.runner), llm.allocator
    prompt = sample_prompts(model_dir, n=8)[5]  # 50 tokens: 12 full blocks and a partial one
    sp = SamplingParams(temperature=1.0, seed=7, max_tokens=12, n=4)
    parent = engine.add_request("r", prompt, sp)
    engine.step()  # the prompt, once
    samples = [engine.request(f"r#{i}") for i in (1, 2, 3)]
    shared = allocator.block_ids(parent.seq_id)[: len(prompt) // 4]
    for sample in samples:
        assert allocator.block_ids(sample.seq_id)[:-1] == shared
        assert allocator.block_ids(sample.seq_id)[-1] != allocator.block_ids(parent.seq_id)[-1]  # copied
    assert [allocator._ref_counts[b] for b in shared] == [4] * len(shared)
    allocator.check_integrity()
    while engine.has_unfinished():
        engine.step()
    engine.drain()
    assert_all_free(llm)

    # the same through generate: each sample streams and finishes with its own usage; seeded runs
    # are identical and the samples differ from each other
    first = llm.generate([prompt], sp)[0]
    again = llm.generate([prompt], sp)[0]
    assert [s.index for s in first.samples] == [0, 1, 2, 3]
    assert [s.token_ids for s in first.samples] == [s.token_ids for s in again.samples]
    assert len({tuple(s.token_ids) for s in first.samples}) == 4
    for s in first.samples:
        assert s.usage.completion_tokens == len(s.token_ids) and s.usage.prompt_tokens == len(prompt)
    assert_all_free(llm)


@pytest.mark.parametrize("overlap", [False, True])
def test_n_greedy_samples_equal_one_greedy_run_under_preemption(model_dir, overlap):
    """Greedy samples are all the plain greedy continuation, whatever forks, copies and
    preemptions happen (tight blocks, several requests with n > 1 in one batch)."""
    prompts = sample_prompts(model_dir, n=6)
    llm = LLM(model_dir, block_size=4, max_num_batched_tokens=32, num_kv_blocks=90)
    plain = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, n=1 + i % 3) for i in range(len(prompts))]
    if overlap:
        outs = run_n(llm, prompts, params)
    else:
        outs = [[s.token_ids for s in (o.samples or [o])] for o in llm.generate(prompts, params)]
    assert llm.engine.scheduler.num_preemptions > 0
    for i, (p, samples) in enumerate(zip(plain, outs)):
        assert samples == [p.token_ids] * params[i].n
    assert_all_free(llm)


def run_n(llm, prompts, params):
    engine = DrivenEngine(llm.engine, llm.runner)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"q{i}", p, sp)
    link = ImmediateLink(llm.runner)
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished() or engine.num_in_flight:
        for out in engine.pipeline_step(link, 2):
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
    engine.drain()
    return [[tokens[f"q{i}" + (f"#{j}" if j else "")] for j in range(sp.n)] for i, sp in enumerate(params)]
