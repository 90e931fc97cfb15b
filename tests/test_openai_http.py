"""The OpenAI-compatible HTTP door and /metrics, driven by the official ``openai`` client, against
a worker, a scheduler core and two API servers running as separate processes."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import grpc
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagewire_common.sampling import MAX_STOP_CHARS, MAX_STOP_STRINGS
from pagewire_common.v1 import generation_pb2 as pb
from tests.service_utils import sampling, start_scheduler, start_worker, stub, wait_until

pytestmark = pytest.mark.slow

PROMPTS = ["the quick brown fox", "hello world, this is", "once upon a time in", "numbers: 1 2 3"]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama-gqa")


@pytest.fixture(scope="module")
def stack(model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("http")
    worker, worker_addr = start_worker(model_dir, tmp, extra=["--block-size", "4", "--num-kv-blocks", "400"])
    sched, addr = start_scheduler(worker_addr, tmp, extra=["--api-servers", "2", "--max-num-batched-tokens", "64",
                                                           "--max-num-seqs", "8", "--max-queued-requests", "4"])
    url = sched.http_url()
    model = stub(addr).GetModelInfo(pb.ModelInfoRequest()).model_name
    yield addr, url, model
    sched.stop()
    worker.stop()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def grpc_text(addr: str, prompt: str, max_tokens: int) -> tuple[str, list[int]]:
    responses = list(stub(addr).Generate(pb.GenerateRequest(prompt=prompt, sampling=sampling(max_tokens=max_tokens))))
    return "".join(r.text for r in responses), [t for r in responses for t in r.token_ids]


def http_json(url: str, path: str, body=None, method: str | None = None) -> tuple[int, dict | str]:
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    req = urllib.request.Request(url + path, data=data, method=method or ("POST" if data is not None else "GET"),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            raw = r.read().decode()
            status = r.status
    except urllib.error.HTTPError as e:
        raw, status = e.read().decode(), e.code
    try:
        return status, json.loads(raw)
    except json.JSONDecodeError:
        return status, raw


def assert_all_blocks_free(addr):
    def done():
        s = stub(addr).GetStats(pb.StatsRequest())
        return s.num_running == 0 and s.num_waiting == 0 and s.num_free_blocks == s.num_total_blocks and s

    return wait_until(done, timeout=10)


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


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "max_tokens": 0}, None),
    ({"prompt": "x", "temperature": -1}, None),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "top_p": 0}, None),
    ({"prompt": "x", "max_tokens": 100000}, None),
    ({"prompt": [1, 2, 10**7]}, None),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "stop": 5}, "stop"),
    ({"prompt": "x", "stop": ["x" * MAX_STOP_CHARS, "y"]}, "stop"),
    ({"prompt": "x", "prompt_logprobs": 1}, "prompt_logprobs"),
    ({}, "prompt"),
    ({"prompt": "x", "guided_choice": []}, "guided_choice"),
    ({"prompt": "x", "guided_choice": ["a", 3]}, "guided_choice"),
    ({"prompt": "x", "guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
    ({"prompt": "x", "response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs"),
    ({"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"prompt": "x", "structured_outputs": {"structural_tag": "{}"}}, "structured_outputs"),
    ({"prompt": "x", "include_stop_str_in_output": True}, "include_stop_str_in_output"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
])
def test_bad_input_is_400_with_the_openai_error_shape(stack, body, param):
    addr, url, model = stack
    before = stub(addr).GetStats(pb.StatsRequest()).num_requests_rejected
    status, answer = http_json(url, "/v1/completions", {"model": model, **body})
    assert status == 400, answer
    assert set(answer["error"]) == {"message", "type", "param", "code"} and answer["error"]["message"]
    assert answer["error"]["type"] == "invalid_request_error"
    if param:
        assert answer["error"]["param"] == param
    # the API server that refused it tells the core in its next message (GetStats may reach the other one)
    assert wait_until(lambda: stub(addr).GetStats(pb.StatsRequest()).num_requests_rejected == before + 1, timeout=5)
    if "prompt" in body:  # the SDK itself insists on a prompt; vLLM's extensions go in extra_body
        extra = {k: body[k] for k in ("prompt_logprobs", "guided_choice", "guided_regex", "structured_outputs",
                                      "include_stop_str_in_output", "response_format") if k in body}
        sdk = {k: v for k, v in body.items() if k not in extra}
        with pytest.raises(openai.BadRequestError):
            client(url).completions.create(**{"model": model, **sdk}, extra_body=extra or None)


# each of these once wedged the API server that took it: its add failed to encode in the message
# to the core, and with it the writer of every later message
@pytest.mark.parametrize("extra,words", [
    ({"stop": ["\ud83d"]}, "stop: lone surrogate"),
    ({"prompt": "half an emoji \ud83d"}, "prompt: lone surrogate"),
    ({"top_k": 2**40}, "top_k"),
    ({"stop_token_ids": [2**40]}, "stop_token_ids"),
    ({"stop_token_ids": [10**6], "min_tokens": 2}, "outside the vocabulary"),
    ({"max_tokens": 2**40}, "max_tokens"),
])
def test_values_the_wire_cannot_carry_are_400_and_the_server_goes_on(stack, extra, words):
    addr, url, model = stack
    status, answer = http_json(url, "/v1/completions", {"model": model, "prompt": "x", "max_tokens": 3, **extra})
    assert status == 400, answer
    message = answer["error"]["message"]
    assert all(w.strip() in message for w in words.split(":")), message
    assert_all_blocks_free(addr)
    for _ in range(4):  # both API servers still reach the core
        status, answer = http_json(url, "/v1/completions", {"model": model, "prompt": "x", "max_tokens": 3})
        assert status == 200 and answer["choices"][0]["finish_reason"] == "length", answer


def test_bodies_that_are_not_plain_json_objects_are_400(stack):
    addr, url, model = stack
    deep = b'{"prompt":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    for path in ("/v1/completions", "/tokenize"):
        status, answer = http_json(url, path, deep)
        assert status == 400 and "nests too deeply" in answer["error"]["message"], answer
    for path in ("/tokenize", "/detokenize"):
        for body in ([1, 2], None, "abc"):
            status, answer = http_json(url, path, json.dumps(body).encode())
            assert status == 400 and answer["error"]["message"] == "the request body must be a JSON object", answer
    status, answer = http_json(url, "/tokenize", {"prompt": "a\ud800b"})
    assert status == 400 and "prompt is not valid Unicode text" in answer["error"]["message"], answer
    status, answer = http_json(url, "/v1/chat/completions", {"model": model, "messages": [
        {"role": "user", "content": "\udfff"}]})
    assert status == 400 and "messages[0].content is not valid Unicode text" in answer["error"]["message"], answer
    # a surrogate pair is an emoji, not an error
    status, answer = http_json(url, "/tokenize", {"prompt": "\ud83d\ude00"})
    assert status == 200 and answer["count"] > 0, answer
    status, answer = http_json(url, "/v1/completions", {"model": model, "prompt": "x", "max_tokens": 2,
                                                        "logit_bias": {"5": True}})
    assert status == 400 and answer["error"]["param"] == "logit_bias", answer


def test_unknown_model_is_404_as_openai_answers(stack):
    addr, url, model = stack
    before = stub(addr).GetStats(pb.StatsRequest()).num_requests_rejected
    status, answer = http_json(url, "/v1/completions", {"model": "not-this-one", "prompt": "x"})
    assert status == 404 and answer["error"]["code"] == "model_not_found" and answer["error"]["param"] == "model"
    assert wait_until(lambda: stub(addr).GetStats(pb.StatsRequest()).num_requests_rejected == before + 1, timeout=5)
    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [5]})):
        status, answer = http_json(url, path, {"model": "not-this-one", **body})
        assert status == 404 and answer["error"]["code"] == "model_not_found", answer
        assert http_json(url, path, {"model": model, **body})[0] == 200
    status, answer = http_json(url, "/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]})
    assert status == 400 and "not both" in answer["error"]["message"], answer


def test_a_refused_prompt_of_several_runs_none_of_them(stack):
    """The second prompt is too long: the request is refused whole, and the first never ran (it
    is not counted as an aborted request in the metrics)."""
    addr, url, model = stack

    def aborted() -> float:
        families = text_string_to_metric_families(http_json(url, "/metrics")[1])
        return sum(s.value for f in families for s in f.samples
                   if s.name == "pagewire:request_success_total" and s.labels.get("finished_reason") == "abort")

    before = aborted()
    status, answer = http_json(url, "/v1/completions", {"model": model, "prompt": ["a", "x " * 3000], "max_tokens": 2})
    assert status == 400, answer
    assert aborted() == before
    assert_all_blocks_free(addr)


def test_prompts_that_could_never_start_without_a_queue_are_400_not_429():
    """--max-queued-requests 0 takes a request only when it can start at once: prompts whose samples
    together are more than max_num_seqs could never start, so they are refused as invalid (and
    counted), not told to retry; with a queue they wait their turn."""
    from types import SimpleNamespace

    from pagewire_common.sampling import SamplingParams
    from pagewire_common.v1 import core_pb2
    from scheduler_svc.api.request import CheckedRequest, RequestError, check_together

    rejected = []

    def api(**queue):
        info = core_pb2.CoreInfoResponse(max_num_seqs=4, **queue)
        return SimpleNamespace(model=SimpleNamespace(info=info), reject=lambda: rejected.append(1))

    two = [CheckedRequest("a", [1], SamplingParams(n=2)), CheckedRequest("b", [2], SamplingParams(n=3))]
    with pytest.raises(RequestError) as err:
        check_together(api(max_queued_requests=0), two)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "2 prompts make 5 sequences, more than max_num_seqs (4)" in err.value.message and rejected == [1]
    check_together(api(max_queued_requests=1), two)
    check_together(api(max_queued_requests=0), [two[0], CheckedRequest("c", [3], SamplingParams(n=2))])  # 4 fit
    assert rejected == [1]


def test_echo_gives_the_prompt_and_its_logprobs_as_log_likelihood_clients_ask(stack):
    """echo (completions): each choice starts with its prompt; with logprobs the prompt's tokens
    come with theirs (the first has none), as gRPC's prompt logprobs give them; with max_tokens 0
    the prompt alone (lm-eval's log-likelihood requests: echo, logprobs, max_tokens 0)."""
    addr, url, model = stack
    ids = [300 + i for i in range(9)]
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


def test_chat_min_tokens_without_max_tokens(stack):
    addr, url, model = stack
    status, answer = http_json(url, "/v1/chat/completions", {"model": model, "min_tokens": 5,
                                                              "messages": [{"role": "user", "content": "hi"}]})
    assert status == 200, answer
    assert answer["usage"]["completion_tokens"] >= 5


def test_ten_thousand_stop_strings_are_400_naming_the_limit(stack):
    addr, url, model = stack
    status, answer = http_json(url, "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "x"}],
                                                              "stop": [f"s{i}" for i in range(10_000)]})
    assert status == 400 and answer["error"]["param"] == "stop"
    assert answer["error"]["message"] == f"at most {MAX_STOP_STRINGS} stop strings are allowed, got 10000"


