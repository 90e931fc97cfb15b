"""What a new user meets first: `pagewire --version` and help, a taken address as one clear line
for every command, one log format, and a CPU worker that never loads Triton."""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import os
import re
import signal
import socket
import subprocess
import sys

import pytest

from pagewire.cli import build_parser
from pagewire_common.logs import FORMAT
from pagewire_common.plan import NewSequence, StepPlan
from pagewire_common.sampling import SamplingParams
from scheduler_svc.core.worker_client import WorkerLink
from tests.service_utils import REPO, Proc, free_port

# a log line as pagewire_common.logs.FORMAT writes it
LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) [\w.]+: ")


def run_cli(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagewire.cli", *argv], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def test_version_is_the_installed_package_version():
    out = run_cli("--version")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"pagewire {importlib.metadata.version('pagewire')}"


def _options(parser: argparse.ArgumentParser, path: str):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _options(sub, f"{path} {name}")
        elif not isinstance(action, argparse._HelpAction):
            yield path, action


def test_every_option_of_every_command_has_help():
    options = list(_options(build_parser(), "pagewire"))
    commands = {path for path, _ in options}
    assert {"pagewire serve", "pagewire generate", "pagewire worker", "pagewire bench"} <= commands
    missing = [(path, action.option_strings or action.dest) for path, action in options
               if not (action.help and action.help.strip())]
    assert missing == []
    generate = {a.dest for path, a in options if path == "pagewire generate"}
    assert {"temperature", "top_p", "top_k", "seed", "max_tokens", "stop", "api_key", "tls_ca_file"} <= generate


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama-gqa")


COMMANDS = {
    "serve": lambda model, addr: ["serve", "--model", str(model), "--listen", addr],
    "worker": lambda model, addr: ["worker", "--model", str(model), "--listen", addr],
    "scheduler": lambda model, addr: ["scheduler", "--worker", "127.0.0.1:1", "--listen", addr],
    "api-server": lambda model, addr: ["api-server", "--scheduler", "127.0.0.1:1", "--listen", addr],
}


@pytest.mark.slow
@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_taken_port_is_one_clear_line_and_a_non_zero_exit(command, model_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        addr = f"127.0.0.1:{taken.getsockname()[1]}"
        out = run_cli(*COMMANDS[command](model_dir, addr))
    assert out.returncode == 2
    lines = [line for line in (out.stdout + out.stderr).splitlines() if line.strip()]
    assert lines == [f"pagewire: error: cannot listen on {addr}: Address already in use "
                     "(is another server running there?)"]


def _port_left_in_time_wait() -> str:
    """The address of a port no one listens on, whose server side of a closed connection is
    left in TIME_WAIT (as a server that stopped with clients connected leaves it)."""
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        addr = f"127.0.0.1:{listener.getsockname()[1]}"
        client = socket.create_connection(listener.getsockname())
        accepted, _ = listener.accept()
        accepted.close()  # the server side closes first: its end goes to TIME_WAIT
        client.close()
    return addr


def test_a_port_left_in_time_wait_is_free_but_one_listening_with_reuseport_is_not():
    """A server that stopped with clients connected leaves its side of each connection in
    TIME_WAIT for up to a minute; gRPC binds the port regardless, so the check must too (a
    scheduler restarted after a crash gave up on "Address already in use"). A listener sharing
    the port the way API servers do still counts as taken."""
    from pagewire_common.addresses import check_address_free

    addr = _port_left_in_time_wait()
    assert check_address_free(addr) == addr
    with socket.socket() as sharing:
        sharing.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC's listeners do
        sharing.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sharing.bind(("127.0.0.1", int(addr.rpartition(":")[2])))
        sharing.listen()
        with pytest.raises(OSError, match="Address already in use"):
            check_address_free(addr)


@pytest.mark.parametrize("argv, message", [
    # the two doors on one port: each would get the other's clients
    (["serve", "--listen", "127.0.0.1:{port}", "--http-listen", "127.0.0.1:{port}"],
     "--listen 127.0.0.1:{port} and --http-listen 127.0.0.1:{port} are the same port"),
    (["serve", "--listen", "0.0.0.0:{port}", "--http-listen", "127.0.0.1:{port}"], "are the same port"),
    (["worker", "--listen", "127.0.0.1:70000"], "not an address: '127.0.0.1:70000' (a port is 0 to 65535)"),
    (["worker", "--listen", "unix:/no/such/folder/w.sock"],
     "cannot listen on unix:/no/such/folder/w.sock: the folder /no/such/folder does not exist"),
    (["serve", "--rank", "1", "--world-size", "2", "--distributed-init", "127.0.0.1:1"],
     "--rank 1: serve and core run rank 0"),
    (["worker", "--listen", "127.0.0.1:0", "--device", "cuda"], "--device cuda: this machine has no CUDA device"),
    # SO_REUSEPORT spreads clients over API servers on a port; on a socket path one would take all
    (["serve", "--listen", "unix:/tmp/pagewire-test-{port}.sock", "--api-servers", "2"],
     "several API servers (--api-servers 2) share a host:port, not a unix socket"),
    # a core named twice, or this server's own address as another core's, would count twice
    (["serve", "--listen", "127.0.0.1:{port}", "--data-parallel-cores", "127.0.0.1:1,127.0.0.1:1"],
     "engine core address '127.0.0.1:1' is given twice"),
    (["serve", "--listen", "127.0.0.1:{port}", "--data-parallel-cores", "127.0.0.1:{port}"],
     "--data-parallel-cores names 127.0.0.1:{port}, this server's own --listen"),
])
def test_bad_addresses_and_layouts_fail_at_once_in_one_line(argv, message, model_dir):
    """Before any model loads or any child starts: one line, exit 2."""
    import torch

    if "cuda" in argv and torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    port = str(free_port())
    argv = [a.replace("{port}", port) for a in argv]
    out = run_cli(*argv[:1], "--model", str(model_dir), *argv[1:])
    assert out.returncode == 2, out.stdout + out.stderr
    lines = [line for line in (out.stdout + out.stderr).splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("pagewire: error: "), lines
    assert message.replace("{port}", port) in lines[0], lines


def test_generate_checks_its_sampling_flags_before_it_connects(capsys):
    """As the server would refuse them, named, with no server needed; -1 is vLLM's top-k off."""
    from pagewire.cli import main

    for argv, message in ((["--seed", "-1"], "seed must be an integer in [0, 2**64) or None, got -1"),
                          (["--top-p", "0"], "top_p must be in (0, 1]"),
                          (["--temperature", "-1"], "temperature must be >= 0"),
                          (["--system", "be brief"], "--system goes with --chat")):
        assert main(["generate", "x", "--addr", "127.0.0.1:1", *argv]) == 2
        assert f"pagewire: error: {message}" in capsys.readouterr().err
    assert main(["generate", "x", "--addr", "127.0.0.1:1", "--top-k", "-1", "--timeout", "5"]) == 1  # no server
    assert "UNAVAILABLE" in capsys.readouterr().err


def test_serve_takes_the_model_as_vllm_serve_does(capsys):
    from pagewire.cli import build_parser, main

    assert build_parser().parse_args(["serve", "org/name"]).model_positional == "org/name"
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "org/name", "--model", "other/name"])
    assert exit_.value.code == 2 and "the model is given twice" in capsys.readouterr().err


def test_log_level_goes_before_or_after_the_command():
    from pagewire.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["serve", "--log-level", "debug"]).log_level == "debug"
    assert parser.parse_args(["--log-level", "error", "generate", "x"]).log_level == "error"
    assert parser.parse_args(["--log-level", "error", "bench", "--log-level", "warn"]).log_level == "warning"


