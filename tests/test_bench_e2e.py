"""``pagewire bench`` end to end: it starts a server, measures it, runs the transformers baselines,
and writes JSON and a plot; and its flag errors are clear."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from pagewire.bench.report import cpu_info
from tests.service_utils import REPO, free_port
from tests.tiny_models import get_tiny_model

# matplotlib comes with the optional `bench` extra (pip install 'pagewire[bench]')
HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def run_bench(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run(
        [sys.executable, "-m", "pagewire.cli", "--log-level", "warning", "bench", "--no-progress", *argv],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout,
    )


def explain(proc: subprocess.CompletedProcess, server_log=None) -> str:
    """What to show when a bench run fails: its stderr, and the served server's log."""
    text = f"exit {proc.returncode}\n--- stderr\n{proc.stderr[-4000:]}"
    if server_log is not None and server_log.exists():
        text += f"\n--- server log\n{server_log.read_text(errors='replace')[-4000:]}"
    return text


def processes_mentioning(text: str) -> list[str]:
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found.append(f"{pid}: {cmdline}")
    return found


@pytest.fixture(scope="module")
def model_dir():
    return get_tiny_model("llama-gqa")


@pytest.mark.slow
def test_serve_measure_and_compare_with_baselines(model_dir, tmp_path):
    addr = f"127.0.0.1:{free_port()}"
    out_json, out_png, server_log = tmp_path / "bench.json", tmp_path / "bench.png", tmp_path / "server.log"
    n, new = 8, 8
    proc = run_bench(
        "--serve", "--addr", addr, "--server-log", str(server_log), "--model", str(model_dir),
        "--num-requests", str(n), "--concurrency", "4",
        "--max-new-tokens", str(new), "--ignore-eos", "--prompt-len", "16-48", "--baseline", "hf,hf-cb",
        "--json", str(out_json), "--plot", str(out_png),
    )
    if not HAVE_MATPLOTLIB:  # then the bench refuses --plot up front, before starting anything
        assert proc.returncode == 2 and "pip install 'pagewire[bench]'" in proc.stderr, proc.stderr
        assert not processes_mentioning(addr)
        proc = run_bench(*[a for a in proc.args[proc.args.index("--no-progress") + 1:] if a not in ("--plot", str(out_png))])
    assert proc.returncode == 0, explain(proc, server_log)
    assert not processes_mentioning(addr), "the served server is still running"

    doc = json.loads(out_json.read_text())
    engines = doc["engines"]
    assert list(engines) == ["pagewire", "hf", "hf-cb"]
    prompt_tokens = engines["pagewire"]["aggregate"]["prompt_tokens"]
    assert 16 * n <= prompt_tokens <= 48 * n
    for name, engine in engines.items():
        agg = engine["aggregate"]
        assert (agg["num_requests"], agg["num_failed"]) == (n, 0), name
        assert agg["completion_tokens"] == n * new, name  # the same number of tokens everywhere
        assert agg["prompt_tokens"] == prompt_tokens, name  # and the same prompts
        assert len(engine["runs"]) == 1
        assert agg["e2e_s"]["count"] == n
    assert engines["pagewire"]["per_token_timings"] and engines["hf-cb"]["per_token_timings"]
    assert engines["pagewire"]["aggregate"]["itl_s"]["count"] == n * (new - 1)
    assert engines["hf-cb"]["aggregate"]["itl_s"]["count"] == n * (new - 1)
    assert engines["hf"]["aggregate"]["ttft_s"] is None  # not observable for static batches
    assert engines["hf"]["details"]["batch_size"] == 4
    cb = engines["hf-cb"]["details"]  # what the installed transformers took of our settings, and what not
    assert cb["continuous_batching_config"]["page_size"] == doc["server"]["model_info"]["block_size"]
    assert set(cb["continuous_batching_config"]) | set(cb["continuous_batching_unsupported"]) == {
        "page_size", "num_blocks", "max_batch_tokens", "max_requests_per_batch", "allow_block_sharing", "seed"}
    assert set(doc["comparison"]) == {"hf", "hf-cb"}
    throughput = {name: engine["aggregate"]["completion_tokens_per_s"] for name, engine in engines.items()}
    for name in ("hf", "hf-cb"):  # > 1 means pagewire is better: ours / theirs for throughput
        assert doc["comparison"][name]["completion_tokens_per_s"] == pytest.approx(throughput["pagewire"] / throughput[name])
    assert doc["comparison"]["hf"]["ttft_p50"] is None
    assert doc["argv"][doc["argv"].index("--json") + 1] == str(out_json)
    assert "--serve" in doc["command_line"]
    env = doc["environment"]
    assert env["torch"] and env["cpu_count"] == os.cpu_count() and "gpu" in env
    assert env["cpu_isa"] == cpu_info()["cpu_isa"]
    assert doc["server"]["model_info"]["model_name"] == model_dir.name
    assert doc["config"]["engine"]["max_num_batched_tokens"] == 512

    summary = proc.stdout
    assert "vs hf " in summary and "vs hf-cb" in summary
    throughput = next(line for line in summary.splitlines() if line.startswith("output throughput"))
    assert throughput.count("x") == 2  # a ratio beside each baseline
    if HAVE_MATPLOTLIB:
        assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_null_worker_counts_tokens(tmp_path):
    # the null worker reads only the model's config and tokenizer; text prompts work
    out_json, server_log = tmp_path / "null.json", tmp_path / "server.log"
    n, new = 24, 16
    model = str(get_tiny_model("llama-gqa"))
    proc = run_bench(
        "--serve", "--server-log", str(server_log), "--worker", "null", "--model", model,
        "--num-requests", str(n), "--request-rate", "400", "--client-processes", "2",
        "--max-new-tokens", str(new), "--ignore-eos",
        "--prompt", "The lighthouse keeper woke before dawn. ", "--prompt-repeats", "1,3", "--warmup-runs", "0",
        "--repeat-runs", "2", "--json", str(out_json),
    )
    assert proc.returncode == 0, explain(proc, server_log)
    doc = json.loads(out_json.read_text())
    ours = doc["engines"]["pagewire"]
    assert [r["completion_tokens"] for r in ours["runs"]] == [n * new, n * new]
    assert ours["aggregate"]["completion_tokens"] == 2 * n * new
    assert ours["details"]["client_processes"] == 2
    assert doc["server"]["model_info"]["device"] == "null"
    assert 0 < ours["aggregate"]["client_cpu_fraction"]
    assert "null worker" in proc.stdout
    cpu = cpu_info()  # the machine is named in the JSON and in the summary, its ISA included
    assert {k: doc["environment"][k] for k in cpu} == cpu
    assert f"{cpu['cpu_cores_usable']} cores, ISA {cpu['cpu_isa'] or 'unknown'}" in proc.stdout


