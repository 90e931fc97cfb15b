"""The pure parts of the llama.cpp comparison (``pagewire.bench.llamacpp``, which
``benchmarks/vs_llamacpp.py`` drives): which servers to run, the command lines, the cache keys; and
the bench's HTTP client against a server that streams a token per chunk without token ids, as
llama-server does. Nothing here builds or runs llama.cpp."""

from __future__ import annotations

import asyncio
import json
import random
import sys
from pathlib import Path

import pytest

from pagewire.bench import llamacpp
from pagewire.bench.http_client import HttpClient, chunk_tokens
from pagewire.bench.llamacpp import (
    CMAKE_OPTIONS,
    LlamaCppError,
    Scenario,
    ServerConfig,
    binary_path,
    build_command,
    build_key,
    configure_command,
    convert_command,
    cpu_flags,
    decode_tokens_per_s,
    download_command,
    gguf_path,
    pagewire_serve_argv,
    parse_configs,
    parse_scenarios,
    server_command,
)
from pagewire.bench.metrics import RequestRecord
from pagewire.bench.loadgen import build_requests, word_prompts
from pagewire.client import make_sampling

# ---- which servers -----------------------------------------------------------------------------


def test_default_configs_put_pagewires_default_among_llama_servers_types():
    assert [c.name for c in parse_configs(llamacpp.DEFAULT_CONFIGS)] == [
        "llama:q4_1", "pagewire:auto", "llama:q8_0", "llama:bf16"]


def test_configs_keep_their_order_and_skip_blanks():
    assert parse_configs(" pagewire:bfloat16, llama:q8_0,,llama:f16 ") == [
        ServerConfig("pagewire", "bfloat16"), ServerConfig("llama", "q8_0"), ServerConfig("llama", "f16")]


def test_a_config_carries_flags_for_its_server():
    llama, ours, same_type = parse_configs("llama:q4_1 --no-repack,pagewire:auto --no-prefix-cache  --max-num-seqs=8,"
                                           "llama:q4_1")
    assert llama == ServerConfig("llama", "q4_1", ("--no-repack",)) and llama.name == "llama:q4_1 --no-repack"
    # pagewire's flags as its settings write them back, in their declared order
    assert ours == ServerConfig("pagewire", "auto", ("--max-num-seqs", "8", "--no-prefix-cache"))
    assert ours.name == "pagewire:auto --max-num-seqs 8 --no-prefix-cache"
    assert same_type.name == "llama:q4_1" and same_type.with_args("--no-repack") == llama


def test_pagewire_serve_argv_takes_the_configs_flags_with_the_benchs_own():
    assert pagewire_serve_argv(("--no-prefix-cache",), dtype="bfloat16", http_listen="127.0.0.1:9") == [
        "--dtype", "bfloat16", "--no-prefix-cache", "--http-listen", "127.0.0.1:9"]
    assert pagewire_serve_argv(()) == []
    with pytest.raises(ValueError, match="unrecognized arguments: --fast"):
        pagewire_serve_argv(("--fast",))


@pytest.mark.parametrize("text, message", [
    ("pagewire:fp4", "'pagewire:fp4': pagewire refuses it: --dtype (dtype) must be one of auto, float32, float16, bfloat16"),
    ("pagewire:auto --max-num-seqs 0", "'pagewire:auto --max-num-seqs 0': pagewire refuses it: argument --max-num-seqs"),
    ("pagewire:auto --warp 9", "'pagewire:auto --warp 9': pagewire refuses it: unrecognized arguments: --warp 9"),
    ("pagewire:auto --dtype float32", "'pagewire:auto --dtype float32': --dtype is set by the bench"),
    ("llama:q8_0 --port=8", "'llama:q8_0 --port=8': --port=8 is set by the bench"),
    ("llama:q8_0 '--no-repack", "\"llama:q8_0 '--no-repack\": No closing quotation"),
    ("llama:q4_0", "'llama:q4_0': llama takes a GGUF type, one of f32, f16, bf16, q8_0, q4_1"),
    ("vllm:f32", "'vllm:f32': expected ENGINE:TYPE [FLAGS] with ENGINE one of llama, pagewire"),
    ("llama", "'llama': expected ENGINE:TYPE"),
    ("llama:", "'llama:': expected ENGINE:TYPE"),
    ("llama:f32,llama:f32", "'llama:f32' is given twice"),
    (" , ", "no configuration given"),
])
def test_bad_configs_are_refused_with_what_is_wrong(text, message):
    with pytest.raises(ValueError) as e:
        parse_configs(text)
    assert str(e.value).startswith(message)


