"""Several engine cores behind the same API servers, as real processes talking only through their
addresses: two ``pagewire core --listen 127.0.0.1:PORT`` (each a worker and a core, as on another
machine) and API servers given both (``pagewire api-server --scheduler A,B``), and ``pagewire serve
--data-parallel-size 2`` as one command. After every scenario each core's block accounting
balances (nothing running or waiting, every block free)."""

from __future__ import annotations

import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from pagewire import LLM, SamplingParams
from pagewire.cli import build_parser
from pagewire_common.settings import Settings
from pagewire_common.v1 import core_pb2_grpc
from pagewire_common.v1 import generation_pb2 as pb
from pagewire_common.v1 import generation_pb2_grpc as pb_grpc
from scheduler_svc.api.server import split_core_addresses
from tests.service_utils import Proc, descendants, free_port, sampling, stub, wait_until
from tests.tiny_models import sample_prompts

ENGINE = ["--block-size", "4", "--num-kv-blocks", "600", "--max-num-batched-tokens", "64"]


# ---- bad input: clear errors before anything starts ----------------------------------------------


@pytest.mark.parametrize("argv, message", [
    (["serve", "--data-parallel-size", "0"], "argument --data-parallel-size: must be a number >= 1, got 0"),
    (["serve", "--data-parallel-size", "two"], "not a number: 'two'"),
    (["serve", "--data-parallel-routing", "random"], "invalid choice: 'random'"),
    (["serve", "--data-parallel-cores", "10.0.0.2"], "must be HOST:PORT[,HOST:PORT...]"),
    (["serve", "--data-parallel-cores", "10.0.0.2:7000,:7001"], "':7001' is not host:port"),
    (["serve", "--data-parallel-balance-threshold", "-1"], "must be a number >= 0"),
])
def test_bad_data_parallel_flags_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_bad_core_addresses_and_devices_are_refused():
    with pytest.raises(ValueError, match=r"bad engine core address 'nowhere' in 'unix:/a,nowhere'"):
        split_core_addresses("unix:/a,nowhere")
    with pytest.raises(ValueError, match="bad engine core address ''"):
        split_core_addresses("127.0.0.1:5,")
    assert split_core_addresses("unix:/a, 127.0.0.1:5") == ["unix:/a", "127.0.0.1:5"]
    with pytest.raises(ValueError, match="engine core address 'unix:/a' is given twice in 'unix:/a,unix:/a'"):
        split_core_addresses("unix:/a,unix:/a")
    from pagewire.serve import serve_core, worker_settings

    with pytest.raises(ValueError, match="--device cuda:1 pins one GPU; with --data-parallel-size 2"):
        worker_settings(Settings(data_parallel_size=2, device="cuda:1"))
    assert [w.device for w in worker_settings(Settings(data_parallel_size=2, device="cpu"))] == ["cpu", "cpu"]
    assert worker_settings(Settings(data_parallel_size=2, device="cpu", num_threads=3))[1].num_threads == 3
    with pytest.raises(ValueError, match="--listen must be host:port, got 'unix:/tmp/x'"):
        serve_core(Settings(), "unix:/tmp/x")


# ---- two cores at their addresses ------------------------------------------------------------------

@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama-gqa")


