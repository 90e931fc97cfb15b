"""Tokenize, Detokenize and GetLoads through the Generation servicer, in process: an API server's
state with a real tokenizer and no core (the served round trip is in test_services.py)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest

from pagewire_common.v1 import core_pb2
from pagewire_common.v1 import generation_pb2 as pb
from scheduler_svc.api.server import GenerationServicer, ServedModel, core_load
from scheduler_svc.api.tokenizer import OffloadedTokenizer, Tokenizer

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about the sea."}]


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code = code
        self.details = details


class Context:
    """The part of a grpc.aio context the servicer uses: abort raises."""

    async def abort(self, code, details):
        raise Aborted(code, details)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return Tokenizer(tiny_model_dir("llama-gqa"))


def make_api(tokenizer: Tokenizer | None, *, connected: bool = True, inline_chars: int = 4096, stats=None,
             vocab_size: int | None = None):
    info = core_pb2.CoreInfoResponse(model_name="tiny", max_model_len=256,
                                     vocab_size=vocab_size or (tokenizer.vocab_size if tokenizer else 512))
    offloaded = OffloadedTokenizer(tokenizer, inline_chars) if tokenizer is not None else None
    event = asyncio.Event()
    if connected:
        event.set()

    async def get_stats():
        if isinstance(stats, Exception):
            raise stats
        return stats

    async def core_stats():  # one core, index 0
        return [(0, await get_stats())]

    return SimpleNamespace(model=ServedModel(info, tokenizer, offloaded), connected=event, core_connected=True,
                           was_connected=True, started_at=0.0, draining=False, stats=get_stats, core_stats=core_stats)


def call(api, method: str, request):
    async def main():
        return await getattr(GenerationServicer(api), method)(request, Context())

    return asyncio.run(main())


def status_of(api, method: str, request) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(Aborted) as err:
        call(api, method, request)
    return err.value.code, err.value.details


def chat_messages(messages):
    return [pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages]


def test_tokenize_and_detokenize_equal_the_tokenizers_own(tokenizer):
    api = make_api(tokenizer)
    text = "The sea is wide, and héllo wörld 🌊."
    reply = call(api, "Tokenize", pb.TokenizeRequest(prompt=text))
    assert list(reply.token_ids) == tokenizer.encode(text) and reply.num_tokens == len(reply.token_ids)
    assert reply.prompt == ""
    back = call(api, "Detokenize", pb.DetokenizeRequest(token_ids=reply.token_ids))
    assert back.text == tokenizer.decode(tokenizer.encode(text))


def test_tokenize_messages_renders_as_chat_does(tokenizer):
    api = make_api(tokenizer)
    reply = call(api, "Tokenize", pb.TokenizeRequest(messages=chat_messages(MESSAGES), model="tiny"))
    prompt = tokenizer.apply_chat_template(MESSAGES)  # what open_request gives Chat (with the generation prompt)
    assert reply.prompt == prompt and list(reply.token_ids) == tokenizer.encode(prompt)


def test_big_inputs_go_through_the_helper_with_the_same_result(tokenizer):
    api = make_api(tokenizer, inline_chars=16)
    text = "waves " * 40
    try:
        ids = call(api, "Tokenize", pb.TokenizeRequest(prompt=text)).token_ids
        assert list(ids) == tokenizer.encode(text)
        messages = [{"role": "user", "content": text}]
        assert call(api, "Tokenize", pb.TokenizeRequest(messages=chat_messages(messages))).prompt \
            == tokenizer.apply_chat_template(messages)
        assert len(ids) > 16 // 4
        assert call(api, "Detokenize", pb.DetokenizeRequest(token_ids=ids)).text == tokenizer.decode(list(ids))
        assert api.model.offloaded._pool is not None  # the helper process answered
    finally:
        api.model.offloaded.close()


@pytest.mark.parametrize("request_, fragment", [
    (pb.TokenizeRequest(), "both are empty"),
    (pb.TokenizeRequest(prompt="hi", messages=[pb.ChatMessage(role="user", content="hi")]), "not both"),
    (pb.TokenizeRequest(messages=[pb.ChatMessage(role="", content="hi")]), "non-empty role"),
    (pb.TokenizeRequest(prompt="hi", model="other"), "unknown model"),
    (pb.DetokenizeRequest(), "token_ids is empty"),
    (pb.DetokenizeRequest(token_ids=[1, 2, 10**6]), "token id 1000000 is outside the vocabulary"),
    (pb.DetokenizeRequest(token_ids=[1], model="other"), "unknown model"),
])
def test_bad_input_is_invalid_argument(tokenizer, request_, fragment):
    method = "Tokenize" if isinstance(request_, pb.TokenizeRequest) else "Detokenize"
    code, details = status_of(make_api(tokenizer), method, request_)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and fragment in details


def test_an_id_past_the_tokenizer_but_inside_the_models_vocabulary_decodes(tokenizer):
    api = make_api(tokenizer, vocab_size=tokenizer.vocab_size + 64)  # a padded embedding
    ids = [5, tokenizer.vocab_size + 3, 7]
    assert call(api, "Detokenize", pb.DetokenizeRequest(token_ids=ids)).text == tokenizer.decode(ids)


def test_no_tokenizer_or_no_chat_template_is_invalid_argument(tokenizer):
    api = make_api(None)
    for method, request_ in (("Tokenize", pb.TokenizeRequest(prompt="hi")),
                             ("Detokenize", pb.DetokenizeRequest(token_ids=[1]))):
        assert status_of(api, method, request_) == (grpc.StatusCode.INVALID_ARGUMENT, "this model has no tokenizer")
    no_template = Tokenizer.from_files(tokenizer.files)
    no_template.chat_template = None
    code, details = status_of(make_api(no_template), "Tokenize",
                              pb.TokenizeRequest(messages=chat_messages(MESSAGES)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "no chat template" in details
    assert call(make_api(no_template), "Tokenize", pb.TokenizeRequest(prompt="hi")).token_ids  # a prompt still works


def test_stop_strings_on_a_model_without_a_tokenizer_are_refused(tokenizer):
    """They are found in text, which such a model does not make: refused, not silently ignored."""
    from pagewire_common.sampling import SamplingParams
    from scheduler_svc.api.request import RequestError, check_request

    api = make_api(None)
    api.model.info.max_num_seqs = 8
    rejected = []
    api.reject = lambda: rejected.append(1)
    checked = asyncio.run(check_request(api, sampling=SamplingParams(stop_token_ids=[3]), prompt_token_ids=[1, 2]))
    assert checked.prompt_token_ids == [1, 2]
    with pytest.raises(RequestError) as err:
        asyncio.run(check_request(api, sampling=SamplingParams(stop=["x"]), prompt_token_ids=[1, 2]))
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "stop strings need the model's tokenizer" in err.value.message
    assert rejected == [1]


def test_worker_not_connected_is_unavailable(tokenizer):
    api = make_api(tokenizer, connected=False)
    assert status_of(api, "Tokenize", pb.TokenizeRequest(prompt="hi")) == (
        grpc.StatusCode.UNAVAILABLE, "the worker is not connected")
    assert status_of(api, "Detokenize", pb.DetokenizeRequest(token_ids=[1]))[0] == grpc.StatusCode.UNAVAILABLE
    api.model = None  # the core never reported a model
    assert status_of(api, "Tokenize", pb.TokenizeRequest(prompt="hi"))[0] == grpc.StatusCode.UNAVAILABLE


def test_loads_from_stats():
    stats = pb.Stats(num_total_blocks=600, num_free_blocks=550, num_running=3, num_waiting=2,
                     num_prefix_cache_queried_tokens=40, num_prefix_cache_hit_tokens=10)
    assert core_load(0, stats) == pb.CoreLoad(core=0, num_running=3, num_waiting=2, num_used_blocks=50,
                                              num_total_blocks=600, prefix_cache_hit_rate=0.25)
    assert core_load(0, pb.Stats(num_total_blocks=8, num_free_blocks=8)).prefix_cache_hit_rate == 0.0
    loads = call(make_api(None, stats=stats), "GetLoads", pb.LoadsRequest())
    assert [c.core for c in loads.cores] == [0] and loads.cores[0].num_used_blocks == 50


def test_loads_without_a_core_is_unavailable():
    class Lost(grpc.RpcError):
        def details(self):
            return "connection refused"

    code, details = status_of(make_api(None, stats=Lost()), "GetLoads", pb.LoadsRequest())
    assert code == grpc.StatusCode.UNAVAILABLE and "connection refused" in details


def test_a_starting_api_server_holds_a_request_until_it_reaches_its_core(tokenizer, monkeypatch):
    """Restarted beside others on one port, an API server takes clients (SO_REUSEPORT) a moment
    before its core link is up: their requests wait for it instead of a 503; one that started
    long enough ago and never got there says so."""
    import time

    from pagewire_common.sampling import SamplingParams
    from scheduler_svc.api import request
    from scheduler_svc.api.request import RequestError, check_request

    async def main():
        api = make_api(tokenizer, connected=False)
        api.model.info.max_num_seqs = 8
        api.was_connected, api.started_at, api.reject = False, time.monotonic(), lambda: None

        def connect():
            api.connected.set()
            api.was_connected = True

        asyncio.get_running_loop().call_later(0.2, connect)
        waited = time.monotonic()
        checked = await check_request(api, sampling=SamplingParams(), prompt_token_ids=[1, 2])
        waited = time.monotonic() - waited
        never = make_api(tokenizer, connected=False)
        never.was_connected, never.started_at, never.reject = False, time.monotonic(), lambda: None
        never.core_connected = False
        monkeypatch.setattr(request, "STARTING_WAIT_S", 0.1)
        with pytest.raises(RequestError) as refused:
            await check_request(never, sampling=SamplingParams(), prompt_token_ids=[1, 2])
        # SIGTERM during the wait ends it: the request is refused as the server is shutting down
        monkeypatch.setattr(request, "STARTING_WAIT_S", 30.0)
        draining = make_api(tokenizer, connected=False)
        draining.was_connected, draining.started_at, draining.reject = False, time.monotonic(), lambda: None
        asyncio.get_running_loop().call_later(0.1, lambda: setattr(draining, "draining", True))
        stopped = time.monotonic()
        with pytest.raises(RequestError) as shutting:
            await check_request(draining, sampling=SamplingParams(), prompt_token_ids=[1, 2])
        return checked, waited, refused.value, shutting.value, time.monotonic() - stopped

    checked, waited, refused, shutting, stopped = asyncio.run(main())
    assert checked.prompt_token_ids == [1, 2] and 0.15 < waited < 5
    assert (refused.code, refused.message) == (
        grpc.StatusCode.UNAVAILABLE, "this API server is starting: its engine core is not reachable yet")
    assert (shutting.code, shutting.message) == (grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
    assert stopped < 5
