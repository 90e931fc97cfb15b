"""What the OpenAI-compatible HTTP door refuses, and how: every bad body, value or limit is an
OpenAI-shaped error with the right HTTP status (400, 404, 429), the core counts it, and the
server goes on; against the same stack of separate processes as test_openai_http.py."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import grpc
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagewire_common.sampling import MAX_STOP_CHARS, MAX_STOP_STRINGS
from pagewire_common.v1 import generation_pb2 as pb
from tests.openai_stack import (
    PROMPTS,
    assert_all_blocks_free,
    client,
    http_json,
    open_stack,
)
from tests.service_utils import sampling, stub, wait_until

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    yield from open_stack(tiny_model_dir("llama-gqa"), tmp_path_factory.mktemp("http"))


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
    ({"prompt": "x", "include_stop_str_in_output": "yes"}, "include_stop_str_in_output"),
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
        # an integer of more digits than Python converts (in a known field or not)
        status, answer = http_json(url, path, b'{"prompt": "hi", "max_tokens": 1' + b"0" * 5000 + b"}")
        assert status == 400 and "an integer of more than 4,300 digits" in answer["error"]["message"], answer
    # a body that says it is gzip and is not
    req = urllib.request.Request(url + "/v1/completions", data=b"\x1f\x8bnot gzip", method="POST",
                                 headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(req, timeout=30)
    answer = json.loads(refused.value.read())
    assert refused.value.code == 400 and answer["error"]["message"].startswith("the request body could not be read")
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
    is not counted as an aborted request in the metrics); nor are the prompts the core took of a
    request it refused whole for a full queue."""
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

    # more prompts than the batch (8) and the queue (4) hold: the core takes twelve and refuses
    # the thirteenth, so the request is refused whole (429) and the twelve it took are aborted,
    # not counted as finished requests
    status, answer = http_json(url, "/v1/completions", {"model": model, "prompt": [f"p{i}" for i in range(20)],
                                                        "max_tokens": 40, "ignore_eos": True})
    assert status == 429, answer
    assert aborted() == before
    assert_all_blocks_free(addr)
    # as many as fit are taken together, even by an idle engine
    status, answer = http_json(url, "/v1/completions", {"model": model, "prompt": [f"p{i}" for i in range(12)],
                                                        "max_tokens": 2})
    assert status == 200 and len(answer["choices"]) == 12, answer


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
    functions = [tool["function"] for tool in tools]
    for extra, param in (({"tools": tools}, "tools"), ({"tools": tools, "tool_choice": "auto"}, "tools"),
                         ({"functions": functions}, "functions"), ({"modalities": ["text", "audio"]}, "modalities"),
                         # continuing the final message needs add_generation_prompt false, as vLLM says
                         ({"continue_final_message": True}, "continue_final_message"),
                         ({"add_generation_prompt": "no"}, "add_generation_prompt"),
                         # a call asked for with nothing to call (OpenAI's 400 too)
                         ({"tool_choice": "required"}, "tool_choice"),
                         ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
                         ({"function_call": {"name": "f"}}, "function_call"),
                         # vLLM's fields that would change the output
                         ({"allowed_token_ids": [13, 30]}, "allowed_token_ids"), ({"bad_words": [" x"]}, "bad_words"),
                         ({"truncate_prompt_tokens": 2}, "truncate_prompt_tokens"),
                         ({"use_beam_search": True}, "use_beam_search"), ({"length_penalty": 0.5}, "length_penalty"),
                         ({"skip_special_tokens": False}, "skip_special_tokens")):
        status, answer = http_json(url, "/v1/chat/completions", {**chat, **extra})
        assert status == 400 and answer["error"]["param"] == param, answer
    for fine in ({"tools": tools, "tool_choice": "none"}, {"functions": functions, "function_call": "none"},
                 {"modalities": ["text"]}, {"tool_choice": "none"}, {"tool_choice": "auto"}, {"function_call": "auto"},
                 {"use_beam_search": False, "skip_special_tokens": True, "allowed_token_ids": None, "bad_words": [],
                  "length_penalty": 1.0, "truncate_prompt_tokens": None}):
        status, answer = http_json(url, "/v1/chat/completions", {**chat, **fine})
        assert status == 200, (fine, answer)


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


