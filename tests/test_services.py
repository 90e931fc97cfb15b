"""Scheduler and worker as separate processes over loopback gRPC."""

from __future__ import annotations

import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2

from pagewire import LLM, SamplingParams
from pagewire_common.v1 import generation_pb2 as pb
from tests.service_utils import (
    Proc, free_port, health_status, sampling, start_scheduler, start_worker, stub, wait_until,
)
from tests.tiny_models import sample_prompts

pytestmark = pytest.mark.slow

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama-gqa")


@pytest.fixture(scope="module")
def services(model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("svc")
    worker, worker_addr = start_worker(model_dir, tmp, extra=["--block-size", "4", "--num-kv-blocks", "600"])
    sched, addr = start_scheduler(worker_addr, tmp, extra=["--max-num-batched-tokens", "64"])
    yield addr
    sched.stop()
    worker.stop()


@pytest.fixture(scope="module")
def offline(model_dir):
    return LLM(model_dir, block_size=4, num_kv_blocks=600, max_num_batched_tokens=64)


def collect(call) -> tuple[list[int], str, list[pb.GenerateResponse]]:
    responses = list(call)
    return [t for r in responses for t in r.token_ids], "".join(r.text for r in responses), responses


def assert_all_blocks_free(addr):
    def done():
        s = stub(addr).GetStats(pb.StatsRequest())
        return s.num_running == 0 and s.num_waiting == 0 and s.num_free_blocks == s.num_total_blocks and s

    return wait_until(done, timeout=10)


def test_greedy_parity_16_concurrent_streams(services, offline, model_dir):
    prompts = (sample_prompts(model_dir, n=8) * 3)[:20]
    expected = [o.token_ids for o in offline.generate(prompts, SamplingParams(temperature=0, max_tokens=24))]
    s = stub(services)

    def one(p):
        return collect(s.Generate(pb.GenerateRequest(prompt_token_ids=p, sampling=sampling(max_tokens=24))))

    with ThreadPoolExecutor(20) as pool:
        results = list(pool.map(one, prompts))
    assert [r[0] for r in results] == expected
    for (_, _, responses), p in zip(results, prompts):
        last = responses[-1]
        assert last.finish_reason in (pb.STOP, pb.LENGTH)
        assert all(r.finish_reason == pb.UNSPECIFIED for r in responses[:-1])
        assert last.usage.prompt_tokens == len(p)
        assert last.usage.completion_tokens == sum(len(r.token_ids) for r in responses)
    assert_all_blocks_free(services)


def test_streaming_is_incremental_and_text_matches(services, offline):
    s = stub(services)
    call = s.Generate(pb.GenerateRequest(prompt="The river ", sampling=sampling(max_tokens=40, ignore_eos=True)))
    first = next(call)
    assert first.finish_reason == pb.UNSPECIFIED and len(first.token_ids) >= 1
    rest = list(call)
    ids = list(first.token_ids) + [t for r in rest for t in r.token_ids]
    text = first.text + "".join(r.text for r in rest)
    assert len(ids) == 40 and len(rest) >= 5
    assert text == offline.tokenizer.decode(ids)


def test_random_bytes_detokenize_exactly(services, offline):
    """High-temperature sampling emits stray byte tokens; the streamed text still equals the
    decode of all tokens (multi-byte characters split across tokens included)."""
    s = stub(services)
    for seed in range(4):
        ids, text, _ = collect(
            s.Generate(pb.GenerateRequest(prompt="日本語 héllo ", sampling=sampling(max_tokens=60, temperature=3.0, seed=seed, ignore_eos=True)))
        )
        assert text == offline.tokenizer.decode(ids)


def test_stop_strings_are_cut(services, offline):
    s = stub(services)
    ids, text, _ = collect(s.Generate(pb.GenerateRequest(prompt="The river ", sampling=sampling(max_tokens=30, ignore_eos=True))))
    stop = text[len(text) // 2 :][:3]
    _, cut, responses = collect(
        s.Generate(pb.GenerateRequest(prompt="The river ", sampling=sampling(max_tokens=30, ignore_eos=True, stop=[stop])))
    )
    assert cut == text[: text.index(stop)]
    assert responses[-1].finish_reason == pb.STOP
    # include_stop_str_in_output: the text ends with the stop string, here and offline
    kept_sampling = sampling(max_tokens=30, ignore_eos=True, stop=[stop])
    kept_sampling.include_stop_str_in_output = True
    _, kept, responses = collect(s.Generate(pb.GenerateRequest(prompt="The river ", sampling=kept_sampling)))
    assert kept == text[: text.index(stop) + len(stop)] and responses[-1].finish_reason == pb.STOP
    out = offline.generate("The river ", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop],
                                                        include_stop_str_in_output=True))[0]
    assert out.text == kept and out.finish_reason == "stop"


