"""Per-process CPU accounting of the benchmarks (pagewire/bench/procs.py), on real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from pagewire.bench.procs import RunCpu, cmdline, cpu_by_role, cpu_seconds, serve_roles

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def test_cpu_seconds_counts_work_and_is_zero_for_a_gone_process():
    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass"
    proc = subprocess.Popen([sys.executable, "-c", spin])
    proc.wait(30)
    assert cpu_seconds(proc.pid) == 0.0  # reaped: gone from /proc
    start = cpu_seconds(os.getpid())
    t = time.process_time()
    while time.process_time() - t < 0.2:
        pass
    assert cpu_seconds(os.getpid()) - start >= 0.15


SERVE_TREE = """
import subprocess, sys, time
py = sys.executable
def spawn(*argv):
    return subprocess.Popen([py, "-c", "import time; time.sleep(60)", *argv])
worker = spawn("x", "worker", "y")
core = subprocess.Popen([py, "-c", '''
import subprocess, sys, time
apis = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "api-server"]) for _ in range(2)]
time.sleep(60)
''', "x", "scheduler", "y"])
time.sleep(60)
"""


def test_serve_roles_finds_worker_core_and_each_api_server():
    serve = subprocess.Popen([sys.executable, "-c", SERVE_TREE, "serve"], start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            roles = serve_roles(serve.pid)
            if len(roles) == 5:
                break
            time.sleep(0.1)
        assert sorted(roles) == ["api-server 1", "api-server 2", "core", "serve", "worker"]
        assert roles["serve"] == [serve.pid]
        assert " worker " in cmdline(roles["worker"][0]) and " scheduler " in cmdline(roles["core"][0])
        assert all("api-server" in cmdline(roles[f"api-server {i}"][0]) for i in (1, 2))
        assert set(cpu_by_role(roles)) == set(roles)
    finally:
        os.killpg(serve.pid, signal.SIGKILL)  # the whole tree
        serve.wait(10)


def test_run_cpu_splits_a_run_by_role_and_counts_others_apart():
    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.4: pass\ntime.sleep(30)"
    server = subprocess.Popen([sys.executable, "-c", spin])
    bystander = subprocess.Popen([sys.executable, "-c", spin])  # not the server's: "others"
    try:
        cpu = RunCpu(server.pid, {"server": [server.pid]})
        cpu.start()
        time.sleep(1.0)
        others, by_role = cpu.stop()
        assert set(by_role) == {"server", "client"}
        assert 0.2 <= by_role["server"] <= 0.6
        assert others >= 0.2  # the bystander's spin
    finally:
        for proc in (server, bystander):
            proc.kill()
            proc.wait(10)