def test_a_bad_log_level_in_the_environment_is_a_usage_error():
    out = subprocess.run([sys.executable, "-m", "pagewire.cli", "generate", "x"], capture_output=True, text=True,
                         env=dict(os.environ, PAGEWIRE_LOG_LEVEL="verbose"), timeout=60)
    assert out.returncode == 2
    assert "PAGEWIRE_LOG_LEVEL must be one of debug, info, warning, error, got 'verbose'" in out.stderr
    from pagewire.cli import build_parser

    os.environ["PAGEWIRE_LOG_LEVEL"], before = "WARN", os.environ.get("PAGEWIRE_LOG_LEVEL")
    try:
        assert build_parser().parse_args(["generate", "x"]).log_level == "warning"  # logging's alias
    finally:
        if before is None:
            del os.environ["PAGEWIRE_LOG_LEVEL"]
        else:
            os.environ["PAGEWIRE_LOG_LEVEL"] = before


@pytest.mark.slow
def test_a_unix_socket_in_use_is_not_taken_over(model_dir, tmp_path):
    """gRPC would remove the socket file of a server listening there and bind anew."""
    path = tmp_path / "in-use.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as taken:
        taken.bind(str(path))
        taken.listen()
        out = run_cli("worker", "--model", str(model_dir), "--listen", f"unix:{path}")
    assert out.returncode == 2
    assert out.stderr.strip() == f"pagewire: error: cannot listen on unix:{path}: another server is listening there"


