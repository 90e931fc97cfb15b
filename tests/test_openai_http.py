"""The OpenAI-compatible HTTP door and /metrics, driven by the official ``openai`` client, against
a worker, a scheduler core and two API servers running as separate processes: what it answers
equals what gRPC answers (texts, token ids, logprobs, samples, structured output, echo), and the
metrics count it. What it refuses is in test_openai_http_refusals.py."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagewire_common.v1 import generation_pb2 as pb
from tests.openai_stack import (
    PROMPTS,
    assert_all_blocks_free,
    client,
    grpc_text,
    http_json,
    open_stack,
)
from tests.service_utils import sampling, stub, wait_until

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    yield from open_stack(tiny_model_dir("llama-gqa"), tmp_path_factory.mktemp("http"))


def test_completions_text_equals_grpc_streamed_and_not(stack):
    addr, url, model = stack
    c = client(url)
    for prompt in PROMPTS:
        expected, ids = grpc_text(addr, prompt, 12)
        whole = c.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)
        assert whole.choices[0].text == expected
        assert whole.object == "text_completion" and whole.model == model
        assert whole.choices[0].finish_reason in ("stop", "length")
        assert whole.usage.completion_tokens == len(ids)
        assert whole.usage.total_tokens == whole.usage.prompt_tokens + len(ids)
        chunks = list(c.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                           stream_options={"include_usage": True}))
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == expected
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ids)
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == whole.choices[0].finish_reason
    assert_all_blocks_free(addr)


def test_chat_completions_text_equals_grpc_chat(stack):
    addr, url, model = stack
    c = client(url)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "say something"}]
    responses = list(stub(addr).Chat(pb.ChatRequest(
        messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages],
        sampling=sampling(max_tokens=10))))
    expected = "".join(r.text for r in responses)
    whole = c.chat.completions.create(model=model, messages=messages, max_tokens=10, temperature=0)
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == expected
    assert whole.usage.prompt_tokens == responses[-1].usage.prompt_tokens
    chunks = list(c.chat.completions.create(model=model, messages=messages, max_completion_tokens=10, temperature=0,
                                            stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == expected
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_chat_continues_the_final_message_when_asked(stack):
    """continue_final_message with add_generation_prompt false: the rendering ends inside the final
    (assistant) message, and the answer is what Generate gives for that prompt."""
    addr, url, model = stack
    messages = [{"role": "user", "content": "say something"}, {"role": "assistant", "content": "Well, the"}]
    options = {"add_generation_prompt": False, "continue_final_message": True}
    status, tokenized = http_json(url, "/tokenize", {"model": model, "messages": messages, **options})
    assert status == 200, tokenized
    chat = [pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages]
    rendered = stub(addr).Tokenize(pb.TokenizeRequest(messages=chat, **options))
    assert rendered.prompt.endswith("Well, the") and tokenized["tokens"] == list(rendered.token_ids)
    expected, _ = grpc_text(addr, rendered.prompt, 8)
    out = client(url).chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0,
                                              extra_body=options)
    assert out.choices[0].message.content == expected
    assert out.usage.prompt_tokens == len(rendered.token_ids)
    # after the final message instead: the rendering without the assistant's opening
    status, ended = http_json(url, "/tokenize", {"model": model, "messages": messages, "add_generation_prompt": False})
    assert status == 200 and len(ended["tokens"]) > len(tokenized["tokens"])


def test_token_ids_and_prompt_lists_are_choices(stack):
    addr, url, model = stack
    c = client(url)
    expected = [grpc_text(addr, p, 6)[0] for p in PROMPTS[:3]]
    out = c.completions.create(model=model, prompt=PROMPTS[:3], max_tokens=6, temperature=0)
    assert [ch.index for ch in out.choices] == [0, 1, 2]
    assert [ch.text for ch in out.choices] == expected
    streamed: dict[int, str] = {}
    for ch in c.completions.create(model=model, prompt=PROMPTS[:3], max_tokens=6, temperature=0, stream=True):
        for choice in ch.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert [streamed[i] for i in range(3)] == expected
    _, ids = grpc_text(addr, PROMPTS[0], 6)
    prompt_ids = list(stub(addr).Generate(pb.GenerateRequest(prompt=PROMPTS[0], sampling=sampling(max_tokens=1))))
    n_prompt = prompt_ids[-1].usage.prompt_tokens
    status, tok = http_json(url, "/tokenize", {"prompt": PROMPTS[0]})
    assert status == 200 and tok["count"] == n_prompt == len(tok["tokens"])
    by_ids = c.completions.create(model=model, prompt=tok["tokens"], max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == expected[0]
    status, detok = http_json(url, "/detokenize", {"tokens": tok["tokens"]})
    assert status == 200 and detok["prompt"] == PROMPTS[0]


def test_logprobs_match_grpc(stack):
    addr, url, model = stack
    responses = list(stub(addr).Generate(pb.GenerateRequest(prompt=PROMPTS[1], sampling=sampling(max_tokens=5, logprobs=True))))
    expected = [lp for r in responses for lp in r.logprobs]
    out = client(url).chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                              temperature=0, logprobs=True)
    assert len(out.choices[0].logprobs.content) == out.usage.completion_tokens
    assert all(e.logprob <= 0 for e in out.choices[0].logprobs.content)
    legacy = client(url).completions.create(model=model, prompt=PROMPTS[1], max_tokens=5, temperature=0, logprobs=0)
    assert legacy.choices[0].logprobs.token_logprobs == pytest.approx(expected, abs=1e-5)
    assert "".join(legacy.choices[0].logprobs.tokens) == legacy.choices[0].text


def test_echo_gives_the_prompt_and_its_logprobs_as_log_likelihood_clients_ask(stack):
    """echo (completions): each choice starts with its prompt; with logprobs the prompt's tokens
    come with theirs (the first has none), as gRPC's prompt logprobs give them; with max_tokens 0
    the prompt alone (lm-eval's log-likelihood requests: echo, logprobs, max_tokens 0)."""
    addr, url, model = stack
    ids = [300 + i for i in range(9)]
    ids[4] = 1  # a special token: the echoed text names it, as its logprobs entry does
    params = sampling(max_tokens=1)
    params.prompt_logprobs = 1
    responses = list(stub(addr).Generate(pb.GenerateRequest(prompt_token_ids=ids, sampling=params)))
    expected = list(responses[0].prompt_logprobs)
    status, answer = http_json(url, "/v1/completions", {"model": model, "prompt": ids, "echo": True, "logprobs": 1,
                                                        "max_tokens": 0, "temperature": 0})
    assert status == 200, answer
    choice = answer["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx(expected, abs=1e-5)
    assert all(len(top) >= 1 for top in lp["top_logprobs"][1:])
    assert lp["text_offset"][0] == 0 and choice["finish_reason"] == "length"
    assert choice["text"] == "".join(lp["tokens"])
    assert answer["usage"]["completion_tokens"] == 0 and answer["usage"]["prompt_tokens"] == len(ids)
    # with tokens to generate: the prompt, then what the same request without echo answers
    plain = client(url).completions.create(model=model, prompt=PROMPTS[0], max_tokens=6, temperature=0)
    echoed = client(url).completions.create(model=model, prompt=PROMPTS[0], max_tokens=6, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPTS[0] + plain.choices[0].text
    streamed = client(url).completions.create(model=model, prompt=PROMPTS[0], max_tokens=6, temperature=0, echo=True,
                                              stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == echoed.choices[0].text
    for body, param in (({"prompt": "x", "echo": True, "n": 2}, "echo"),):
        status, answer = http_json(url, "/v1/completions", {"model": model, **body})
        assert status == 400 and answer["error"]["param"] == param, answer
    status, answer = http_json(url, "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "x"}],
                                                             "echo": True})
    assert status == 400 and answer["error"]["param"] == "echo"
    assert_all_blocks_free(addr)


def test_stop_strings_are_cut_or_kept_with_include_stop_str_in_output(stack):
    addr, url, model = stack
    c = client(url)
    text, _ = grpc_text(addr, PROMPTS[2], 16)
    stop = text[len(text) // 2 :][:3]
    assert len(stop) == 3, text
    cut = c.completions.create(model=model, prompt=PROMPTS[2], max_tokens=16, temperature=0, stop=[stop])
    assert cut.choices[0].text == text[: text.index(stop)] and cut.choices[0].finish_reason == "stop"
    kept_text = text[: text.index(stop) + len(stop)]
    for stream in (False, True):
        out = c.completions.create(model=model, prompt=PROMPTS[2], max_tokens=16, temperature=0, stop=stop,
                                   stream=stream, extra_body={"include_stop_str_in_output": True})
        chunks = list(out) if stream else [out]
        assert "".join(ch.choices[0].text for ch in chunks) == kept_text
        assert chunks[-1].choices[0].finish_reason == "stop"
    assert_all_blocks_free(addr)


def test_chat_min_tokens_without_max_tokens(stack):
    addr, url, model = stack
    status, answer = http_json(url, "/v1/chat/completions", {"model": model, "min_tokens": 5,
                                                              "messages": [{"role": "user", "content": "hi"}]})
    assert status == 200, answer
    assert answer["usage"]["completion_tokens"] >= 5


def test_models_and_health(stack):
    addr, url, model = stack
    models = client(url).models.list()
    assert [m.id for m in models.data] == [model]
    assert http_json(url, "/health")[0] == 200


def test_client_disconnect_frees_blocks(stack):
    addr, url, model = stack
    c = client(url)
    stream = c.completions.create(model=model, prompt=PROMPTS[3], max_tokens=200, temperature=0, stream=True,
                                  extra_body={"ignore_eos": True})
    first = next(iter(stream))
    assert first.choices[0].text is not None
    assert stub(addr).GetStats(pb.StatsRequest()).num_running == 1
    stream.close()  # the connection goes away mid-stream
    assert_all_blocks_free(addr)
    aborted = stub(addr).GetStats(pb.StatsRequest()).num_requests_aborted
    assert aborted >= 1


def _scrape(url: str, model: str) -> dict[tuple[str, tuple], float]:
    """One scrape's values by (sample name, labels but the model's name), which must be ``model``
    on every sample: no family has a series of another, or of an empty, ``model_name``."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    values = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            assert s.labels.get("model_name") == model, (s.name, s.labels)
            values[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name")))] = s.value
    return values


def test_metrics_count_known_requests_across_two_api_servers(stack):
    addr, url, model = stack
    time.sleep(0.3)  # let requests of earlier tests settle their counters
    before = _scrape(url, model)
    c = client(url)
    sent_prompt = sent_completion = 0
    for i in range(6):  # new connections: the kernel spreads them over both API servers
        cli = client(url)
        out = cli.completions.create(model=model, prompt=f"{PROMPTS[i % 4]} {i}", max_tokens=5 + i, temperature=0,
                                     extra_body={"ignore_eos": True})
        sent_prompt += out.usage.prompt_tokens
        sent_completion += out.usage.completion_tokens
        assert out.usage.completion_tokens == 5 + i
    # one over gRPC counts too
    responses = list(stub(addr).Generate(pb.GenerateRequest(prompt="metrics over grpc", sampling=sampling(max_tokens=4, ignore_eos=True))))
    sent_prompt += responses[-1].usage.prompt_tokens
    sent_completion += 4
    del c

    def moved():
        after = _scrape(url, model)
        return after if after[("pagewire:generation_tokens_total", ())] - before.get(("pagewire:generation_tokens_total", ()), 0) == sent_completion else None

    after = wait_until(moved, timeout=5)
    # scrapes on new connections reach either API server: each reports the same totals
    key = ("pagewire:generation_tokens_total", ())
    assert {_scrape(url, model)[key] for _ in range(8)} == {after[key]}
    delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
    assert delta[("pagewire:prompt_tokens_total", ())] == sent_prompt
    assert delta[("pagewire:request_success_total", (("finished_reason", "length"),))] == 7
    assert delta[("pagewire:time_to_first_token_seconds_count", ())] == 7
    assert delta[("pagewire:e2e_request_latency_seconds_count", ())] == 7
    assert delta[("pagewire:request_queue_time_seconds_count", ())] == 7
    assert delta[("pagewire:inter_token_latency_seconds_count", ())] == sent_completion - 7
    stats = stub(addr).GetStats(pb.StatsRequest())
    core = (("engine", "0"),)  # the one core's series
    assert after[("pagewire:num_requests_running", core)] == 0
    assert after[("pagewire:num_preemptions_total", core)] == stats.num_preemptions
    assert after[("pagewire:prefix_cache_queries_total", core)] == stats.num_prefix_cache_queried_tokens > 0
    assert after[("pagewire:prefix_cache_hits_total", core)] == stats.num_prefix_cache_hit_tokens
    assert 0 <= after[("pagewire:kv_cache_usage_perc", core)] <= 1


def controls(**kw) -> pb.SamplingParams:
    """Any SamplingParams field as protobuf (greedy unless given)."""
    from pagewire import SamplingParams
    from pagewire_common import wire

    return wire.sampling_to_pb(SamplingParams(**{"temperature": 0.0, **kw}))


def test_n_samples_are_choices_with_their_own_usage(stack):
    addr, url, model = stack
    c = client(url)
    kw = dict(model=model, prompt=PROMPTS[0], max_tokens=8, temperature=1.0, seed=7, n=3)
    first = c.completions.create(**kw)
    again = c.completions.create(**kw)
    assert [ch.index for ch in first.choices] == [0, 1, 2]
    assert [ch.text for ch in first.choices] == [ch.text for ch in again.choices]  # seeded: reproducible
    assert len({ch.text for ch in first.choices}) > 1  # the samples differ from each other
    responses = list(stub(addr).Generate(pb.GenerateRequest(prompt=PROMPTS[0], sampling=controls(
        max_tokens=8, temperature=1.0, seed=7, n=3))))
    grpc_texts = ["".join(r.text for r in responses if r.index == i) for i in range(3)]
    assert [ch.text for ch in first.choices] == grpc_texts
    prompt_tokens = responses[-1].usage.prompt_tokens
    assert first.usage.prompt_tokens == prompt_tokens  # the prompt is counted once
    assert first.usage.completion_tokens == sum(r.usage.completion_tokens for r in responses if r.HasField("usage"))
    streamed: dict[int, str] = {}
    finished = set()
    for chunk in c.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            streamed[ch.index] = streamed.get(ch.index, "") + ch.text
            if ch.finish_reason:
                finished.add(ch.index)
    assert [streamed[i] for i in range(3)] == grpc_texts and finished == {0, 1, 2}
    assert_all_blocks_free(addr)


def test_top_logprobs_match_grpc(stack):
    addr, url, model = stack
    responses = list(stub(addr).Generate(pb.GenerateRequest(prompt=PROMPTS[2], sampling=controls(
        max_tokens=4, logprobs=True, top_logprobs=3))))
    tops = [t for r in responses for t in r.top_logprobs]
    out = client(url).completions.create(model=model, prompt=PROMPTS[2], max_tokens=4, temperature=0, logprobs=3)
    legacy = out.choices[0].logprobs
    assert len(legacy.top_logprobs) == len(tops) == 4
    for alts, t in zip(legacy.top_logprobs, tops):
        assert sorted(alts.values(), reverse=True) == pytest.approx(list(t.logprobs), abs=1e-5)
    chat = client(url).chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                               temperature=0, logprobs=True, top_logprobs=2)
    for entry in chat.choices[0].logprobs.content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-5)  # greedy: the best one


def test_penalties_and_bias_reach_the_sampler(stack):
    addr, url, model = stack
    plain = client(url).completions.create(model=model, prompt=PROMPTS[1], max_tokens=6, temperature=0,
                                           extra_body={"return_token_ids": True})
    first = plain.choices[0].model_extra["token_ids"][0]
    biased = client(url).completions.create(model=model, prompt=PROMPTS[1], max_tokens=6, temperature=0,
                                            logit_bias={str(first): -100}, extra_body={"return_token_ids": True})
    assert biased.choices[0].model_extra["token_ids"][0] != first
    responses = list(stub(addr).Generate(pb.GenerateRequest(prompt=PROMPTS[1], sampling=controls(
        max_tokens=6, repetition_penalty=1.5, min_tokens=6))))
    expected = [t for r in responses for t in r.token_ids]
    out = client(url).completions.create(model=model, prompt=PROMPTS[1], max_tokens=6, temperature=0,
                                         extra_body={"repetition_penalty": 1.5, "min_tokens": 6, "return_token_ids": True})
    assert out.choices[0].model_extra["token_ids"] == expected


def test_response_format_and_guided_fields_constrain_the_output(stack):
    import re

    from tests.test_structured_output import SCHEMA, check_schema

    addr, url, model = stack
    chat = client(url).chat.completions.create(
        model=model, messages=[{"role": "user", "content": "a record"}], max_tokens=80, temperature=1.0, seed=3,
        response_format={"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA}})
    assert chat.choices[0].finish_reason == "stop"
    check_schema(json.loads(chat.choices[0].message.content), SCHEMA)
    regex = r"[a-z]{3,8}@[a-z]{2,6}\.(com|org)"
    out = client(url).completions.create(model=model, prompt=PROMPTS[2], max_tokens=40, temperature=1.0, seed=4,
                                         extra_body={"guided_regex": regex})
    assert out.choices[0].finish_reason == "stop" and re.fullmatch(regex, out.choices[0].text)
    # vLLM's choices: the old field and the structured_outputs object, strings JSON would escape too
    choices = ["yes", "no", 'a "quoted" (b|c)\n', "日本 🎉"]
    for seed in range(4):
        for extra in ({"guided_choice": choices}, {"structured_outputs": {"choice": choices}}):
            out = client(url).completions.create(model=model, prompt=PROMPTS[seed], max_tokens=20, temperature=1.0,
                                                 seed=seed, extra_body=extra)
            assert out.choices[0].finish_reason == "stop" and out.choices[0].text in choices, out.choices[0].text
    out = client(url).completions.create(model=model, prompt=PROMPTS[0], max_tokens=40, temperature=1.0, seed=5,
                                         extra_body={"structured_outputs": {"regex": regex}})
    assert out.choices[0].finish_reason == "stop" and re.fullmatch(regex, out.choices[0].text)
    assert_all_blocks_free(addr)


def test_special_tokens_are_named_in_logprobs(stack):
    """EOS streams no text, but its logprobs entry names it, as vLLM's does."""
    addr, url, model = stack
    info = stub(addr).GetModelInfo(pb.ModelInfoRequest())
    eos = info.eos_token_ids[0]
    status, answer = http_json(url, "/v1/completions", {"model": model, "prompt": "x", "max_tokens": 3, "logprobs": 0,
                                                        "logit_bias": {str(eos): 100}, "return_token_ids": True})
    assert status == 200, answer
    choice = answer["choices"][0]
    assert choice["token_ids"] == [eos] and choice["finish_reason"] == "stop" and choice["text"] == ""
    (name,) = choice["logprobs"]["tokens"]
    assert name and name.startswith("<") and name.endswith(">"), name