def test_grpc_errors_still_grpc(stack):
    addr, url, model = stack
    with pytest.raises(grpc.RpcError) as err:
        list(stub(addr).Generate(pb.GenerateRequest(prompt="x", sampling=sampling(max_tokens=10**6))))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("extra, param", [
    ({"presence_penalty": -3.0}, "presence_penalty"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"logit_bias": {"999999": 1.0}}, None),  # the core's vocabulary check
    ({"min_tokens": 9}, "min_tokens"),
    # values the engine's 32-bit floats would turn into 0 or infinity
    ({"top_p": 1e-300}, "top_p"),
    ({"repetition_penalty": 1e300}, "repetition_penalty"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}, None),
    ({"guided_regex": "(unclosed"}, None),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, None),
])
def test_bad_sampling_controls_are_400_naming_the_field(stack, extra, param):
    addr, url, model = stack
    status, answer = http_json(url, "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "x"}],
                                                              "max_tokens": 4, **extra})
    assert status == 400, answer
    assert answer["error"]["type"] == "invalid_request_error" and answer["error"]["message"]
    if param is not None:
        assert answer["error"]["param"] == param, answer
        assert answer["error"]["message"].startswith(param) and "got 0.0" not in answer["error"]["message"], answer
    assert_all_blocks_free(addr)


@pytest.mark.parametrize("parser_says, looks_like", [
    ("Pause on PRI/Upgrade:\n  b'\\x00\\x00'", "an HTTP/2 client, gRPC?, on the HTTP/1 port"),
    ("Invalid method encountered:\n\n  b'\\x16\\x03\\x01'", "not HTTP: a TLS client on a plaintext port?"),
    ("Duplicate Content-Length:", "a malformed HTTP request"),
])
def test_requests_that_do_not_parse_log_one_warning_line_saying_what_they_look_like(parser_says, looks_like):
    """A gRPC client pointed at the HTTP port, a TLS hello, a malformed request: aiohttp's error and
    its parser's traceback become one line."""
    import logging
    import sys

    from aiohttp.http_exceptions import BadHttpMessage

    from scheduler_svc.api.http_server import _UnreadableRequests

    try:
        raise BadHttpMessage(parser_says)
    except BadHttpMessage:
        record = logging.LogRecord("aiohttp.server", logging.ERROR, __file__, 1, "Error handling request from %s",
                                   ("127.0.0.1",), sys.exc_info())
    assert _UnreadableRequests().filter(record)
    assert record.levelname == "WARNING" and record.exc_info is None
    assert logging.Formatter().format(record) == (f"Error handling request from 127.0.0.1 ({looks_like}): 400 "
                                                  f"{parser_says.splitlines()[0]}")


def test_a_client_gone_between_two_writes_ends_the_stream_quietly(monkeypatch, caplog):
    """Under load a client's disconnect can reach a write before aiohttp cancels the handler: the
    write raises, and aiohttp would log an error with a traceback for each such stream."""
    import asyncio
    import logging
    from types import SimpleNamespace

    from aiohttp import ClientConnectionResetError, web

    from pagewire_common.requests import TextDelta
    from scheduler_svc.api import http_server
    from scheduler_svc.api.openai_protocol import parse

    class Request:  # an ApiRequest's iteration: two deltas
        def __aiter__(self):
            return self._deltas()

        async def _deltas(self):
            yield [TextDelta("r", [5], "a")]
            yield [TextDelta("r", [6], "b")]

    writes = []

    async def write(self, data):
        writes.append(data)
        raise ClientConnectionResetError("Cannot write to closing transport")

    async def prepare(self, request):
        return None

    monkeypatch.setattr(web.StreamResponse, "prepare", prepare)
    monkeypatch.setattr(web.StreamResponse, "write", write)
    parsed = parse({"model": "m", "prompt": "x", "stream": True}, chat=False)
    model = SimpleNamespace(info=SimpleNamespace(model_name="m"), tokenizer=None)
    answer = http_server._Answer(parsed, [Request()], model)
    with caplog.at_level(logging.DEBUG, logger="pagewire.http"):
        resp = asyncio.run(answer.stream(object()))
    assert isinstance(resp, web.StreamResponse) and len(writes) == 1
    assert "client left the stream" in caplog.text