def test_bad_json_unknown_route_and_unknown_fields(stack):
    addr, url, model = stack
    status, answer = http_json(url, "/v1/completions", b"{not json")
    assert status == 400 and "JSON" in answer["error"]["message"]
    status, answer = http_json(url, "/v1/nothing-here")
    assert status == 404 and "error" in answer
    status, answer = http_json(url, "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "x"}],
                                                              "max_tokens": 3, "some_future_field": {"a": 1}, "user": "u1"})
    assert status == 200 and answer["choices"][0]["message"]["content"] is not None
    # known fields this server cannot honour are refused, not dropped
    chat = {"model": model, "messages": [{"role": "user", "content": "x"}], "max_tokens": 3}
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    for extra, param in (({"tools": tools}, "tools"), ({"tools": tools, "tool_choice": "auto"}, "tools"),
                         ({"continue_final_message": True}, "continue_final_message"),
                         ({"add_generation_prompt": False}, "add_generation_prompt")):
        status, answer = http_json(url, "/v1/chat/completions", {**chat, **extra})
        assert status == 400 and answer["error"]["param"] == param, answer
    status, answer = http_json(url, "/v1/chat/completions", {**chat, "tools": tools, "tool_choice": "none"})
    assert status == 200, answer


def test_models_and_health(stack):
    addr, url, model = stack
    models = client(url).models.list()
    assert [m.id for m in models.data] == [model]
    assert http_json(url, "/health")[0] == 200