@pytest.mark.slow
def test_serve_records_the_servers_cpu_by_role(tmp_path):
    # --serve knows the server's processes: each role's CPU over each measured run, per token
    out_json, server_log = tmp_path / "cpu.json", tmp_path / "server.log"
    n, new, runs = 128, 32, 2
    proc = run_bench(
        "--serve", "--server-log", str(server_log), "--worker", "null", "--model", str(get_tiny_model("llama-gqa")),
        "--api-servers", "2", "--num-requests", str(n), "--concurrency", "32", "--max-new-tokens", str(new),
        "--ignore-eos", "--prompt-len", "8", "--warmup-runs", "1", "--repeat-runs", str(runs), "--json", str(out_json),
    )
    assert proc.returncode == 0, explain(proc, server_log)
    cpu = json.loads(out_json.read_text())["server_cpu"]
    assert cpu["known"] is True
    roles = set(cpu["pids"])
    # each API server has started its tokenizer helper (the model has a tokenizer.json)
    assert roles == {"serve", "worker", "core", "api-server 1", "api-server 2", "api-server 1 helpers",
                     "api-server 2 helpers"}
    assert all(pids and all(isinstance(p, int) for p in pids) for pids in cpu["pids"].values())
    ours = cpu["engines"]["pagewire"]
    assert len(ours["runs"]) == runs and list(cpu["engines"]) == ["pagewire"]
    for by_role in [*ours["runs"], ours["aggregate"]]:
        assert set(by_role) == roles
        for role, figures in by_role.items():
            assert set(figures) == {"cpu_s", "us_per_token", "busy_fraction"}, role
            assert figures["cpu_s"] >= 0 and figures["us_per_token"] >= 0 and figures["busy_fraction"] >= 0, role
        assert by_role["core"]["cpu_s"] > 0
        assert by_role["api-server 1"]["cpu_s"] + by_role["api-server 2"]["cpu_s"] > 0
    agg = ours["aggregate"]
    assert agg["core"]["cpu_s"] == pytest.approx(sum(r["core"]["cpu_s"] for r in ours["runs"]))
    assert agg["core"]["us_per_token"] == pytest.approx(agg["core"]["cpu_s"] * 1e6 / (runs * n * new))
    assert "server CPU us per output token (share of a core), pagewire: " in proc.stdout