def test_chat_uses_template(services, offline):
    s = stub(services)
    msgs = [pb.ChatMessage(role="user", content="Tell me about the sea.")]
    ids, text, responses = collect(s.Chat(pb.ChatRequest(messages=msgs, sampling=sampling(max_tokens=12))))
    prompt = offline.tokenizer.apply_chat_template([{"role": "user", "content": "Tell me about the sea."}])
    expected = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=12))[0]
    assert ids == expected.token_ids and text == expected.text
    assert responses[-1].usage.prompt_tokens == len(offline.tokenizer.encode(prompt))


@pytest.mark.parametrize(
    "request_kwargs, fragment",
    [
        (dict(prompt=""), "prompt"),
        (dict(prompt="hi", prompt_token_ids=[1, 2]), "not both"),
        (dict(prompt_token_ids=[1, 10**6]), "outside the vocabulary"),
        (dict(prompt="hi", sampling=sampling(max_tokens=10_000)), "exceeds the maximum model length"),
        (dict(prompt="hi", sampling=sampling(temperature=-1.0)), "temperature"),
        (dict(prompt="hi", sampling=sampling(top_p=0.0)), "top_p"),
        (dict(prompt="hi", sampling=sampling(top_p=1.5)), "top_p"),
        (dict(prompt="hi", model="no-such-model"), "unknown model"),
        (dict(prompt="hi", sampling=pb.SamplingParams(prompt_logprobs=21)), "prompt_logprobs must be an integer in [0, 20]"),
        # an id past gRPC's metadata limit once quoted in an error: refused, whatever the error would be
        (dict(prompt="hi", request_id="r" * 20_000), "request_id has 20000 characters; at most 1024"),
    ],
)
def test_bad_requests_get_invalid_argument(services, offline, request_kwargs, fragment):
    s = stub(services)
    with pytest.raises(grpc.RpcError) as err:
        list(s.Generate(pb.GenerateRequest(**request_kwargs)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert fragment in err.value.details()
    # the server still serves, and exactly
    ids, _, _ = collect(s.Generate(pb.GenerateRequest(prompt_token_ids=[5, 6, 7], sampling=sampling(max_tokens=3))))
    assert ids == offline.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3))[0].token_ids


def test_generate_into_a_pipe_that_closes_stops_quietly(services):
    import subprocess
    import sys

    out = subprocess.run(f"{sys.executable} -m pagewire.cli generate 'The river ' --addr {services} --max-tokens 200 "
                         "--ignore-eos | head -c 5", shell=True, capture_output=True, text=True, timeout=60)
    assert len(out.stdout) == 5 and "Broken pipe" not in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_request_bytes_that_do_not_decode_are_invalid_argument(services, offline):
    """A string field that is not UTF-8 (which a C++ client can send) or a cut message: grpc.aio
    alone answers UNKNOWN with the decoder's exception."""
    channel = grpc.insecure_channel(services)
    bad_utf8 = pb.GenerateRequest(prompt="ab").SerializeToString().replace(b"ab", b"\xff\xfe")
    cut = pb.GenerateRequest(prompt="hello there").SerializeToString()[:-3]
    for method, data in (("Generate", bad_utf8), ("Chat", cut), ("Tokenize", bad_utf8), ("Abort", cut)):
        call = (channel.unary_stream if method in ("Generate", "Chat") else channel.unary_unary)(
            f"/pagewire.v1.Generation/{method}")
        with pytest.raises(grpc.RpcError) as err:
            result = call(data)
            list(result) if method in ("Generate", "Chat") else None
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, err.value.details())
        assert "does not decode" in err.value.details()
    channel.close()
    ids, _, _ = collect(stub(services).Generate(pb.GenerateRequest(prompt_token_ids=[5, 6, 7],
                                                                   sampling=sampling(max_tokens=3))))
    assert ids == offline.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3))[0].token_ids