@pytest.fixture(scope="module")
def offline(model_dir):
    return LLM(model_dir, block_size=4, num_kv_blocks=600, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def cores(model_dir, tmp_path_factory):
    """Two engine cores, each `pagewire core --listen 127.0.0.1:PORT` (worker + core)."""
    tmp = tmp_path_factory.mktemp("dp")
    procs, addresses = [], []
    for i in range(2):
        address = f"127.0.0.1:{free_port()}"
        procs.append(Proc(["core", "--model", str(model_dir), "--listen", address, "--num-threads", "1", *ENGINE],
                          tmp / f"core{i}.log"))
        addresses.append(address)
    for proc in procs:
        proc.wait_for_output("engine core ready", timeout=90)
    yield procs, addresses
    for proc in procs:
        proc.stop()


class ApiServerProc:
    """`pagewire api-server --scheduler A[,B]` on a port of its own."""

    def __init__(self, core_addresses: list[str], tmp, routing: str | None = None):
        self.address = f"127.0.0.1:{free_port()}"
        argv = ["api-server", "--scheduler", ",".join(core_addresses), "--listen", self.address]
        if routing:
            argv += ["--data-parallel-routing", routing]
        self.proc = Proc(argv, tmp / f"api-{self.address.rpartition(':')[2]}.log")
        self.proc.wait_for_output("api-server ready", timeout=60)
        self.stub = stub(self.address)

    def stop(self):
        self.proc.stop()


def core_stats(address: str) -> pb.Stats:
    with grpc.insecure_channel(address) as channel:
        return core_pb2_grpc.SchedulerCoreStub(channel).CoreStats(pb.StatsRequest(), timeout=5)


def assert_every_core_balanced(api_stub, num_cores: int = 2):
    """Through GetLoads: every core listed, nothing running or waiting, every block free."""
    def balanced():
        loads = api_stub.GetLoads(pb.LoadsRequest(), timeout=5).cores
        return len(loads) == num_cores and all(
            (c.num_running, c.num_waiting, c.num_used_blocks) == (0, 0, 0) for c in loads) and loads

    loads = wait_until(balanced, timeout=15)
    assert [c.core for c in loads] == list(range(num_cores))


def generate(api_stub, prompts, max_tokens=16, **kw) -> list[list[int]]:
    def one(p):
        responses = list(api_stub.Generate(pb.GenerateRequest(prompt_token_ids=p, sampling=sampling(
            max_tokens=max_tokens, **kw))))
        return [t for r in responses for t in r.token_ids]

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def long_request(api_stub, prompt: list[int], first_output: threading.Event | None = None) -> tuple:
    """240 tokens for ``prompt``: ("ok", tokens, finish reason), or (status code, details);
    ``first_output`` is set once the first response has arrived."""
    responses = []
    try:
        for response in api_stub.Generate(pb.GenerateRequest(prompt_token_ids=prompt, sampling=sampling(
                max_tokens=240, ignore_eos=True))):
            responses.append(response)
            if first_output is not None:
                first_output.set()
        return "ok", sum(len(r.token_ids) for r in responses), responses[-1].finish_reason
    except grpc.RpcError as e:
        return e.code(), e.details()


def shared_prefix_prompts(model_dir, n: int, groups: int) -> list[list[int]]:
    """``n`` prompts: one of ``groups`` 40-token prefixes each (in turn), then 1-3 tokens of their own."""
    windows = sample_prompts(model_dir, lengths=[60] * groups, seed=7)
    return [windows[i % groups][:40] + windows[(i + 1) % groups][40:40 + 1 + i % 3] for i in range(n)]


@pytest.mark.slow
def test_greedy_outputs_are_identical_for_one_and_two_cores_and_every_routing(cores, model_dir, offline, tmp_path):
    _, addresses = cores
    prompts = sample_prompts(model_dir, n=8) + shared_prefix_prompts(model_dir, 8, groups=2)
    expected = [o.token_ids for o in offline.generate(prompts, SamplingParams(temperature=0, max_tokens=16))]
    layouts = [(addresses[:1], None), (addresses, "cache-aware"), (addresses, "round-robin"), (addresses, "least-loaded")]
    for core_addresses, routing in layouts:
        finished_before = [core_stats(a).num_requests_finished for a in addresses]
        api = ApiServerProc(core_addresses, tmp_path, routing)
        try:
            assert generate(api.stub, prompts) == expected, routing
            assert_every_core_balanced(api.stub, len(core_addresses))
        finally:
            api.stop()
        finished = [core_stats(a).num_requests_finished - b for a, b in zip(addresses, finished_before)]
        assert sum(finished) == len(prompts)
        if routing == "round-robin":
            assert finished == [8, 8]  # one API server: exactly in turn
        elif routing is None:
            assert finished == [16, 0]


@pytest.mark.slow
def test_cache_aware_routing_keeps_each_prefix_on_one_core(cores, model_dir, tmp_path):
    """Three prefixes in turn, one request at a time: after the first request of each, every
    request with that prefix goes where the prefix is, and finds all its 10 full blocks there."""
    _, addresses = cores
    windows = sample_prompts(model_dir, lengths=[50] * 3, seed=11)
    prompts = [[300 + g] + windows[g][:39] + [400 + i] for i in range(4) for g in range(3)]
    before = [core_stats(a) for a in addresses]
    api = ApiServerProc(addresses, tmp_path, "cache-aware")
    try:
        for p in prompts:
            generate(api.stub, [p], max_tokens=2)
        assert_every_core_balanced(api.stub)
    finally:
        api.stop()
    after = [core_stats(a) for a in addresses]
    finished = [a.num_requests_finished - b.num_requests_finished for a, b in zip(after, before)]
    hits = sum(a.num_prefix_cache_hit_tokens - b.num_prefix_cache_hit_tokens for a, b in zip(after, before))
    assert sorted(finished) == [4, 8]  # whole prefixes per core: 1 + 2 groups of 4
    assert hits == 9 * 40  # the 9 requests after each prefix's first find its 40 tokens


@pytest.mark.slow
def test_a_dead_core_fails_only_its_requests_and_rejoins(cores, model_dir, tmp_path):
    procs, addresses = cores
    api = ApiServerProc(addresses, tmp_path, "round-robin")
    try:
        prompts = [[20 + i, 30 + i, 40 + i] for i in range(12)]
        pool = ThreadPoolExecutor(len(prompts))
        first_outputs = [threading.Event() for _ in prompts]
        futures = [pool.submit(long_request, api.stub, p, first) for p, first in zip(prompts, first_outputs)]
        wait_until(lambda: all(core_stats(a).num_running == 6 for a in addresses), timeout=20, interval=0.01)
        # every stream has output: none may go to another core when its own dies (on a slow host a
        # request can be running and still have sent nothing, and such a request is passed on)
        wait_until(lambda: all(first.is_set() for first in first_outputs), timeout=20, interval=0.01)
        # core 1's engine core process dies hard; its worker and core 0 go on
        engine_core = next(pid for pid, argv in descendants(procs[1].proc.pid) if " scheduler " in argv)
        os.kill(engine_core, signal.SIGKILL)
        results = [f.result(timeout=60) for f in futures]
        pool.shutdown()
        # round robin from one API server: 6 requests on each core; core 0's finish, core 1's fail
        ok = [r for r in results if r[0] == "ok"]
        failed = [r for r in results if r[0] != "ok"]
        assert ok == [("ok", 240, pb.LENGTH)] * 6
        assert failed == [(grpc.StatusCode.UNAVAILABLE, f"engine core 1 ({addresses[1]}) is unavailable")] * 6
        # the supervisor of `pagewire core` restarts it; the API server takes it back into the routing
        procs[1].wait_for_output("the engine core exited", timeout=10)
        wait_until(lambda: len(api.stub.GetLoads(pb.LoadsRequest(), timeout=5).cores) == 2, timeout=30, interval=0.2)
        finished_before = [core_stats(a).num_requests_finished for a in addresses]
        assert len(generate(api.stub, prompts[:4], max_tokens=4)) == 4
        finished = [core_stats(a).num_requests_finished - b for a, b in zip(addresses, finished_before)]
        assert finished == [2, 2]
        assert_every_core_balanced(api.stub)
    finally:
        api.stop()


@pytest.mark.slow
def test_serve_with_two_cores_routes_and_reports_per_core(model_dir, offline, tmp_path):
    """`pagewire serve --data-parallel-size 2 --api-servers 2`: the same greedy outputs, GetLoads
    per core, GetStats the sum of both, and a stop that leaves nothing behind."""
    listen = f"127.0.0.1:{free_port()}"
    proc = Proc(["serve", "--model", str(model_dir), "--listen", listen, "--data-parallel-size", "2",
                 "--api-servers", "2", *ENGINE], tmp_path / "serve.log")
    try:
        proc.wait_for_output("pagewire ready", timeout=90)
        assert "with 2 local engine core(s)" in proc.output()
        children = descendants(proc.proc.pid)
        assert sum(" scheduler " in argv and "--core-only" in argv for _, argv in children) == 2
        assert sum(" worker " in argv for _, argv in children) == 2
        prompts = shared_prefix_prompts(model_dir, 12, groups=3)
        expected = [o.token_ids for o in offline.generate(prompts, SamplingParams(temperature=0, max_tokens=8))]
        s = stub(listen)
        assert generate(s, prompts, max_tokens=8) == expected
        api = type("Api", (), {"stub": s})
        assert_every_core_balanced(api.stub)
        loads = s.GetLoads(pb.LoadsRequest()).cores
        stats = s.GetStats(pb.StatsRequest())
        assert stats.num_total_blocks == sum(c.num_total_blocks for c in loads) == 1200
        assert stats.num_requests_finished == len(prompts)
    finally:
        assert proc.stop(timeout=30) == 0
    assert "Traceback" not in proc.output()


@pytest.mark.slow
def test_sigterm_to_serve_with_two_cores_drains_every_api_server_at_once(model_dir, tmp_path):
    """SIGTERM to `serve --data-parallel-size 2 --api-servers 3`: every API server refuses new
    requests from then on (none keeps taking them while another drains)."""
    import time

    from tests.service_utils import own_channel

    listen = f"127.0.0.1:{free_port()}"
    proc = Proc(["serve", "--model", str(model_dir), "--listen", listen, "--data-parallel-size", "2",
                 "--api-servers", "3", "--max-num-seqs", "1", "--shutdown-timeout", "2", *ENGINE],
                tmp_path / "serve.log")
    try:
        proc.wait_for_output("pagewire ready", timeout=90)
        prompts = [[20 + i, 30 + i, 40 + i] for i in range(12)]
        # each on a connection of its own, so that every API server has some to drain; one runs
        # per core and the rest wait, longer than the shutdown timeout
        stubs = [pb_grpc.GenerationStub(own_channel(listen)) for _ in prompts]
        with ThreadPoolExecutor(len(prompts)) as pool:
            futures = [pool.submit(long_request, st, p) for st, p in zip(stubs, prompts)]
            # every one taken by a core before SIGTERM (a late one would be refused as shutting down)
            wait_until(lambda: (lambda s: s.num_running + s.num_waiting + s.num_requests_finished == len(prompts)
                                and s.num_waiting >= 4)(stub(listen).GetStats(pb.StatsRequest())),
                       timeout=30, interval=0.01)
            proc.signal(signal.SIGTERM)
            # all three stop taking requests together (one after another, each would drain first)
            wait_until(lambda: proc.output().count("new requests are refused") == 3, timeout=1.5, interval=0.01)
            late = []
            while proc.proc.poll() is None and len(late) < 100:
                channel = own_channel(listen)
                try:
                    list(pb_grpc.GenerationStub(channel).Generate(pb.GenerateRequest(
                        prompt_token_ids=[60, 61], sampling=sampling(max_tokens=2)), timeout=2))
                    late.append("ok")
                except grpc.RpcError as e:
                    late.append(e.code())
                channel.close()
                time.sleep(0.05)
            results = [f.result(timeout=60) for f in futures]
        assert late and "ok" not in late, late
        # the running ones finished, or were cut at the timeout saying so
        assert all(r == ("ok", 240, pb.LENGTH) or r == (grpc.StatusCode.UNAVAILABLE, "the server is shutting down: the "
                        "request did not finish within --shutdown-timeout (2 s)") for r in results), results
        assert proc.proc.wait(60) == 0
    finally:
        proc.stop(timeout=30)


@pytest.mark.slow
def test_sigterm_to_a_core_lets_its_running_requests_finish(model_dir, tmp_path):
    """`pagewire core` has no API servers of its own to drain: on SIGTERM its engine core refuses
    new requests and keeps stepping the running ones, for up to --shutdown-timeout. It tells the
    API servers, which send new requests to their other cores meanwhile."""
    address, other_address = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    core = Proc(["core", "--model", str(model_dir), "--listen", address, "--num-threads", "1", *ENGINE],
                tmp_path / "core.log")
    other = Proc(["core", "--model", str(model_dir), "--listen", other_address, "--num-threads", "1", *ENGINE],
                 tmp_path / "other.log")
    core.wait_for_output("engine core ready", timeout=90)
    other.wait_for_output("engine core ready", timeout=90)
    api = ApiServerProc([address, other_address], tmp_path, routing="round-robin")
    try:
        prompts = [[20 + i, 30 + i, 40 + i] for i in range(8)]
        with ThreadPoolExecutor(len(prompts)) as pool:
            futures = [pool.submit(long_request, api.stub, p) for p in prompts]
            wait_until(lambda: core_stats(address).num_running == len(prompts) // 2, timeout=20, interval=0.01)
            core.signal(signal.SIGTERM)
            api.proc.wait_for_output("is shutting down: it finishes its running requests", timeout=10)
            # round-robin would send every other one to the core that is shutting down
            late = [list(api.stub.Generate(pb.GenerateRequest(prompt_token_ids=[60 + i, 61], sampling=sampling(
                max_tokens=4, ignore_eos=True)), timeout=30)) for i in range(4)]
            results = [f.result(timeout=60) for f in futures]
        assert results == [("ok", 240, pb.LENGTH)] * len(prompts)
        assert [sum(len(r.token_ids) for r in responses) for responses in late] == [4] * 4
        assert core.proc.wait(30) == 0
        assert "still running; cancelled" not in core.output()
        assert core_stats(other_address).num_requests_finished == len(prompts) // 2 + len(late)
    finally:
        api.stop()
        core.stop()
        other.stop()