# ---- scenarios and the decode rate -------------------------------------------------------------


def test_scenarios_by_name_or_shape():
    assert parse_scenarios(llamacpp.DEFAULT_SCENARIOS) == [Scenario("one-stream", 1, 8, 128),
                                                           Scenario("32-streams", 32, 64, 64)]
    assert parse_scenarios("4x16x64, one-stream") == [Scenario("4x16x64", 4, 16, 64), Scenario("one-stream", 1, 8, 128)]


@pytest.mark.parametrize("text, message", [
    ("two-streams", "'two-streams': expected one of one-stream, 32-streams or STREAMSxREQUESTSxTOKENS"),
    ("4x0x64", "'4x0x64': expected"),
    ("4x16", "'4x16': expected"),
    ("one-stream,one-stream", "'one-stream' is given twice"),
    ("", "no scenario given"),
])
def test_bad_scenarios_are_refused(text, message):
    with pytest.raises(ValueError) as e:
        parse_scenarios(text)
    assert str(e.value).startswith(message)


def test_decode_rate_counts_the_tokens_after_the_first_over_the_time_after_it():
    # 1 s to the first token (left out), then 4 tokens in 0.5 s; then 1 token in a chunk of 2 after the first
    first = RequestRecord(send_time=0.0, arrival_times=[1.0, 1.1, 1.2, 1.3, 1.5], arrival_counts=[1, 1, 0, 2, 1])
    second = RequestRecord(send_time=0.0, arrival_times=[2.0, 2.5], arrival_counts=[2, 1])
    assert decode_tokens_per_s([first]) == pytest.approx(4 / 0.5)
    assert decode_tokens_per_s([first, second]) == pytest.approx(5 / 1.0)
    lone = RequestRecord(arrival_times=[1.0], arrival_counts=[3])
    assert decode_tokens_per_s([lone]) is None and decode_tokens_per_s([]) is None


# ---- command lines -----------------------------------------------------------------------------


def test_server_command_gives_a_slot_per_stream_and_the_context_they_need():
    argv = server_command(Path("/c/llama-server"), Path("/c/m.gguf"), host="127.0.0.1", port=8123, threads=2,
                          parallel=32, ctx_per_slot=144)
    assert argv == ["/c/llama-server", "--model", "/c/m.gguf", "--host", "127.0.0.1", "--port", "8123",
                    "--threads", "2", "--threads-batch", "2", "--parallel", "32", "--cont-batching",
                    "--ctx-size", "8192", "--no-webui"]  # 144 tokens a slot, padded to 256 as llama.cpp would
    assert server_command(Path("b"), Path("m"), host="h", port=1, threads=1, parallel=4, ctx_per_slot=512)[-2] == "2048"


def test_build_is_native_cpu_only_and_fetches_nothing():
    src, build = Path("/s/llama.cpp"), Path("/b")
    assert configure_command(src, build) == ["cmake", "-S", "/s/llama.cpp", "-B", "/b", *CMAKE_OPTIONS]
    for option in ("-DGGML_NATIVE=ON", "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_OPENSSL=OFF",
                   "-DLLAMA_USE_PREBUILT_UI=OFF", "-DBUILD_SHARED_LIBS=OFF"):
        assert option in CMAKE_OPTIONS
    assert not any("CUDA=ON" in o or "CURL=ON" in o for o in CMAKE_OPTIONS)
    assert build_command(build, 2) == ["cmake", "--build", "/b", "--target", "llama-server", "--config", "Release",
                                       "-j", "2"]


def test_download_takes_the_source_distribution_only():
    assert download_command("0.3.36", Path("/d")) == [
        sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-python",
        "llama-cpp-python==0.3.36", "--dest", "/d"]