def test_model_info_and_stats(services, model_dir):
    s = stub(services)
    info = s.GetModelInfo(pb.ModelInfoRequest())
    assert info.model_name == model_dir.name and info.block_size == 4 and info.num_kv_blocks == 600
    assert info.max_model_len == 256 and info.vocab_size > 0 and list(info.eos_token_ids)
    assert health_status(services) == SERVING
    assert health_status(services, "pagewire.v1.Generation") == SERVING
    stats = s.GetStats(pb.StatsRequest())
    assert stats.num_total_blocks == 600 and stats.worker_connected
    with pytest.raises(grpc.RpcError):  # refused at the API server, counted by the core
        list(s.Generate(pb.GenerateRequest(prompt="hi", sampling=sampling(temperature=-1.0))))
    after = s.GetStats(pb.StatsRequest())
    assert after.num_requests_rejected == stats.num_requests_rejected + 1
    assert after.num_requests_finished == stats.num_requests_finished
    with pytest.raises(grpc.RpcError) as err:
        s.Abort(pb.AbortRequest(request_id="r" * 1025))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "at most 1024" in err.value.details()
    assert not s.Abort(pb.AbortRequest(request_id="r" * 1024)).found


def test_cancel_20_of_40_streams(services, offline, model_dir):
    s = stub(services)
    prompts = (sample_prompts(model_dir, n=8) * 5)[:40]
    prompts = [p[:40] for p in prompts]
    expected = [o.token_ids for o in offline.generate(prompts[1::2], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))]
    before = s.GetStats(pb.StatsRequest())
    # the streams to cancel ask for 200 tokens: with 60, a client thread starved of the GIL for a
    # few dozen steps sometimes cancelled a stream the core had already finished (counted finished)
    calls = [s.Generate(pb.GenerateRequest(prompt_token_ids=p, sampling=sampling(max_tokens=60 if i % 2 else 200,
                                                                                   ignore_eos=True)))
             for i, p in enumerate(prompts)]
    results: dict[int, list[int]] = {}

    def consume(i):
        call = calls[i]
        got = []
        try:
            for r in call:
                got.extend(r.token_ids)
                if i % 2 == 0 and len(got) >= 3:
                    call.cancel()
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.CANCELLED and i % 2 == 0
        results[i] = got

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [results[i] for i in range(1, 40, 2)] == expected
    assert all(len(results[i]) < 200 for i in range(0, 40, 2))
    stats = assert_all_blocks_free(services)
    assert stats.num_requests_aborted - before.num_requests_aborted == 20


def test_deadline_is_honoured_and_frees_blocks(services):
    s = stub(services)
    req = pb.GenerateRequest(prompt="The", sampling=sampling(max_tokens=250, ignore_eos=True))
    # the deadline falls a third of the way into the stream however fast this machine streams it
    # (250 tokens, the tiny model's limit, took 0.27-0.41 s on one host and under 0.15 s on another)
    start = time.monotonic()
    assert len(collect(s.Generate(req))[0]) == 250
    whole = time.monotonic() - start
    with pytest.raises(grpc.RpcError) as err:
        list(s.Generate(req, timeout=whole / 3))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert_all_blocks_free(services)


