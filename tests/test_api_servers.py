"""`pagewire serve` with several API-server processes on one port, supervised: parity over many
connections, an API server or the worker killed mid-stream, a crash before ready, a hard kill."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import grpc
import pytest

from pagewire import LLM, SamplingParams
from pagewire.v1 import generation_pb2 as pb
from pagewire.v1 import generation_pb2_grpc
from tests.service_utils import (REPO, Proc, descendants, free_port, generate_on_new_connection, listening_sockets,
                                 own_channel, ready_channel, sampling, wait_until)
from tests.tiny_models import sample_prompts

pytestmark = pytest.mark.slow

ENGINE = ["--block-size", "4", "--num-kv-blocks", "600", "--max-num-batched-tokens", "64"]
LISTENERS = 3  # gRPC listeners per API server in the module's served fixture


def own_stub(addr: str) -> generation_pb2_grpc.GenerationStub:
    return generation_pb2_grpc.GenerationStub(own_channel(addr))


def api_server_pids(serve: Proc) -> list[int]:
    return [pid for pid, argv in descendants(serve.proc.pid) if " api-server " in f" {argv} "]


def worker_pid(serve: Proc) -> int:
    (pid,) = [pid for pid, argv in descendants(serve.proc.pid) if " worker --listen" in argv]
    return pid


def read_rest(calls, firsts) -> tuple[dict[int, object], list[threading.Thread]]:
    """Read the rest of every stream in a thread of its own: call i's outcome is all its tokens,
    or the status code it ended with (filled in as the threads finish)."""
    outcomes: dict[int, object] = {}

    def finish(i):
        try:
            outcomes[i] = firsts[i] + [t for r in calls[i] for t in r.token_ids]
        except grpc.RpcError as e:
            outcomes[i] = e.code()

    threads = [threading.Thread(target=finish, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    return outcomes, threads


def all_blocks_free(addr: str):
    def done():
        # an API server may be restarting: a ready connection first, and a bounded wait on the
        # call (see generate_on_new_connection)
        channel = ready_channel(addr, 5)
        if channel is None:
            return None
        with channel:
            s = generation_pb2_grpc.GenerationStub(channel).GetStats.future(pb.StatsRequest(), timeout=5).result(
                timeout=10)
        return s.num_running == 0 and s.num_waiting == 0 and s.num_free_blocks == s.num_total_blocks and s

    return wait_until(done, timeout=15)


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama-gqa")


@pytest.fixture(scope="module")
def offline(model_dir):
    return LLM(model_dir, block_size=4, num_kv_blocks=600, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def served(model_dir, tmp_path_factory):
    port = free_port()
    proc = Proc(["serve", "--model", str(model_dir), "--listen", f"127.0.0.1:{port}", "--api-servers", "2",
                 "--grpc-listeners", str(LISTENERS), *ENGINE], tmp_path_factory.mktemp("serve") / "serve.log")
    proc.wait_for_output("pagewire ready", timeout=120)
    yield proc, f"127.0.0.1:{port}"
    proc.stop(30)


def test_two_api_servers_greedy_parity_over_20_connections(served, offline, model_dir):
    serve, addr = served
    assert len(api_server_pids(serve)) == 2
    assert listening_sockets(int(addr.rpartition(":")[2])) == 2 * LISTENERS  # the flag reached both
    prompts = (sample_prompts(model_dir, n=8) * 3)[:20]
    expected = offline.generate(prompts, SamplingParams(temperature=0, max_tokens=24))
    results: dict[int, tuple[list[int], str, pb.GenerateResponse]] = {}

    def one(i):
        responses = list(own_stub(addr).Generate(
            pb.GenerateRequest(prompt_token_ids=prompts[i], sampling=sampling(max_tokens=24)), timeout=60))
        results[i] = ([t for r in responses for t in r.token_ids], "".join(r.text for r in responses), responses[-1])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert [results[i][0] for i in range(20)] == [o.token_ids for o in expected]
    assert [results[i][1] for i in range(20)] == [o.text for o in expected]
    for i in range(20):
        assert results[i][2].usage.completion_tokens == len(expected[i].token_ids)
        assert results[i][2].usage.prompt_tokens == len(prompts[i])
    # both API servers served some of the connections: their text came through each
    stats = all_blocks_free(addr)
    assert stats.num_requests_finished >= 20


def test_stats_and_model_info_come_from_the_core_whichever_server_answers(served, model_dir):
    _, addr = served
    infos = {own_stub(addr).GetModelInfo(pb.ModelInfoRequest()).SerializeToString() for _ in range(8)}
    assert len(infos) == 1
    before = own_stub(addr).GetStats(pb.StatsRequest())
    for _ in range(6):  # rejected at whichever API server gets the connection
        with pytest.raises(grpc.RpcError) as err:
            list(own_stub(addr).Generate(pb.GenerateRequest(prompt_token_ids=[1, 10**6])))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    stats = [own_stub(addr).GetStats(pb.StatsRequest()) for _ in range(6)]
    assert {s.num_requests_rejected - before.num_requests_rejected for s in stats} == {6}


def test_killing_an_api_server_fails_only_its_calls_and_serve_replaces_it(served, offline, model_dir):
    serve, addr = served
    old = set(api_server_pids(serve))
    assert len(old) == 2
    # 20 distinct prompts, none shared with the other tests (no prefix-cache hits), and
    # 20 x (27 + 80) tokens fit the 2,400-token cache (no preemption)
    prompts = sample_prompts(model_dir, lengths=list(range(8, 28)), seed=11)
    params = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
    expected = [o.token_ids for o in offline.generate(prompts, params)]
    calls = [own_stub(addr).Generate(pb.GenerateRequest(prompt_token_ids=p, sampling=sampling(max_tokens=80, ignore_eos=True)),
                                     timeout=120) for p in prompts]
    firsts = [list(next(c).token_ids) for c in calls]  # every stream is running
    victim = sorted(old)[0]
    os.kill(victim, signal.SIGKILL)
    outcomes, threads = read_rest(calls, firsts)
    for t in threads:
        t.join(120)
    failed = [i for i in range(20) if outcomes[i] == grpc.StatusCode.UNAVAILABLE]
    completed = [i for i in range(20) if isinstance(outcomes[i], list)]
    assert failed and completed and len(failed) + len(completed) == 20  # the kernel spread 20 connections
    for i in completed:
        assert outcomes[i] == expected[i]
    all_blocks_free(addr)  # the core aborted the dead server's requests
    new = wait_until(lambda: (pids := set(api_server_pids(serve))) and len(pids) == 2 and victim not in pids and pids)
    assert len(new - old) == 1
    # and the replacement serves, on all its listeners: every new connection works
    wait_until(lambda: "api-server ready" in serve.output().split("exited with code")[-1], timeout=30)
    assert listening_sockets(int(addr.rpartition(":")[2])) == 2 * LISTENERS
    for p in prompts[:6]:
        ids = [t for r in own_stub(addr).Generate(pb.GenerateRequest(prompt_token_ids=p, sampling=sampling(max_tokens=5)))
               for t in r.token_ids]
        assert ids == offline.generate([p], SamplingParams(temperature=0, max_tokens=5))[0].token_ids
    assert "exited with code -9; restarting it" in serve.output()


def test_a_worker_killed_while_idle_is_replaced_before_the_next_request(served, offline):
    """Nothing in flight, so the core reads nothing from the worker: the end of its session alone
    tells the core, which reconnects to the restarted worker before a request comes, and the next
    request is served, not failed."""
    serve, addr = served
    old_worker = worker_pid(serve)
    connected = serve.output().count("connected to worker")
    os.kill(old_worker, signal.SIGKILL)
    wait_until(lambda: serve.output().count("connected to worker") > connected, timeout=60, interval=0.2)
    assert worker_pid(serve) != old_worker
    ids = [t for r in own_stub(addr).Generate(pb.GenerateRequest(prompt_token_ids=[5, 6, 7],
                                                                 sampling=sampling(max_tokens=8)), timeout=30)
           for t in r.token_ids]
    assert ids == offline.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=8))[0].token_ids
    all_blocks_free(addr)


def test_killing_the_worker_gives_unavailable_then_serve_serves_again(served, offline, model_dir):
    serve, addr = served
    old_worker = worker_pid(serve)
    req = pb.GenerateRequest(prompt_token_ids=[5, 6, 7], sampling=sampling(max_tokens=250, ignore_eos=True))
    calls = [own_stub(addr).Generate(req, timeout=60) for _ in range(4)]
    for c in calls:
        next(c)
    t0 = time.monotonic()
    os.kill(old_worker, signal.SIGKILL)
    for c in calls:
        with pytest.raises(grpc.RpcError) as err:
            list(c)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert time.monotonic() - t0 < 5
    expected = offline.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=8))[0].token_ids

    def serves_again():
        try:
            return generate_on_new_connection(addr, pb.GenerateRequest(prompt_token_ids=[5, 6, 7],
                                                                       sampling=sampling(max_tokens=8)))
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.UNAVAILABLE
            return None

    assert wait_until(serves_again, timeout=60, interval=0.3) == expected
    assert worker_pid(serve) != old_worker
    all_blocks_free(addr)


def test_a_frozen_api_server_does_not_hold_the_others(served, offline, model_dir):
    """The core waits for every API server to hand on its tokens (backpressure); one that stops
    answering (SIGSTOP) is dropped after the keepalive timeout, and the other's streams finish."""
    serve, addr = served
    victim = sorted(api_server_pids(serve))[0]
    # 16 distinct prompts, none shared with the other tests, and 16 x (45 + 60) tokens fit the
    # 2,400-token cache (no preemption)
    prompts = sample_prompts(model_dir, lengths=list(range(30, 46)), seed=12)
    expected = [o.token_ids for o in offline.generate(prompts, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))]
    calls = [own_stub(addr).Generate(pb.GenerateRequest(prompt_token_ids=p, sampling=sampling(max_tokens=60, ignore_eos=True)),
                                     timeout=40) for p in prompts]
    firsts = [list(next(c).token_ids) for c in calls]
    os.kill(victim, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        outcomes, threads = read_rest(calls, firsts)
        completed = wait_until(lambda: [i for i in range(16) if isinstance(outcomes.get(i), list)] or None, timeout=30)
        assert time.monotonic() - t0 < 30
    finally:
        os.kill(victim, signal.SIGKILL)  # a stopped process dies of it too; the scheduler may reap it at once
    for t in threads:
        t.join(60)
    completed = [i for i in range(16) if isinstance(outcomes[i], list)]
    assert completed and len(completed) < 16  # the frozen server's calls did not complete
    for i in completed:
        assert outcomes[i] == expected[i]
    all_blocks_free(addr)
    wait_until(lambda: (pids := api_server_pids(serve)) and len(pids) == 2 and victim not in pids, timeout=30)


def test_killing_the_core_restarts_it_with_new_api_servers(model_dir, offline, tmp_path):
    """The scheduler core SIGKILLed: its API servers exit with it (parent-death signal), serve
    starts a new core, which starts new API servers on the same port, and serving goes on. The
    dead core's temp folder was in serve's, which goes when serve stops."""
    port = free_port()
    addr = f"127.0.0.1:{port}"
    tmp = tempfile.mkdtemp(prefix="pw-core-")  # every temp folder of the tree (short: unix socket paths)
    serve = Proc(["serve", "--model", str(model_dir), "--listen", addr, "--api-servers", "2", *ENGINE],
                 tmp_path / "serve.log", env=dict(os.environ, TMPDIR=tmp))
    try:
        serve.wait_for_output("pagewire ready", timeout=120)
        (core,) = [pid for pid, argv in descendants(serve.proc.pid) if _role(argv) == "scheduler"]
        old_api = set(api_server_pids(serve))
        os.kill(core, signal.SIGKILL)
        expected = offline.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=6))[0].token_ids

        def serves_again():
            try:
                return generate_on_new_connection(addr, pb.GenerateRequest(prompt_token_ids=[5, 6, 7],
                                                                           sampling=sampling(max_tokens=6)))
            except grpc.RpcError:
                return None

        assert wait_until(serves_again, timeout=60, interval=0.3) == expected
        new_api = wait_until(lambda: (pids := set(api_server_pids(serve))) and len(pids) == 2 and pids, timeout=30)
        assert not new_api & old_api
        assert all(not os.path.exists(f"/proc/{pid}") or _is_zombie(pid) for pid in old_api)
        assert serve.proc.poll() is None and "the scheduler exited with code -9; restarting it" in serve.output()
        (run_dir,) = os.listdir(tmp)  # serve's, holding both cores' folders
        assert len([d for d in os.listdir(os.path.join(tmp, run_dir)) if d.startswith("pagewire-core-")]) == 2
        assert serve.stop(30) == 0
        assert os.listdir(tmp) == []
    finally:
        serve.stop(30)
        shutil.rmtree(tmp, ignore_errors=True)


