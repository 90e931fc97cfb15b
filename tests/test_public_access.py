"""Who may call the public address, and over what: ``--api-key`` (UNAUTHENTICATED without it;
health and reflection stay open) and ``--tls-cert-file``/``--tls-key-file`` (a TLS channel that
trusts the certificate works, a plaintext one does not)."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pagewire import LLM, SamplingParams
from pagewire.client import ServerAccess, open_channel
from pagewire_common.tls import TlsFiles
from pagewire_common.v1 import generation_pb2 as pb
from pagewire_common.v1 import generation_pb2_grpc
from scheduler_svc.api.auth import check_authorization
from tests.service_utils import REPO, Proc, descendants, free_port, listening_sockets, sampling

KEY = "s3cret-key"


# ---- the key check and the TLS files, without a server ---------------------------------------


@pytest.mark.parametrize("value, admitted", [
    ("Bearer s3cret-key", True), ("bearer s3cret-key", True), ("  Bearer   s3cret-key ", True),
    ("Bearer s3cret-kez", False), ("Bearer s3cret-key2", False), ("Bearer ", False), ("s3cret-key", False),
    ("Basic s3cret-key", False), ("", False), (None, False),
    # header bytes that are not UTF-8, as aiohttp hands them on (surrogate escapes): refused, not a crash
    (b"Bearer \xff\xfe".decode("utf-8", "surrogateescape"), False),
])
def test_check_authorization(value, admitted):
    assert check_authorization(value, KEY) is admitted
    assert check_authorization(value, None) is True  # no key set: everyone


def make_certificate(directory, name: str = "server") -> tuple[str, str]:
    """A self-signed certificate for localhost and 127.0.0.1: (cert PEM path, key PEM path)."""
    cert, key = directory / f"{name}.crt", directory / f"{name}.key"
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is needed to make a test certificate")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"], check=True, capture_output=True)
    return str(cert), str(key)


def test_tls_files_are_checked_at_load(tmp_path):
    cert, key = make_certificate(tmp_path)
    other_cert, other_key = make_certificate(tmp_path, "other")
    files = TlsFiles.load(cert, key)
    assert files.cert.startswith(b"-----BEGIN CERTIFICATE") and files.ssl_context() is not None
    assert TlsFiles.load(None, None) is None
    with pytest.raises(ValueError, match="are not a PEM certificate and its private key"):
        TlsFiles.load(cert, other_key)
    with pytest.raises(ValueError, match="cannot read the TLS files.*missing.pem"):
        TlsFiles.load(cert, str(tmp_path / "missing.pem"))
    with pytest.raises(ValueError, match="go together"):
        TlsFiles.load(cert, None)
    assert other_cert


def test_the_key_guards_every_generation_method_but_not_health_or_reflection(monkeypatch):
    """An API server with a key and no core behind it, on three gRPC listeners: on six
    connections, which the kernel spreads over them, a call with the key gets past the door (and
    finds no core: UNAVAILABLE); one without is UNAUTHENTICATED."""
    from scheduler_svc.api import request
    from scheduler_svc.api.server import ApiServer, build_server, stop_servers

    monkeypatch.setattr(request, "STARTING_WAIT_S", 0.0)  # a request does not wait for a core that never comes

    async def main():
        api = ApiServer("unix:/nonexistent/core.sock")
        listen = f"127.0.0.1:{free_port()}"
        servers, port, _servicer, _health = await build_server(api, listen, False, listeners=3, api_key=KEY)
        codes, healths, services = {}, [], []
        try:
            assert len(servers) == 3 and listening_sockets(port) == 3
            for conn in range(6):
                # a connection of its own each: the kernel hands each to one of the listeners
                async with grpc.aio.insecure_channel(listen, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
                    stub = generation_pb2_grpc.GenerationStub(channel)
                    for header in (None, f"Bearer {KEY}", "Bearer nope"):
                        md = (("authorization", header),) if header else ()
                        for name, call in (
                            ("GetModelInfo", lambda: stub.GetModelInfo(pb.ModelInfoRequest(), metadata=md)),
                            ("GetStats", lambda: stub.GetStats(pb.StatsRequest(), metadata=md, timeout=10)),
                            ("GetLoads", lambda: stub.GetLoads(pb.LoadsRequest(), metadata=md, timeout=10)),
                            ("Tokenize", lambda: stub.Tokenize(pb.TokenizeRequest(prompt="hi"), metadata=md)),
                            ("Detokenize", lambda: stub.Detokenize(pb.DetokenizeRequest(token_ids=[1]), metadata=md)),
                            ("Abort", lambda: stub.Abort(pb.AbortRequest(request_id="r"), metadata=md, timeout=10)),
                            ("Generate", lambda: _drain(stub.Generate(pb.GenerateRequest(prompt="hi"), metadata=md))),
                            ("Chat", lambda: _drain(stub.Chat(pb.ChatRequest(messages=[pb.ChatMessage(
                                role="user", content="hi")]), metadata=md))),
                        ):
                            try:
                                await call()
                                codes[conn, header, name] = grpc.StatusCode.OK
                            except grpc.aio.AioRpcError as e:
                                codes[conn, header, name] = e.code()
                    healths.append(await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest()))
                    services.append(await _list_services(channel))
        finally:
            await stop_servers(servers, None)
            await api.stop()
        return codes, healths, services, port

    codes, healths, services, port = asyncio.run(main())
    assert len(codes) == 6 * 3 * 8
    for (_conn, header, name), code in codes.items():
        wanted = grpc.StatusCode.UNAVAILABLE if header == f"Bearer {KEY}" else grpc.StatusCode.UNAUTHENTICATED
        assert code == wanted, (header, name)
    for health in healths:
        assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING  # answered: no core yet
    for names in services:
        assert "pagewire.v1.Generation" in names
    assert listening_sockets(port) == 0  # all stopped


async def _drain(call):
    async for _ in call:
        pass


async def _list_services(channel) -> list[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)

    async def requests():
        yield reflection_pb2.ServerReflectionRequest(list_services="")

    async for resp in stub.ServerReflectionInfo(requests()):
        return [s.name for s in resp.list_services_response.service]
    return []


# ---- a served model with a key and TLS ----------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama-gqa")


@pytest.fixture(scope="module")
def secured(model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tls")
    cert, key = make_certificate(tmp)
    port = free_port()
    proc = Proc(["serve", "--model", str(model_dir), "--listen", f"127.0.0.1:{port}", "--block-size", "4",
                 "--num-kv-blocks", "200", "--api-key", KEY, "--tls-cert-file", cert, "--tls-key-file", key],
                tmp / "serve.log")
    proc.wait_for_output("pagewire ready", timeout=120)
    yield proc, f"127.0.0.1:{port}", cert
    proc.stop(30)


@pytest.mark.slow
def test_a_tls_channel_with_the_key_generates_what_the_offline_engine_does(secured, model_dir):
    _serve, addr, cert = secured
    prompt = [5, 6, 7, 8, 9]
    with open_channel(addr, ServerAccess(tls_ca_file=cert)) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        responses = list(stub.Generate(pb.GenerateRequest(prompt_token_ids=prompt, sampling=sampling(max_tokens=8)),
                                       metadata=ServerAccess(KEY).metadata(), timeout=60))
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(pb.GenerateRequest(prompt_token_ids=prompt, sampling=sampling(max_tokens=8)), timeout=60))
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING  # no key needed
    expected = LLM(model_dir, block_size=4, num_kv_blocks=200).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=8))[0]
    assert [t for r in responses for t in r.token_ids] == expected.token_ids


@pytest.mark.slow
def test_a_plaintext_channel_to_the_tls_port_fails(secured):
    _serve, addr, _cert = secured
    with grpc.insecure_channel(addr) as channel:
        with pytest.raises(grpc.RpcError) as failed:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.slow
def test_the_openai_door_needs_the_key_and_speaks_https_only(secured, model_dir):
    import json
    import ssl
    import urllib.error
    import urllib.request

    import httpx2
    import openai

    serve, addr, cert = secured
    base = serve.http_url()
    assert base.startswith("https://")  # the ready line names the scheme the door speaks
    trusted = ssl.create_default_context(cafile=cert)
    expected = LLM(model_dir, block_size=4, num_kv_blocks=200).generate(
        [[5, 6, 7, 8, 9]], SamplingParams(temperature=0, max_tokens=8))[0]
    client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0,
                           http_client=httpx2.Client(verify=trusted))
    out = client.completions.create(model=client.models.list().data[0].id, prompt=[5, 6, 7, 8, 9], max_tokens=8,
                                    temperature=0, extra_body={"return_token_ids": True})
    assert out.choices[0].model_extra["token_ids"] == expected.token_ids
    wrong = openai.OpenAI(base_url=base + "/v1", api_key="not-the-key", max_retries=0,
                          http_client=httpx2.Client(verify=trusted))
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    request = urllib.request.Request(base + "/v1/completions", data=json.dumps({"prompt": "x"}).encode(),
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, context=trusted, timeout=10)
    assert refused.value.code == 401
    assert json.loads(refused.value.read())["error"]["type"] == "authentication_error"
    with urllib.request.urlopen(base + "/health", context=trusted, timeout=10) as r:  # no key needed
        assert r.status == 200
    with pytest.raises((urllib.error.URLError, ConnectionError)):  # plaintext to the HTTPS port
        urllib.request.urlopen(base.replace("https://", "http://") + "/health", timeout=10)


@pytest.mark.slow
def test_the_key_stays_off_the_children_command_lines(secured):
    serve, _addr, _cert = secured
    children = descendants(serve.proc.pid)
    assert len(children) >= 3
    assert all(KEY not in argv for _pid, argv in children)
    assert all("--tls-cert-file" in argv for _pid, argv in children if " api-server " in argv)


@pytest.mark.slow
def test_the_generate_command_and_the_healthcheck_speak_tls_and_send_the_key(secured, monkeypatch):
    _serve, addr, cert = secured
    monkeypatch.delenv("PAGEWIRE_API_KEY", raising=False)

    def run(*argv):
        return subprocess.run([sys.executable, "-m", *argv], cwd=REPO, capture_output=True, text=True, timeout=60)

    base = ("pagewire.cli", "generate", "Hello", "--addr", addr, "--max-tokens", "4", "--tls-ca-file", cert)
    ok = run(*base, "--api-key", KEY)
    assert ok.returncode == 0 and ok.stdout.strip(), ok.stderr
    refused = run(*base)
    assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr
    assert run("pagewire_common.healthcheck", addr, "--tls-ca-file", cert).returncode == 0
    assert run("pagewire_common.healthcheck", addr).returncode == 1


@pytest.mark.slow
def test_the_bench_measures_a_server_that_wants_the_key_over_tls(secured, tmp_path, monkeypatch):
    """Both doors: gRPC over TLS, and the OpenAI door over HTTPS, each with the key."""
    serve, addr, cert = secured
    monkeypatch.delenv("PAGEWIRE_API_KEY", raising=False)
    http_listen = serve.http_url().removeprefix("https://")
    base = [sys.executable, "-m", "pagewire.cli", "bench", "--addr", addr, "--tls-ca-file", cert,
            "--num-requests", "4", "--concurrency", "2", "--prompt-len", "8", "--max-new-tokens", "4",
            "--warmup-runs", "0", "--no-progress", "--backend", "grpc,openai", "--http-listen", http_listen,
            "--json", str(tmp_path / "bench.json")]
    ok = subprocess.run([*base, "--api-key", KEY], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    engines = json.loads((tmp_path / "bench.json").read_text())["engines"]
    for name in ("pagewire", "pagewire-openai"):
        aggregate = engines[name]["aggregate"]
        assert (aggregate["num_requests"], aggregate["num_failed"], aggregate["completion_tokens"]) == (4, 0, 16), name
    # without the key: refused at once (waiting out --connect-timeout would not change it), saying how
    started = time.monotonic()
    refused = subprocess.run([*base, "--connect-timeout", "60"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and time.monotonic() - started < 30
    assert "refused the bench" in refused.stderr and "--api-key" in refused.stderr, refused.stderr


def test_bad_tls_files_stop_serve_with_one_line(tmp_path):
    cert, _key = make_certificate(tmp_path)
    _other_cert, other_key = make_certificate(tmp_path, "other")
    out = subprocess.run([sys.executable, "-m", "pagewire.cli", "serve", "--listen", f"127.0.0.1:{free_port()}",
                          "--tls-cert-file", cert, "--tls-key-file", other_key], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2
    lines = [line for line in (out.stdout + out.stderr).splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("pagewire: error: --tls-cert-file") and "private key" in lines[0]


def test_both_doors_hold_a_request_while_the_api_server_has_not_reached_its_core(monkeypatch):
    """An API server with no core behind it (as one restarted beside others is for a moment):
    a generation request on either door waits up to STARTING_WAIT_S from its start, then gets
    UNAVAILABLE / 503 saying the server is starting."""
    import time

    import aiohttp

    from scheduler_svc.api import request
    from scheduler_svc.api.http_server import start_http
    from scheduler_svc.api.server import ApiServer, build_server, stop_servers

    monkeypatch.setattr(request, "STARTING_WAIT_S", 0.5)

    async def main():
        api = ApiServer(f"127.0.0.1:{free_port()}")  # nothing listens there
        servers, port, _servicer, _health = await build_server(api, f"127.0.0.1:{free_port()}", False)
        runner, http_port = await start_http(api, f"127.0.0.1:{free_port()}", False)
        api.start()
        try:
            started = time.monotonic()
            async with aiohttp.ClientSession() as session:
                async with session.post(f"http://127.0.0.1:{http_port}/v1/completions",
                                        json={"prompt": "hi", "max_tokens": 2}) as r:
                    http = (r.status, (await r.json())["error"]["message"], time.monotonic() - started)
            api.started_at = started = time.monotonic()
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                try:
                    await _drain(generation_pb2_grpc.GenerationStub(channel).Generate(
                        pb.GenerateRequest(prompt_token_ids=[1, 2])))
                    grpc_answer = None
                except grpc.aio.AioRpcError as e:
                    grpc_answer = (e.code(), e.details(), time.monotonic() - started)
        finally:
            await runner.cleanup()
            await stop_servers(servers, None)
            await api.stop()
        return http, grpc_answer

    http, grpc_answer = asyncio.run(main())
    starting = "this API server is starting: its engine core is not reachable yet"
    assert http[:2] == (503, starting) and 0.3 < http[2] < 5, http
    assert grpc_answer[:2] == (grpc.StatusCode.UNAVAILABLE, starting) and 0.3 < grpc_answer[2] < 5, grpc_answer