def test_convert_command_runs_llama_cpps_converter_in_this_python():
    assert convert_command(Path("/s"), Path("/m/Smol-abc"), "q8_0", Path("/o/x.gguf")) == [
        sys.executable, "/s/convert_hf_to_gguf.py", "/m/Smol-abc", "--outtype", "q8_0", "--outfile", "/o/x.gguf"]
    with pytest.raises(ValueError, match="GGUF type must be one of"):
        convert_command(Path("/s"), Path("/m"), "q4_k", Path("/o/x.gguf"))


# ---- the cache ---------------------------------------------------------------------------------

AVX2_CPUINFO = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 avx2 fma\n\nprocessor\t: 1\nflags\t: x\n"


def test_cpu_flags_are_the_first_cpus_sorted():
    assert cpu_flags(AVX2_CPUINFO) == ["avx2", "fma", "fpu", "sse2"]
    assert cpu_flags("Features\t: fp asimd sve\n") == ["asimd", "fp", "sve"]
    assert cpu_flags("") == []


def test_build_key_follows_version_cpu_flags_and_cmake_options():
    key = build_key("0.3.36", ["avx2", "fma"])
    assert key.startswith("0.3.36-") and len(key) == len("0.3.36-") + 12
    assert build_key("0.3.36", ["fma", "avx2"]) == key  # order of the flags does not matter
    assert build_key("0.3.37", ["avx2", "fma"]) != key
    assert build_key("0.3.36", ["avx2", "fma", "avx512f"]) != key
    assert build_key("0.3.36", ["avx2", "fma"], CMAKE_OPTIONS + ("-DGGML_BLAS=ON",)) != key


def test_cache_paths():
    root = Path("/cache/llama.cpp")
    assert binary_path(root, "0.3.36", ["avx2"]) == root / f"llama-server-{build_key('0.3.36', ['avx2'])}" / "llama-server"
    assert gguf_path(root, "0.3.36", Path("/cache/Smol-f239"), "bf16") == root / "gguf" / "Smol-f239-llama.cpp0.3.36-bf16.gguf"


def test_cache_dir_follows_pagewire_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGEWIRE_CACHE_DIR", str(tmp_path))
    assert llamacpp.cache_dir() == tmp_path / "llama.cpp"


def test_missing_build_tools_are_named(monkeypatch):
    monkeypatch.setattr(llamacpp.shutil, "which", lambda name: "/usr/bin/cc" if name == "cc" else None)
    with pytest.raises(LlamaCppError) as e:
        llamacpp.check_build_tools()
    message = str(e.value)
    assert message.startswith("building llama-server needs cmake and a C++ compiler (g++ or clang++): install them")
    assert "apt-get install cmake g++" in message and "--llama-server PATH" in message


def test_find_or_build_returns_a_cached_binary_without_building(monkeypatch, tmp_path):
    binary = binary_path(tmp_path, "0.3.36", cpu_flags(), llamacpp.cmake_options())
    binary.parent.mkdir(parents=True)
    binary.write_text("")
    monkeypatch.setattr(llamacpp, "check_build_tools", lambda: pytest.fail("a cached binary needs no build"))
    assert llamacpp.find_or_build_server(tmp_path, "0.3.36") == binary


# ---- prompts of a given token length -----------------------------------------------------------


class WordTokenizer:
    """A toy tokenizer: ids 0..5 are one-token words, id 6 is a word that encodes as two tokens."""

    vocab = (" tree", " river", " stone", " cloud", " light", " sand", " ox", "<s>", " twofold")
    vocab_size = len(vocab)

    def decode(self, ids):
        return "".join(self.vocab[i] for i in ids)

    def encode(self, text):
        return [w for w in text.split(" ") if w for _ in range(2 if w == "twofold" else 1)]


def test_word_prompts_have_the_asked_token_count_and_differ():
    prompts = word_prompts(8, 3, WordTokenizer(), random.Random(0))
    assert len(prompts) == len(set(prompts)) == 8
    for p in prompts:
        assert len(p.split()) == 3 and set(p.split()) <= {"tree", "river", "stone", "cloud", "light", "sand"}
        assert p.startswith(" ")
    assert word_prompts(8, 3, WordTokenizer(), random.Random(0)) == prompts


def test_word_prompts_say_when_the_vocabulary_is_too_small():
    with pytest.raises(ValueError, match="7 one-token words, fewer than 9"):
        word_prompts(1, 9, WordTokenizer(), random.Random(0))