@pytest.mark.slow
def test_a_cpu_worker_never_loads_triton_and_stops_in_a_few_lines(model_dir, tmp_path):
    """torch imports Triton whenever it is installed (through torch._dynamo); Triton's extension
    then prints dozens of 'nanobind: leaked' lines at exit. A CPU worker keeps it out."""
    addr = f"127.0.0.1:{free_port()}"
    worker = Proc(["worker", "--model", str(model_dir), "--listen", addr, "--device", "cpu", "--num-kv-blocks", "64"],
                  tmp_path / "worker.log")
    try:
        worker.wait_for_output("worker ready", timeout=120)
        async def one_step():  # attention and sampling run too
            link = WorkerLink(addr)
            await link.open()
            await link.send(StepPlan(0, new_seqs=[NewSequence(1, [5, 6, 7], [0], 0, 3, SamplingParams(temperature=0.7,
                                                                                                      seed=1))]))
            result = await link.receive()
            await link.close()
            return result

        assert len(asyncio.run(one_step()).token_ids) == 1
        with open(f"/proc/{worker.proc.pid}/maps") as f:  # the shared objects the worker loaded
            maps = f.read()
        assert "libtriton" not in maps and "/triton/" not in maps
        worker.signal(signal.SIGINT)
        assert worker.proc.wait(30) == 0
    finally:
        worker.stop()
    output = worker.output()
    assert "nanobind" not in output and "leaked" not in output
    lines = output.splitlines()
    assert all(LOG_LINE.match(line) for line in lines), output
    assert lines[-1].endswith("pagewire.worker: worker stopped") and len(lines) <= 6, output


# gRPC's C core logs a line of its own format when a peer closes a connection ("Got goaway")
# and when a process forks while gRPC threads run
GRPC_CORE_CHATTER = """
import os, grpc
from concurrent import futures
server = grpc.server(futures.ThreadPoolExecutor(2))
port = server.add_insecure_port("127.0.0.1:0")
server.start()
channel = grpc.insecure_channel(f"127.0.0.1:{port}")
grpc.channel_ready_future(channel).result(timeout=10)
pid = os.fork()
if pid == 0:
    os._exit(0)
os.waitpid(pid, 0)
server.stop(None)
"""


@pytest.mark.parametrize("level", ["info", "debug"])
def test_grpc_core_lines_are_kept_out_of_the_log_unless_debugging(level):
    code = f"from pagewire_common.logs import setup_logging\nsetup_logging({level!r})\n{GRPC_CORE_CHATTER}"
    env = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    core_lines = [line for line in out.stderr.splitlines() if re.match(r"^[IWE]\d{4} ", line)]
    assert bool(core_lines) == (level == "debug"), out.stderr


@pytest.mark.slow
def test_serve_logs_one_format_and_one_model_name(model_dir, tmp_path):
    port = free_port()
    serve = Proc(["serve", "--model", str(model_dir), "--listen", f"127.0.0.1:{port}", "--num-kv-blocks", "64"],
                 tmp_path / "serve.log")
    try:
        serve.wait_for_output("pagewire ready", timeout=120)
        serve.signal(signal.SIGTERM)
        assert serve.proc.wait(30) == 0
    finally:
        serve.stop()
    lines = serve.output().splitlines()
    assert lines and all(LOG_LINE.match(line) for line in lines), serve.output()
    assert FORMAT == "%(asctime)s %(levelname)s %(name)s: %(message)s"
    text = serve.output()
    name = model_dir.name
    assert f"pagewire ready: serving {name} on 127.0.0.1:{port}" in text, text
    # the worker, the core and serve name the model alike; a unix socket is named by its path
    assert "worker ready on unix:" in text and f".sock: {name} (llama, float32 on cpu)" in text, text
    assert re.search(rf"scheduler ready on 127\.0\.0\.1:{port}, OpenAI HTTP on http://127\.0\.0\.1:\d+ "
                     r"with 1 API server\(s\), worker unix:", text), text
    assert "(port 1)" not in text and "~20 s" not in text and "connected (unix:)" not in text, text