def test_sigterm_leaves_no_process_behind(model_dir, tmp_path):
    port = free_port()
    serve = Proc(["serve", "--model", str(model_dir), "--listen", f"127.0.0.1:{port}", "--api-servers", "2", *ENGINE],
                 tmp_path / "serve.log")
    try:
        serve.wait_for_output("pagewire ready", timeout=120)
        children = descendants(serve.proc.pid)
        roles = sorted(_role(argv) for _, argv in children)
        # each API server tokenizes big prompts in a helper process (with multiprocessing's tracker)
        assert roles == ["api-server"] * 2 + ["helper"] * 4 + ["scheduler", "worker"], children
        serve.signal(signal.SIGTERM)
        assert serve.proc.wait(30) == 0
        for pid, _ in children:
            assert not os.path.exists(f"/proc/{pid}") or _is_zombie(pid)
    finally:
        serve.kill()


def test_hard_kill_of_serve_leaves_no_process_and_no_temp_folder(model_dir, tmp_path):
    port = free_port()
    # every temp folder of the tree goes here (short: unix socket paths are limited to 107 bytes)
    tmp = tempfile.mkdtemp(prefix="pw-kill-")
    serve = Proc(["serve", "--model", str(model_dir), "--listen", f"127.0.0.1:{port}", "--api-servers", "2", *ENGINE],
                 tmp_path / "serve.log", env=dict(os.environ, TMPDIR=tmp))
    children: list[tuple[int, str]] = []
    try:
        serve.wait_for_output("pagewire ready", timeout=120)
        children = descendants(serve.proc.pid)
        roles = sorted(_role(argv) for _, argv in children)
        assert roles == ["api-server"] * 2 + ["helper"] * 4 + ["scheduler", "worker"], children
        assert os.listdir(tmp)  # serve's folder of unix sockets
        os.kill(serve.proc.pid, signal.SIGKILL)
        serve.proc.wait()
        wait_until(lambda: all(not os.path.exists(f"/proc/{pid}") or _is_zombie(pid) for pid, _ in children), timeout=30)
        wait_until(lambda: not os.listdir(tmp), timeout=10)
    finally:
        serve.kill()
        for pid, _ in children:  # only if the test failed: they should be gone
            if not _is_zombie(pid):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(tmp, ignore_errors=True)