def test_queue_bound_gives_resource_exhausted(model_dir, tmp_path):
    worker, worker_addr = start_worker(model_dir, tmp_path, extra=["--block-size", "4", "--num-kv-blocks", "200"])
    sched, addr = start_scheduler(worker_addr, tmp_path, extra=["--max-num-seqs", "1", "--max-queued-requests", "2"])
    try:
        s = stub(addr)
        req = pb.GenerateRequest(prompt_token_ids=[5, 6, 7], sampling=sampling(max_tokens=120, ignore_eos=True))
        first = s.Generate(req)
        num_first = len(next(first).token_ids)  # running now (a response may carry more than one token)
        queued = [s.Generate(req) for _ in range(2)]
        wait_until(lambda: s.GetStats(pb.StatsRequest()).num_waiting == 2)
        with pytest.raises(grpc.RpcError) as err:
            list(s.Generate(req))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert num_first + len(collect(first)[0]) == 120
        assert all(len(collect(q)[0]) == 120 for q in queued)
        assert s.GetStats(pb.StatsRequest()).num_requests_rejected == 1
        assert_all_blocks_free(addr)
    finally:
        sched.stop()
        worker.stop()


def test_worker_death_gives_unavailable_then_recovers(model_dir, offline, tmp_path):
    port = free_port()
    worker, worker_addr = start_worker(model_dir, tmp_path, port=port, extra=["--block-size", "4", "--num-kv-blocks", "300"])
    sched, addr = start_scheduler(worker_addr, tmp_path)
    try:
        s = stub(addr)
        req = pb.GenerateRequest(prompt_token_ids=[5, 6, 7], sampling=sampling(max_tokens=250, ignore_eos=True))
        calls = [s.Generate(req) for _ in range(4)]
        for c in calls:
            next(c)
        t0 = time.monotonic()
        worker.kill()
        for c in calls:
            with pytest.raises(grpc.RpcError) as err:
                list(c)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - t0 < 5
        wait_until(lambda: health_status(addr) == NOT_SERVING, timeout=5)
        with pytest.raises(grpc.RpcError) as err:
            list(s.Generate(req))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        worker, _ = start_worker(model_dir, tmp_path, port=port, extra=["--block-size", "4", "--num-kv-blocks", "300"])
        wait_until(lambda: health_status(addr) == SERVING, timeout=15)
        ids, _, _ = collect(s.Generate(pb.GenerateRequest(prompt_token_ids=[5, 6, 7], sampling=sampling(max_tokens=5))))
        assert ids == offline.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=5))[0].token_ids
        assert_all_blocks_free(addr)
    finally:
        sched.stop()
        worker.stop()


def test_serve_answers_and_stops_cleanly_on_sigterm(model_dir, tmp_path):
    port = free_port()
    serve = Proc(["serve", "--model", str(model_dir), "--listen", f"127.0.0.1:{port}", "--num-kv-blocks", "100"], tmp_path / "serve.log")
    try:
        serve.wait_for_output("pagewire ready", timeout=90)
        ids, text, _ = collect(stub(f"127.0.0.1:{port}").Generate(pb.GenerateRequest(prompt="The river ", sampling=sampling(max_tokens=8))))
        assert ids and text
        serve.signal(signal.SIGTERM)
        code = serve.proc.wait(20)
        out = serve.output()
        assert code == 0, out
        assert "shutting down" in out and "stopped" in out
        # no process left behind: the worker (its own session) is gone too
        import subprocess

        ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
        assert "--listen unix:" not in "\n".join(l for l in ps.splitlines() if str(model_dir) in l)
    finally:
        serve.kill()


