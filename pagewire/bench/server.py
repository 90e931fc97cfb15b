"""Starting and stopping the server that ``pagewire bench --serve`` measures.

``ServedServer`` runs ``pagewire serve`` as a child process with the engine options the bench was
given, waits for "pagewire ready", and stops it (and its worker) at the end.
"""

from __future__ import annotations

import dataclasses
import collections
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time

from pagewire_common import envs
from pagewire_common.settings import API, CORE, PROCESS, WORKER, Settings, flag_of
from pagewire_common.supervisor import cli_argv

class BenchError(Exception):
    """A problem the user can fix (bad flags, no server, server failed to start)."""


# the settings the bench passes on to `pagewire serve` with --serve (the flags it adds for them)
_BENCH_SCOPES = (WORKER, CORE, API, PROCESS)
_NOT_PASSED = ("served_model_name", "shutdown_timeout")


def passthrough_flags() -> list[tuple[str, str]]:
    """(flag, setting name) of every engine setting the bench passes through to `pagewire serve`."""
    return [(flag_of(f), f.name) for f in dataclasses.fields(Settings)
            if set(f.metadata["scope"]) & set(_BENCH_SCOPES) and f.name not in _NOT_PASSED]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_can_listen(addr: str) -> None:
    """Fail early, and clearly, when --serve cannot listen on ``addr`` (HOST:PORT)."""
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit():
        raise BenchError(f"--addr {addr!r} is not HOST:PORT")
    host = host.strip("[]") or "0.0.0.0"
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except OSError as e:
        raise BenchError(f"--addr {addr!r}: {e}") from None
    family, _type, _proto, _name, sockaddr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        # as the server binds: connections in TIME_WAIT, left by a server that stopped with clients
        # connected, do not hold the port (pagewire_common.addresses.check_address_free)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(sockaddr)
        except OSError as e:
            raise BenchError(
                f"--serve cannot listen on {addr} ({e.strerror}); if a pagewire server already runs there, "
                f"drop --serve to measure it"
            ) from None


def serve_argv(args, listen: str) -> list[str]:
    """The `pagewire serve` command line for --serve, with the engine settings that were given."""
    given = {name: getattr(args, name) for _flag, name in passthrough_flags() if getattr(args, name) is not None}
    # the server logs at info at least: its readiness line is an info record, and its log is kept
    # aside (--server-log, or shown only when it fails) whatever the bench's own --log-level
    log_level = "debug" if args.log_level == "debug" else "info"
    return cli_argv(log_level, "serve", "--listen", listen, *Settings(**given).to_argv(_BENCH_SCOPES))


class ServedServer:
    """`pagewire serve` as a child process in its own session: started, awaited until it prints
    "pagewire ready", and stopped with SIGTERM (SIGKILL for it and its worker if that fails)."""

    READY = "pagewire ready"

    def __init__(self, argv: list[str], addr: str, log_path: str | None = None):
        self.argv = argv
        self.addr = addr
        self.log_path = log_path
        self.tail: collections.deque[str] = collections.deque(maxlen=60)
        self.ready = threading.Event()
        self.proc: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None

    def start(self, timeout: float) -> None:
        # the server dies with the bench, even a bench that is killed hard (die_with_parent)
        env = dict(os.environ, PYTHONUNBUFFERED="1", **{envs.PARENT_PID_ENV: str(os.getpid())})
        self.proc = subprocess.Popen(
            self.argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            env=env, start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read_output, name="pagewire-bench-server-log", daemon=True)
        self._reader.start()
        deadline = time.monotonic() + timeout
        while not self.ready.wait(0.1):
            if self.proc.poll() is not None:
                self._reader.join(2)
                raise BenchError(
                    f"the server (`{shlex.join(self.argv[3:])}`) exited with code {self.proc.returncode} before it "
                    f"was ready; its last output:\n{self.output_tail()}"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise BenchError(f"the server was not ready within {timeout:g}s; its last output:\n{self.output_tail()}")

    def _read_output(self) -> None:
        log = open(self.log_path, "w") if self.log_path else None
        try:
            for raw in self.proc.stdout:
                line = raw.decode(errors="replace")
                self.tail.append(line)
                if log is not None:
                    log.write(line)
                    log.flush()
                if self.READY in line:
                    self.ready.set()
        finally:
            if log is not None:
                log.close()

    def output_tail(self) -> str:
        return "".join(self.tail).rstrip() or "(no output)"

    def stop(self, timeout: float = 60.0) -> int | None:
        proc = self.proc
        if proc is None:
            return None
        if proc.poll() is None:
            children = descendant_pids(proc.pid)
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                print(f"pagewire bench: the server did not stop within {timeout:g}s; killing it", file=sys.stderr)
                children = children or descendant_pids(proc.pid)
                proc.kill()
                proc.wait()
                for pid in children:  # worker, scheduler and API servers run in sessions of their own
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        if self._reader is not None:
            self._reader.join(5)
        if proc.stdout is not None:
            proc.stdout.close()
        return proc.returncode


def descendant_pids(pid: int) -> list[int]:
    """Every process below ``pid`` (children first), from /proc (Linux; empty elsewhere)."""
    found: list[int] = []
    stack = child_pids(pid)
    while stack:
        child = stack.pop(0)
        found.append(child)
        stack += child_pids(child)
    return found


def child_pids(pid: int) -> list[int]:
    """The direct children of ``pid``, from /proc (Linux; empty elsewhere)."""
    pids: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                pids += [int(x) for x in f.read().split()]
    except OSError:
        pass
    return pids


# ---- the bench -----------------------------------------------------------------------------


def _serve_defaults() -> dict:
    """The defaults of `pagewire serve`'s engine settings (for the baselines and the report when a
    flag is not given): the declared ones."""
    return {f.name: f.default for f in dataclasses.fields(Settings)}