def test_without_serve_the_servers_cpu_is_not_known():
    from pagewire.bench.cli import validate_args
    from pagewire.bench.session import Bench
    from pagewire.cli import build_parser

    args = build_parser().parse_args(["bench", "--addr", "127.0.0.1:1"])
    validate_args(args)
    cpu = Bench(args).server_cpu_dict({("grpc", "greedy"): []})
    assert cpu["known"] is False and "--serve" in cpu["reason"]


@pytest.mark.slow
def test_both_doors_side_by_side(tmp_path):
    # the same requests through gRPC and the OpenAI HTTP door, in turn within each run
    out_json, server_log = tmp_path / "doors.json", tmp_path / "server.log"
    n, new = 16, 8
    proc = run_bench(
        "--serve", "--server-log", str(server_log), "--worker", "null", "--model", str(get_tiny_model("llama-gqa")),
        "--backend", "grpc,openai", "--num-requests", str(n), "--concurrency", "4", "--max-new-tokens", str(new),
        "--ignore-eos", "--prompt-len", "8", "--warmup-runs", "0", "--repeat-runs", "2", "--json", str(out_json),
    )
    assert proc.returncode == 0, explain(proc, server_log)
    engines = json.loads(out_json.read_text())["engines"]
    assert set(engines) == {"pagewire", "pagewire-openai"}
    for name, backend in (("pagewire", "grpc"), ("pagewire-openai", "openai")):
        e = engines[name]
        assert e["details"]["backend"] == backend
        assert [r["completion_tokens"] for r in e["runs"]] == [n * new] * 2
        assert e["aggregate"]["prompt_tokens"] == 2 * n * 8
        assert e["aggregate"]["itl_s"]["count"] == 2 * n * (new - 1)  # every token arrival counted
    assert engines["pagewire-openai"]["details"]["addr"].startswith("http://127.0.0.1:")
    assert "vs pagewire-openai" in proc.stdout


@pytest.mark.slow
def test_the_served_server_dies_with_a_bench_killed_hard(tmp_path):
    import signal
    import time

    from tests.service_utils import descendants, is_gone, wait_until

    addr = f"127.0.0.1:{free_port()}"
    server_log = tmp_path / "server.log"
    bench = subprocess.Popen(
        [sys.executable, "-m", "pagewire.cli", "bench", "--no-progress", "--serve", "--addr", addr, "--server-log",
         str(server_log), "--worker", "null", "--model", str(get_tiny_model("llama-gqa")), "--num-requests", "100000",
         "--concurrency", "4", "--max-new-tokens", "64", "--ignore-eos", "--prompt-len", "8"],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: server_log.exists() and "pagewire ready" in server_log.read_text(), timeout=120)
        time.sleep(0.5)  # the load is running
        tree = [pid for pid, argv in descendants(bench.pid) if "pagewire.cli" in argv]
        assert len(tree) >= 4  # serve, worker, scheduler, API server
        os.kill(bench.pid, signal.SIGKILL)
        bench.wait()
        wait_until(lambda: all(is_gone(pid) for pid in tree), timeout=60)
    finally:
        if bench.poll() is None:
            bench.kill()