def test_generate_command_streams_text(services, offline):
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "pagewire.cli", "generate", "The river ", "--addr", services, "--max-tokens", "12", "--ignore-eos"],
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 0, out.stderr
    expected = offline.generate("The river ", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    assert out.stdout == expected.text + "\n"


def test_stream_interval_batches_tokens_after_the_first(model_dir, tmp_path, offline):
    worker, worker_addr = start_worker(model_dir, tmp_path, extra=["--block-size", "4", "--num-kv-blocks", "200"])
    sched, addr = start_scheduler(worker_addr, tmp_path, extra=["--stream-interval", "4"])
    try:
        prompt = [5, 6, 7, 8]
        ids, text, responses = collect(stub(addr).Generate(pb.GenerateRequest(prompt_token_ids=prompt, sampling=sampling(max_tokens=23, ignore_eos=True))))
        expected = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=23, ignore_eos=True))[0]
        assert ids == expected.token_ids and text == expected.text
        sizes = [len(r.token_ids) for r in responses]
        assert sizes[0] == 1  # time to first token is not delayed
        assert all(n >= 4 for n in sizes[1:-1]) and sum(sizes) == 23
        assert responses[-1].finish_reason == pb.LENGTH
    finally:
        sched.stop()
        worker.stop()


def test_a_2mb_prompt_being_tokenized_does_not_stall_other_streams(services):
    """The API server tokenizes big prompts in a helper process: while a 2 MB prompt is encoded
    (about a second on a fast host: long enough for the other stream's steps to be counted while
    the helper holds one of the two cores), another stream on the same server keeps getting tokens
    at its usual pace instead of waiting for the whole encode."""
    s = stub(services)
    call = s.Generate(pb.GenerateRequest(prompt_token_ids=[5, 6, 7], sampling=sampling(max_tokens=250, ignore_eos=True)))
    arrivals: list[float] = []
    reader_done = threading.Event()

    def read():
        for r in call:
            arrivals.extend([time.monotonic()] * max(len(r.token_ids), 1))
        reader_done.set()

    reader = threading.Thread(target=read)
    reader.start()
    wait_until(lambda: len(arrivals) >= 10, timeout=30)
    big = "the river runs to the sea " * 80_000  # 2 MB
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        list(stub(services).Generate(pb.GenerateRequest(prompt=big, sampling=sampling(max_tokens=4))))
    t1 = time.monotonic()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "maximum model length" in err.value.details()
    reader.join(60)
    assert reader_done.is_set() and len(arrivals) == 250
    during = [b - a for a, b in zip(arrivals, arrivals[1:]) if t0 <= b <= t1]
    assert during, "the stream ended before the big prompt was tokenized"
    # tokenized on the server's event loop, the encode would be one gap as long as the request
    # itself; in the helper process the stream keeps moving, with gaps of a few steps (tens of
    # milliseconds; the helper takes one of the two cores meanwhile)
    assert len(during) >= 10 and max(during) < 0.3 * (t1 - t0), (max(during), t1 - t0, len(during))


def test_logprobs_over_grpc_with_requests_that_do_not_ask(services, offline, model_dir):
    """Requests with and without logprobs in the same steps: each gets its own, aligned with its
    tokens, equal to the offline API's."""
    prompts = sample_prompts(model_dir, n=6)
    want = [i % 2 == 0 for i in range(6)]
    expected = offline.generate(prompts, [SamplingParams(temperature=0, max_tokens=12, logprobs=w) for w in want])
    s = stub(services)

    def one(i):
        return list(s.Generate(pb.GenerateRequest(prompt_token_ids=prompts[i],
                                                  sampling=sampling(max_tokens=12, logprobs=want[i]))))

    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(one, range(6)))
    for i, responses in enumerate(results):
        ids = [t for r in responses for t in r.token_ids]
        lps = [lp for r in responses for lp in r.logprobs]
        assert ids == expected[i].token_ids
        if want[i]:
            assert lps == pytest.approx(expected[i].logprobs, abs=1e-4) and len(lps) == len(ids)
        else:
            assert lps == []


