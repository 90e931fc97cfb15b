"""Start pagewire services as real processes on loopback for integration tests."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagewire_common.v1 import generation_pb2 as pb
from pagewire_common.v1 import generation_pb2_grpc

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A pagewire subcommand running in its own process group, with its output in a log file."""

    def __init__(self, argv: list[str], log_path: Path, env: dict[str, str] | None = None):
        if argv[0] in ("serve", "scheduler", "api-server") and "--http-listen" not in argv:
            argv = [*argv, "--http-listen", "127.0.0.1:0"]  # a free port, never the shared default
        self.argv = argv
        self.log_path = log_path
        self._log = open(log_path, "wb")
        env = dict(os.environ if env is None else env, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pagewire.cli", *argv],
            cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def http_url(self) -> str:
        """The OpenAI door's base URL, as the ready line reports it."""
        match = re.search(r"OpenAI HTTP on (https?://[\w.\-\[\]:]+)", self.output())
        assert match, f"no HTTP address in the output of {self.argv[0]}:\n{self.output()}"
        return match.group(1)

    def wait_for_output(self, text: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if text in self.output():
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.argv[0]} exited with {self.proc.returncode}:\n{self.output()}")
            time.sleep(0.05)
        raise TimeoutError(f"no {text!r} from {self.argv[0]} within {timeout}s:\n{self.output()}")

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self, timeout: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()
        return self.proc.returncode


def start_worker(model_dir, tmp_path: Path, port: int | None = None, extra=()) -> tuple[Proc, str]:
    port = port or free_port()
    addr = f"127.0.0.1:{port}"
    proc = Proc(["worker", "--model", str(model_dir), "--listen", addr, *extra], tmp_path / f"worker-{port}.log")
    proc.wait_for_output("worker ready")
    return proc, addr


def start_scheduler(worker_addr: str, tmp_path: Path, extra=()) -> tuple[Proc, str]:
    port = free_port()
    addr = f"127.0.0.1:{port}"
    proc = Proc(["scheduler", "--worker", worker_addr, "--listen", addr, *extra], tmp_path / f"scheduler-{port}.log")
    proc.wait_for_output("scheduler ready")
    return proc, addr


def stub(addr: str) -> generation_pb2_grpc.GenerationStub:
    return generation_pb2_grpc.GenerationStub(grpc.insecure_channel(addr))


def own_channel(addr: str) -> grpc.Channel:
    """A channel on a TCP connection of its own (grpc shares one connection per target by
    default), so the kernel can hand it to any of the API servers sharing the port."""
    return grpc.insecure_channel(addr, options=[("grpc.use_local_subchannel_pool", 1)])


def ready_channel(addr: str, timeout: float) -> grpc.Channel | None:
    """``own_channel(addr)`` once its connection is ready, or None (closed) after ``timeout``."""
    channel = own_channel(addr)
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout)
    except grpc.FutureTimeoutError:
        channel.close()
        return None
    return channel


def generate_on_new_connection(addr: str, request: pb.GenerateRequest, timeout: float = 10.0) -> list[int] | None:
    """The token ids of one Generate on a TCP connection of its own (so the kernel may hand it to
    any API server), or None when no connection is ready within ``timeout`` or the call outlives
    its deadline; an error status raises ``grpc.RpcError``. For polling a server that restarts:
    a call made on a channel whose connection came up while the API servers' listeners were
    being replaced was seen to hang past its 10 s deadline for minutes, its request never sent
    and neither side acting (grpcio 1.85), so the call waits for a ready connection and is
    bounded from this side too."""
    channel = ready_channel(addr, timeout)
    if channel is None:
        return None
    call = generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=timeout)
    outcome: dict = {}

    def read() -> None:
        try:
            outcome["tokens"] = [t for r in call for t in r.token_ids]
        except grpc.RpcError as e:
            outcome["error"] = e

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout + 5)
    if reader.is_alive():  # past its deadline: given up (the thread is left to grpc)
        call.cancel()
        return None
    channel.close()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["tokens"]


def health_status(addr: str, service: str = "") -> int:
    with grpc.insecure_channel(addr) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def sampling(**kw) -> pb.SamplingParams:
    from pagewire.client import make_sampling

    return make_sampling(**kw)


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError("condition not met in time")


def descendants(pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of every live descendant of ``pid`` (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(entry))
    found: list[tuple[int, str]] = []
    stack = list(children.get(pid, []))
    while stack:
        child = stack.pop()
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                argv = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        found.append((child, argv))
        stack += children.get(child, [])
    return found


def is_gone(pid: int) -> bool:
    """The process has exited (a zombie waiting for its parent counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def listening_sockets(port: int) -> int:
    """TCP sockets listening on ``port`` (IPv4 and IPv6), from /proc/net."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            if state == "0A" and int(local.rpartition(":")[2], 16) == port:  # 0A: LISTEN
                count += 1
    return count