# ---- the client against a server that sends no token ids -------------------------------------


def test_chunk_tokens():
    def chunk(text, **more):
        return {"choices": [{"text": text, "index": 0, **more}]}

    assert chunk_tokens(chunk("ab", token_ids=[1, 2]), 5) == 2
    assert chunk_tokens(chunk("", token_ids=[7]), 5) == 1  # a token with no text (a special one)
    # llama-server with timings_per_token: the running count, whatever the text
    assert chunk_tokens(chunk("") | {"timings": {"predicted_n": 6}}, 5) == 1
    assert chunk_tokens(chunk("é") | {"timings": {"predicted_n": 7}}, 5) == 2
    assert chunk_tokens(chunk("", finish_reason="length") | {"timings": {"predicted_n": 7}}, 7) == 0
    # neither: a token per chunk with text
    assert chunk_tokens(chunk(" the"), 5) == 1
    assert chunk_tokens(chunk("", finish_reason="length"), 5) == 0


def _sse(*chunks) -> bytes:
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


async def _serve_and_run(chunks: list[dict], bodies: list[dict], extra_body: dict | None = None, **client_options):
    from aiohttp import web

    async def completions(request):
        bodies.append(await request.json() | {"connection header": request.headers.get("Connection")})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(_sse(*chunks))
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    port = runner.addresses[0][1]
    client = HttpClient(f"http://127.0.0.1:{port}", extra_body, **client_options)
    try:
        requests = build_requests([" tree river", " stone cloud"], make_sampling(max_tokens=3, ignore_eos=True))
        return await client.run(requests, model="m", concurrency=2)
    finally:
        await client.close()
        await runner.cleanup()


def test_llama_servers_running_count_counts_every_token():
    """As llama-server streams with timings_per_token: a chunk per complete piece of text, none for a
    token that ends inside a UTF-8 character, an empty one for a special token, a closing one."""
    usage = {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6}
    chunks = [{"choices": [{"text": text, "index": 0, "finish_reason": None}], "timings": {"predicted_n": n}}
              for text, n in ((" a", 1), ("é", 3), ("", 4))]
    chunks.append({"choices": [{"text": "", "index": 0, "finish_reason": "length"}], "usage": usage,
                   "timings": {"predicted_n": 4}})
    bodies: list[dict] = []
    result = asyncio.run(_serve_and_run(chunks, bodies, {"timings_per_token": True}, keep_alive=False))
    for rec in result.records:
        assert rec.ok
        assert rec.arrival_counts == [1, 2, 1, 0]
        assert rec.num_received_tokens == rec.completion_tokens == 4
        assert rec.prompt_tokens == 2
    assert sorted(b["prompt"] for b in bodies) == [" stone cloud", " tree river"]
    for b in bodies:
        assert b["timings_per_token"] is True
        assert b["connection header"] == "close"  # keep_alive=False: a connection per request
        assert b["max_tokens"] == 3 and b["ignore_eos"] is True and b["stream"] is True


def test_a_chunk_per_token_without_ids_or_counts():
    usage = {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    chunks = [{"choices": [{"text": t, "index": 0, "finish_reason": None}]} for t in (" a", " b", " c")]
    chunks.append({"choices": [{"text": "", "index": 0, "finish_reason": "length"}], "usage": usage})
    bodies: list[dict] = []
    result = asyncio.run(_serve_and_run(chunks, bodies))
    assert [rec.arrival_counts for rec in result.records] == [[1, 1, 1, 0], [1, 1, 1, 0]]
    assert "timings_per_token" not in bodies[0]
    assert bodies[0]["connection header"] != "close"


def test_token_ids_count_when_a_chunk_carries_several():
    usage = {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    chunks = [{"choices": [{"text": " a", "token_ids": [5], "index": 0, "finish_reason": None}]},
              {"choices": [{"text": " b c", "token_ids": [6, 7], "index": 0, "finish_reason": "length"}]},
              {"choices": [], "usage": usage}]
    result = asyncio.run(_serve_and_run(chunks, []))
    assert [rec.arrival_counts for rec in result.records] == [[1, 2], [1, 2]]
    assert all(rec.num_received_tokens == rec.completion_tokens == 3 for rec in result.records)