@pytest.mark.slow
def test_sampling_mixes_are_columns_of_one_run(tmp_path):
    # the same workload three times: plain greedy, then half the requests with penalties, then half
    # with a JSON schema (open-ended, so under --ignore-eos every request still makes its tokens)
    out_json, server_log = tmp_path / "mix.json", tmp_path / "server.log"
    n, new = 8, 12
    proc = run_bench(
        "--serve", "--server-log", str(server_log), "--model", str(get_tiny_model("llama-gqa")),
        "--sampling-mix", "greedy,penalties,json_schema", "--num-requests", str(n), "--concurrency", "4",
        "--max-new-tokens", str(new), "--ignore-eos", "--prompt-len", "8", "--warmup-runs", "0",
        "--json", str(out_json), timeout=300,
    )
    assert proc.returncode == 0, explain(proc, server_log)
    doc = json.loads(out_json.read_text())
    engines = doc["engines"]
    assert set(engines) == {"pagewire", "pagewire-penalties", "pagewire-json_schema"}
    for name, mix in (("pagewire", "greedy"), ("pagewire-penalties", "penalties"),
                      ("pagewire-json_schema", "json_schema")):
        assert engines[name]["details"]["sampling_mix"] == mix
        assert engines[name]["aggregate"]["completion_tokens"] == n * new
    assert doc["config"]["sampling_mix"] == ["greedy", "penalties", "json_schema"]
    assert "vs pagewire-json_schema" in proc.stdout and "sampling mixes (every other request)" in proc.stdout


def test_an_unknown_sampling_mix_is_a_usage_error(capsys):
    from pagewire.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--sampling-mix", "greedy,beam"])
    assert exit_.value.code == 2
    assert "give one or more of greedy, penalties" in capsys.readouterr().err


def test_a_sampling_mix_changes_every_other_request():
    from pagewire.bench.loadgen import build_requests
    from pagewire.bench.sampling_mix import BENCH_SCHEMA, apply_mix
    from pagewire.client import make_sampling

    plain = build_requests([[1, 2], [3, 4], [5, 6], [7, 8]], make_sampling(max_tokens=5, ignore_eos=True))
    mixed = apply_mix(plain, "json_schema")
    assert [json.loads(r.sampling.json_schema) if r.sampling.json_schema else None for r in mixed] == \
        [None, BENCH_SCHEMA, None, BENCH_SCHEMA]
    assert all(r.sampling.ignore_eos and r.sampling.max_tokens == 5 for r in mixed)
    assert not any(r.sampling.json_schema for r in plain)  # the plain requests are left as they were
    penalties = apply_mix(plain, "penalties")
    assert [r.sampling.repetition_penalty for r in penalties] == pytest.approx([0, 1.1, 0, 1.1])


# ---- flag errors (in process, no server) ----------------------------------------------------------


def bench_main(capsys, *argv: str) -> tuple[int, str]:
    from pagewire.cli import main

    code = main(["--log-level", "warning", "bench", "--no-progress", *argv])
    return code, capsys.readouterr().err


def test_an_unknown_backend_is_a_usage_error(capsys):
    from pagewire.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--backend", "grpc,rest"])
    assert exit_.value.code == 2
    assert "give one or more of grpc, openai" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--concurrency", "4", "--request-rate", "5"], "not both"),
        (["--prompt", "hi", "--prompt-len", "8"], "not both"),
        (["--prompt-repeats", "1,2"], "needs --prompt"),
        (["--serve", "--worker", "null", "--baseline", "hf"], "nothing to compare"),
        (["--worker", "null"], "add --serve"),
        (["--baseline", "vllm"], "unknown baseline 'vllm'"),
        (["--concurrency", "2", "--client-processes", "4"], "more than --concurrency"),
        (["--backend", "openai", "--client-processes", "2"], "--client-processes 1"),
    ],
)
def test_bad_flag_combinations_are_explained(capsys, argv, message):
    code, err = bench_main(capsys, *argv)
    assert code == 2
    assert message in err