def test_full_queue_is_429(stack):
    addr, url, model = stack
    # 8 running + 4 waiting fill the core; more requests at once are refused with 429, which the
    # official client raises as RateLimitError
    results: list[str] = []
    # the clients are built first and the requests leave together: built one by one as they went,
    # the first requests could finish before the last were sent, and the queue never filled
    clients = [client(url) for _ in range(24)]
    start = threading.Barrier(len(clients))

    def one(c):
        start.wait()
        try:
            c.completions.create(model=model, prompt=PROMPTS[2], max_tokens=40, temperature=0,
                                 extra_body={"ignore_eos": True})
            results.append("ok")
        except openai.RateLimitError as e:
            assert e.status_code == 429 and e.body["type"] == "rate_limit_error"
            results.append("429")

    threads = [threading.Thread(target=one, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 24 and "429" in results and "ok" in results, results
    assert_all_blocks_free(addr)


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


def test_grpc_errors_still_grpc(stack):
    addr, url, model = stack
    with pytest.raises(grpc.RpcError) as err:
        list(stub(addr).Generate(pb.GenerateRequest(prompt="x", sampling=sampling(max_tokens=10**6))))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


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


@pytest.mark.parametrize("extra", [
    {"presence_penalty": -3.0},
    {"repetition_penalty": -1.0},
    {"top_logprobs": 21, "logprobs": True},
    {"logit_bias": {"999999": 1.0}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
    {"guided_regex": "(unclosed"},
    {"response_format": {"type": "json_object"}, "guided_regex": "a+"},
])
def test_bad_sampling_controls_are_400(stack, extra):
    addr, url, model = stack
    status, answer = http_json(url, "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "x"}],
                                                              "max_tokens": 4, **extra})
    assert status == 400, answer
    assert answer["error"]["type"] == "invalid_request_error" and answer["error"]["message"]
    assert_all_blocks_free(addr)


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