def test_prompt_logprobs_over_grpc_on_the_first_response(services, offline, model_dir):
    """The first response carries the prompt logprobs (equal to the offline API's), later ones
    none; a repeated prompt (its blocks cached) still gets them, computed again; with n > 1 only
    sample 0 gets them."""
    prompt = max(sample_prompts(model_dir, n=6), key=len)
    assert len(prompt) > 64  # more than one 64-token chunk
    expected = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=5, prompt_logprobs=3))[0]
    s = stub(services)
    for _ in range(2):
        responses = list(s.Generate(pb.GenerateRequest(prompt_token_ids=prompt,
                                                       sampling=pb.SamplingParams(max_tokens=5, prompt_logprobs=3))))
        first = responses[0]
        assert first.token_ids
        assert list(first.prompt_logprobs) == pytest.approx(expected.prompt_logprobs, abs=1e-4)
        assert len(first.prompt_logprobs) == len(prompt) - 1
        assert [(list(t.token_ids), pytest.approx(list(t.logprobs), abs=1e-4)) for t in first.prompt_top_logprobs] \
            == [(ids, lps) for ids, lps in expected.prompt_top_logprobs]
        assert all(not r.prompt_logprobs and not r.prompt_top_logprobs for r in responses[1:])
        assert [t for r in responses for t in r.token_ids] == expected.token_ids
        assert responses[-1].usage.cached_prompt_tokens == 0
    responses = list(s.Generate(pb.GenerateRequest(prompt_token_ids=prompt[:20], sampling=pb.SamplingParams(
        max_tokens=2, n=2, temperature=1.0, seed=3, prompt_logprobs=0))))
    with_prompt = [r for r in responses if r.prompt_logprobs]
    assert [r.index for r in with_prompt] == [0] and len(with_prompt[0].prompt_logprobs) == 19
    assert not any(r.prompt_top_logprobs for r in responses)
    assert_all_blocks_free(services)


def test_tokenize_and_detokenize_over_grpc(services, offline, model_dir):
    s = stub(services)
    tok = offline.tokenizer
    text = "Tell me about the sea, and héllo 🌊."
    reply = s.Tokenize(pb.TokenizeRequest(prompt=text, model=model_dir.name))
    assert list(reply.token_ids) == tok.encode(text) and reply.num_tokens == len(reply.token_ids)
    assert s.Detokenize(pb.DetokenizeRequest(token_ids=reply.token_ids)).text == tok.decode(tok.encode(text))
    # Generate sends the same ids for the text as for the ids Tokenize gave
    by_text, _, _ = collect(s.Generate(pb.GenerateRequest(prompt=text, sampling=sampling(max_tokens=4))))
    by_ids, _, _ = collect(s.Generate(pb.GenerateRequest(prompt_token_ids=reply.token_ids,
                                                         sampling=sampling(max_tokens=4))))
    assert by_text == by_ids
    # messages are rendered as Chat renders them
    msgs = [pb.ChatMessage(role="user", content="Tell me about the sea.")]
    chat = s.Tokenize(pb.TokenizeRequest(messages=msgs))
    prompt = tok.apply_chat_template([{"role": "user", "content": "Tell me about the sea."}])
    assert chat.prompt == prompt and list(chat.token_ids) == tok.encode(prompt)
    _, _, responses = collect(s.Chat(pb.ChatRequest(messages=msgs, sampling=sampling(max_tokens=2))))
    assert responses[-1].usage.prompt_tokens == chat.num_tokens
    for call, request in ((s.Tokenize, pb.TokenizeRequest()),
                          (s.Tokenize, pb.TokenizeRequest(prompt="hi", messages=msgs)),
                          (s.Detokenize, pb.DetokenizeRequest()),
                          (s.Detokenize, pb.DetokenizeRequest(token_ids=[1, 10**6]))):
        with pytest.raises(grpc.RpcError) as err:
            call(request)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_get_loads_follows_the_core(services):
    s = stub(services)
    assert_all_blocks_free(services)
    idle = s.GetLoads(pb.LoadsRequest())
    stats = s.GetStats(pb.StatsRequest())
    assert len(idle.cores) == 1 and idle.cores[0].core == 0
    assert (idle.cores[0].num_running, idle.cores[0].num_waiting, idle.cores[0].num_used_blocks) == (0, 0, 0)
    assert idle.cores[0].num_total_blocks == stats.num_total_blocks == 600
    long = s.Generate(pb.GenerateRequest(prompt_token_ids=list(range(5, 30)),
                                         sampling=sampling(max_tokens=200, ignore_eos=True)))
    next(long)
    busy = s.GetLoads(pb.LoadsRequest()).cores[0]
    assert busy.num_running == 1 and busy.num_used_blocks >= 25 // 4
    long.cancel()
    prompt = list(range(40, 70))  # 7 full blocks of 4: the second time they come from the prefix cache
    for _ in range(2):
        collect(s.Generate(pb.GenerateRequest(prompt_token_ids=prompt, sampling=sampling(max_tokens=2))))
    assert_all_blocks_free(services)
    after = s.GetLoads(pb.LoadsRequest()).cores[0]
    stats = s.GetStats(pb.StatsRequest())
    assert 0 < after.prefix_cache_hit_rate <= 1
    assert after.prefix_cache_hit_rate == stats.num_prefix_cache_hit_tokens / stats.num_prefix_cache_queried_tokens
    assert (after.num_running, after.num_waiting, after.num_used_blocks) == (0, 0, 0)