def test_an_output_file_that_cannot_be_written_is_refused_before_the_run(capsys, tmp_path):
    for path, message in (("/proc/no/x.json", "cannot write in /proc"), (str(tmp_path), "it is a folder")):
        code, err = bench_main(capsys, "--addr", "127.0.0.1:1", "--json", path)
        assert code == 2 and f"--json {path}: {message}" in err, err
    code, err = bench_main(capsys, "--addr", "127.0.0.1:1", "--connect-timeout", "0.5",
                           "--json", str(tmp_path / "new" / "out.json"))
    assert "no server answers" in err  # a folder to make is fine: the run went on to connect


def test_progress_into_a_log_is_lines(capsys, monkeypatch):
    from pagewire.bench import session

    clock = iter([0.0, 10.0, 31.0, 32.0, 70.0])
    monkeypatch.setattr(session.time, "monotonic", lambda: next(clock))
    with session.LineProgress("pagewire run 1/1", 8) as bar:
        bar.update(2)  # t=10: quiet
        bar.update(3)  # t=31: a line
        bar.update(1)  # t=32: quiet
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["pagewire run 1/1: 8 requests", "pagewire run 1/1: 5/8 requests done, 31 s",
                     "pagewire run 1/1: 6/8 requests done, 70 s"]


def test_unreachable_server_is_explained(capsys):
    addr = f"127.0.0.1:{free_port()}"
    code, err = bench_main(capsys, "--addr", addr, "--connect-timeout", "0.5")
    assert code == 2
    assert f"no server answers at {addr}" in err and "--serve" in err


def test_serve_on_a_busy_port_is_explained(capsys):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        addr = f"127.0.0.1:{busy.getsockname()[1]}"
        code, err = bench_main(capsys, "--serve", "--addr", addr, "--model", str(get_tiny_model("llama-gqa")))
    assert code == 2
    assert f"--serve cannot listen on {addr}" in err and "drop --serve" in err


def test_bad_values_are_rejected_by_the_parser(capsys):
    from pagewire.cli import main

    for argv in (["--prompt-len", "8-4"], ["--prompt-len", "x"], ["--request-rate", "0"], ["--prompt-repeats", "0"]):
        with pytest.raises(SystemExit) as exc:
            main(["bench", *argv])
        assert exc.value.code == 2
    assert "need 1 <= low <= high" in capsys.readouterr().err


def test_serve_passes_engine_options_to_the_server():
    """Every engine option --serve passes on is one `pagewire serve` accepts, with its value."""
    from pagewire.bench.server import serve_argv
    from pagewire.cli import build_parser
    from pagewire_common.settings import Settings

    parser = build_parser()
    args = parser.parse_args(["bench", "--serve", "--prefill-pacing-steps", "40", "--admission-turns", "3",
                              "--stream-interval", "2", "--max-num-batched-tokens", "48", "--no-overlap",
                              "--api-servers", "3"])
    argv = serve_argv(args, "127.0.0.1:1")
    served = parser.parse_args(argv[argv.index("--log-level"):])
    options = Settings.from_args(served)
    assert options.api_servers == 3
    assert (options.prefill_pacing_steps, options.admission_turns, options.stream_interval) == (40, 3, 2)
    assert options.max_num_batched_tokens == 48 and options.overlap is False
    # and nothing is passed when the flags are left out: the server keeps its defaults
    plain = serve_argv(parser.parse_args(["bench", "--serve"]), "127.0.0.1:1")
    assert "--prefill-pacing-steps" not in plain and "--admission-turns" not in plain