def test_a_kv_cache_past_the_machine_and_a_long_max_model_len_are_said_plainly(model_dir, caplog):
    from worker_svc.runner import ModelRunner, RunnerConfig

    with pytest.raises(ValueError, match=r"cannot allocate the KV cache \(\d+ blocks, [\d.]+ GiB\) on cpu: .*give less "
                                         r"--kv-cache-memory or --num-kv-blocks"):
        ModelRunner(model_dir, RunnerConfig(device="cpu", dtype="float32", kv_cache_bytes=1 << 60))
    with caplog.at_level("WARNING", logger="pagewire.worker"):
        runner = ModelRunner(model_dir, RunnerConfig(device="cpu", dtype="float32", num_kv_blocks=8,
                                                     max_model_len=100_000))
    assert runner.max_model_len == runner.model_config.max_model_len < 100_000
    assert f"--max-model-len 100000 is more than the model's {runner.max_model_len} positions" in caplog.text


def test_a_config_json_that_is_not_json_is_named(tmp_path):
    from worker_svc.config import ModelConfig

    (tmp_path / "config.json").write_text("{'model_type': 'llama'}")
    with pytest.raises(ValueError, match=f"{tmp_path / 'config.json'} is not valid JSON: Expecting property name"):
        ModelConfig.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="must hold a JSON object, got list"):
        ModelConfig.from_pretrained(tmp_path)


def test_a_long_wait_for_a_peer_is_said(monkeypatch, caplog):
    """A scheduler whose worker does not answer, or an API server whose core does not, says so
    after a while and then now and again, quiet while a peer is merely starting."""
    import logging

    from pagewire_common import logs

    clock = [100.0]
    monkeypatch.setattr(logs.time, "monotonic", lambda: clock[0])
    note = logs.WaitingNote(logging.getLogger("pagewire.test"), "the worker at 127.0.0.1:1", first_s=10, every_s=60)
    with caplog.at_level("INFO", logger="pagewire.test"):
        for t in (100, 105, 109.9):
            clock[0] = t
            note.note("connection refused")
        assert caplog.messages == []
        for t in (110, 111, 169, 170.5):
            clock[0] = t
            note.note("connection refused")
        assert caplog.messages == ["waiting for the worker at 127.0.0.1:1 (10 s so far): connection refused",
                                   "waiting for the worker at 127.0.0.1:1 (70 s so far): connection refused"]
        note.reset()  # connected: a later wait starts over
        clock[0] = 500
        note.note("")
        clock[0] = 505
        note.note("")
        assert len(caplog.messages) == 2


def test_bench_serve_takes_a_port_left_in_time_wait_and_clients_check_their_addresses(capsys):
    """bench --serve binds its check as the server binds (SO_REUSEADDR); generate and bench
    refuse an address whose port would wrap around, and generate a deadline that is not > 0."""
    from pagewire.bench.server import check_can_listen

    addr = _port_left_in_time_wait()
    check_can_listen(addr)
    parser = build_parser()
    for argv, message in ((["generate", "x", "--addr", "127.0.0.1:70000"], "a port is 1 to 65535"),
                          (["bench", "--addr", "127.0.0.1:70000"], "a port is 1 to 65535"),
                          (["generate", "x", "--timeout", "0"], "--timeout: must be > 0")):
        with pytest.raises(SystemExit):
            parser.parse_args(argv)
        assert message in capsys.readouterr().err
    assert parser.parse_args(["generate", "x", "--addr", "unix:/tmp/s.sock"]).addr == "unix:/tmp/s.sock"