def test_subscribe_kv_events_sees_a_generates_blocks_stored_as_one_chain(services):
    import queue

    from kvcache.allocator import _ROOT_BLOCK_HASH

    def chain(token_ids):  # the core's hashes, as the public API gives them (uint64)
        hashes, parent = [], _ROOT_BLOCK_HASH
        for start in range(0, len(token_ids) - 3, 4):
            parent = hash((parent, tuple(token_ids[start : start + 4])))
            hashes.append(parent & 0xFFFF_FFFF_FFFF_FFFF)
        return hashes

    s = stub(services)
    call = s.SubscribeKVEvents(pb.KVEventsRequest())
    batches: queue.Queue = queue.Queue()

    def read():
        try:
            for batch in call:
                batches.put(batch)
        except grpc.RpcError:  # cancelled at the end
            pass

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    got: list[pb.KVEventBatch] = []
    try:
        # the subscription reaches the core a moment after the stream opens: prompts until one is seen
        for attempt in range(20):
            prompt = [200 + attempt] + list(range(300, 317))  # 4 full blocks of 4, then 2 tokens
            collect(s.Generate(pb.GenerateRequest(prompt_token_ids=prompt, sampling=sampling(max_tokens=1))))
            deadline = time.monotonic() + 1.0
            while time.monotonic() < deadline:
                try:
                    got.append(batches.get(timeout=0.1))
                except queue.Empty:
                    continue
                stored = [e.block_stored for b in got for e in b.events if e.HasField("block_stored")]
                if stored and any(e.token_ids[:1] == [prompt[0]] for e in stored):
                    break
            else:
                continue
            break
    finally:
        call.cancel()
    assert [b.seq for b in got] == list(range(got[0].seq, got[0].seq + len(got)))  # no gaps
    assert {b.core_index for b in got} == {0}
    stored = [e.block_stored for b in got for e in b.events if e.HasField("block_stored")]
    first = next(i for i, e in enumerate(stored) if e.token_ids[:1] == [prompt[0]])
    mine = stored[first:]
    assert not mine[0].HasField("parent_block_hash")  # the prompt's first block
    hashes = [h for e in mine for h in e.block_hashes][:4]
    assert hashes == chain(prompt)  # the core's chained hashes of the prompt's 4 full blocks
    assert [t for e in mine for t in e.token_ids][:16] == prompt[:16]
    for before, after in zip(mine, mine[1:]):  # each event's parent is the last hash of the one before
        assert after.parent_block_hash == before.block_hashes[-1]
    assert all(e.block_size == 4 and len(e.token_ids) == 4 * len(e.block_hashes) for e in mine)