def test_a_worker_that_cannot_start_stops_serve_with_one_clear_message(tmp_path):
    port = free_port()
    out = subprocess.run([sys.executable, "-m", "pagewire.cli", "serve", "--model", str(tmp_path / "no-such-model"),
                          "--listen", f"127.0.0.1:{port}", "--http-listen", "127.0.0.1:0"],  # never the shared default
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "the worker exited with code 2 before it was ready; stopping" in out.stderr
    assert out.stderr.count("no-such-model") >= 1 and "restarting" not in out.stderr


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _role(argv: str) -> str:
    for role in ("api-server", "scheduler", "worker"):
        if f"pagewire.cli --log-level info {role} " in argv:
            return role
    return "helper"


def test_an_api_server_run_alone_in_front_of_a_core(model_dir, offline, tmp_path):
    """`pagewire api-server --scheduler ADDR` adds a front door to a core started with --core-listen:
    it serves the same tokens, and the core counts its requests."""
    from tests.service_utils import start_worker

    worker, worker_addr = start_worker(model_dir, tmp_path, extra=["--block-size", "4", "--num-kv-blocks", "600"])
    core_addr = f"127.0.0.1:{free_port()}"
    public = f"127.0.0.1:{free_port()}"
    sched = Proc(["scheduler", "--worker", worker_addr, "--listen", public, "--core-listen", core_addr,
                  "--max-num-batched-tokens", "64"], tmp_path / "scheduler.log")
    extra_addr = f"127.0.0.1:{free_port()}"
    api = None
    try:
        sched.wait_for_output("scheduler ready", timeout=60)
        api = Proc(["api-server", "--scheduler", core_addr, "--listen", extra_addr], tmp_path / "api.log")
        api.wait_for_output("api-server ready", timeout=60)
        prompt = [5, 6, 7, 8]
        expected = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=10))[0]
        for addr in (extra_addr, public):
            responses = list(own_stub(addr).Generate(pb.GenerateRequest(prompt_token_ids=prompt,
                                                                         sampling=sampling(max_tokens=10))))
            assert [t for r in responses for t in r.token_ids] == expected.token_ids
            assert "".join(r.text for r in responses) == expected.text
        stats = own_stub(extra_addr).GetStats(pb.StatsRequest())
        assert stats.num_requests_finished == 2  # both doors, one core
    finally:
        if api is not None:
            api.stop()
        sched.stop()
        worker.stop()


def test_abort_by_request_id_reaches_the_stream_on_either_api_server(served):
    """Abort on a connection of its own (either API server) ends a running Generate CANCELLED
    through the core; a running request_id is refused ALREADY_EXISTS on any connection."""
    _, addr = served
    long = sampling(max_tokens=250, ignore_eos=True)
    names = [f"abort-me-{i}" for i in range(6)]
    calls = [own_stub(addr).Generate(pb.GenerateRequest(request_id=name, prompt_token_ids=[5, 6, 7 + i],
                                                        sampling=long), timeout=60)
             for i, name in enumerate(names)]
    firsts = [next(c) for c in calls]  # every stream is running
    assert [r.request_id for r in firsts] == names
    with pytest.raises(grpc.RpcError) as err:
        list(own_stub(addr).Generate(pb.GenerateRequest(request_id=names[0], prompt_token_ids=[1, 2], sampling=long),
                                     timeout=30))
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    replies = [own_stub(addr).Abort(pb.AbortRequest(request_id=name), timeout=10) for name in names]
    assert [r.found for r in replies] == [True] * 6
    for call in calls:
        with pytest.raises(grpc.RpcError) as err:
            list(call)
        assert err.value.code() == grpc.StatusCode.CANCELLED
        assert "was aborted" in err.value.details()
    assert not own_stub(addr).Abort(pb.AbortRequest(request_id=names[0]), timeout=10).found  # no longer running
    assert not own_stub(addr).Abort(pb.AbortRequest(request_id="never-ran"), timeout=10).found
    with pytest.raises(grpc.RpcError) as err:
        own_stub(addr).Abort(pb.AbortRequest(), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    all_blocks_free(addr)
    # the name can be used again once its request ended
    again = list(own_stub(addr).Generate(pb.GenerateRequest(request_id=names[0], prompt_token_ids=[5, 6, 7],
                                                            sampling=sampling(max_tokens=4)), timeout=30))
    assert sum(len(r.token_ids) for r in again) == 4


@pytest.mark.slow
def test_requests_cut_off_at_shutdown_say_why(model_dir, tmp_path):
    """Past --shutdown-timeout the requests still running end UNAVAILABLE with a message that
    names the timeout, not gRPC's "Cancelling all calls"."""
    from concurrent.futures import ThreadPoolExecutor

    port = free_port()
    addr = f"127.0.0.1:{port}"
    serve = Proc(["serve", "--model", str(model_dir), "--listen", addr, "--api-servers", "1", "--max-num-seqs", "1",
                  "--shutdown-timeout", "0.5", *ENGINE], tmp_path / "serve.log")
    try:
        serve.wait_for_output("pagewire ready", timeout=120)
        channel = grpc.insecure_channel(addr)
        stub_ = generation_pb2_grpc.GenerationStub(channel)

        def one(i):
            try:
                list(stub_.Generate(pb.GenerateRequest(prompt_token_ids=[5 + i, 6, 7], sampling=sampling(
                    max_tokens=240, ignore_eos=True)), timeout=60))
                return "ok"
            except grpc.RpcError as e:
                return e.code(), e.details()

        with ThreadPoolExecutor(8) as pool:  # one runs at a time: most are still queued at the deadline
            futures = [pool.submit(one, i) for i in range(8)]
            # all 8 taken by the core (on a loaded host the last threads send late: a request that
            # arrives after SIGTERM is refused as the server is shutting down, not cut off)
            def all_taken() -> bool:
                stats = stub_.GetStats(pb.StatsRequest())
                return stats.num_waiting >= 2 and stats.num_running + stats.num_waiting + stats.num_requests_finished == 8

            wait_until(all_taken, timeout=30, interval=0.01)
            serve.signal(signal.SIGTERM)
            results = [f.result(timeout=60) for f in futures]
        channel.close()
        cut = [r for r in results if r != "ok"]
        assert cut and all(r == (grpc.StatusCode.UNAVAILABLE, "the server is shutting down: the request did not "
                                 "finish within --shutdown-timeout (0.5 s)") for r in cut), results
        assert serve.proc.wait(30) == 0
    finally:
        serve.stop(30)


def test_http_health_is_503_while_the_server_drains(model_dir, tmp_path):
    """After SIGTERM the API servers refuse new requests while the running ones finish: /health
    says so (503, as gRPC health says NOT_SERVING), so a load balancer sends nothing more."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.openai_stack import http_json

    addr, http = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    serve = Proc(["serve", "--model", str(model_dir), "--listen", addr, "--http-listen", http, "--api-servers", "1",
                  "--max-num-seqs", "1", "--shutdown-timeout", "60", *ENGINE], tmp_path / "serve.log")
    url = f"http://{http}"
    try:
        serve.wait_for_output("pagewire ready", timeout=120)
        assert http_json(url, "/health")[0] == 200
        channel = grpc.insecure_channel(addr)
        stub_ = generation_pb2_grpc.GenerationStub(channel)

        def one(i):
            return len(list(stub_.Generate(pb.GenerateRequest(prompt_token_ids=[5 + i, 6, 7], sampling=sampling(
                max_tokens=240, ignore_eos=True)), timeout=120)))

        with ThreadPoolExecutor(8) as pool:  # one runs at a time: the drain lasts while the rest run
            futures = [pool.submit(one, i) for i in range(8)]
            # every one taken by the core before SIGTERM (one still on its way would be refused, rightly)
            wait_until(lambda: (lambda s: s.num_running + s.num_waiting + s.num_requests_finished == 8
                                and s.num_waiting >= 4)(stub_.GetStats(pb.StatsRequest())), timeout=30, interval=0.01)
            serve.signal(signal.SIGTERM)
            status, answer = wait_until(lambda: (lambda got: got if got[0] != 200 else None)(http_json(url, "/health")),
                                        timeout=10, interval=0.01)
            assert status == 503 and answer["error"]["message"] == "the server is shutting down", answer
            assert all(f.result(timeout=120) > 0 for f in futures)  # the requests it had still finished
        channel.close()
        assert serve.proc.wait(30) == 0
    finally:
        serve.stop(30)
