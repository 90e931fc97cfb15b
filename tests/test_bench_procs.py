"""Per-process CPU accounting of the benchmarks (pagewire/bench/procs.py), on real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from pagewire.bench.procs import RoleCpu, RunCpu, cmdline, cpu_by_role, cpu_seconds, serve_roles
from pagewire.bench.report import server_cpu_lines
from pagewire.bench.server import child_pids

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


# `pagewire serve`'s tree as /proc shows it: serve -> worker (-> rank 1), serve -> scheduler (the core)
# -> two API servers, the first with a helper; and a stray child of serve. Each process is a
# `python -c` whose argv names its part.
SERVE_TREE = """
import subprocess, sys, time
def spawn(code, *argv):
    return subprocess.Popen([sys.executable, "-c", code, *argv])
SLEEP = "import time; time.sleep(60)"
WITH_CHILD = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', sys.argv[1], *sys.argv[2:]]); time.sleep(60)"
worker = spawn(WITH_CHILD, SLEEP, "worker", "--rank", "1", "x", "worker", "y")
core = spawn('''
import subprocess, sys, time
SLEEP = "import time; time.sleep(60)"
WITH_CHILD = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', sys.argv[1], *sys.argv[2:]]); time.sleep(60)"
first = subprocess.Popen([sys.executable, "-c", WITH_CHILD, SLEEP, "tokenizer helper", "x", "api-server", "y"])
time.sleep(0.3)  # the API servers are numbered by pid
second = subprocess.Popen([sys.executable, "-c", SLEEP, "x", "api-server", "y"])
time.sleep(60)
''', "x", "scheduler", "y")
stray = spawn(SLEEP, "resource tracker")
time.sleep(60)
"""


def test_serve_roles_finds_each_worker_rank_the_core_and_each_api_server_with_its_helpers():
    serve = subprocess.Popen([sys.executable, "-c", SERVE_TREE, "serve"], start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            roles = serve_roles(serve.pid)
            if sum(map(len, roles.values())) == 8:
                break
            time.sleep(0.1)
        assert sorted(roles) == ["api-server 1", "api-server 1 helpers", "api-server 2", "core", "serve", "worker",
                                 "worker rank 1"]
        assert [len(roles[r]) for r in sorted(roles)] == [1, 1, 1, 1, 2, 1, 1]  # serve and its stray child
        assert roles["serve"][0] == serve.pid and "resource tracker" in cmdline(roles["serve"][1])
        assert " worker " in cmdline(roles["worker"][0]) and " scheduler " in cmdline(roles["core"][0])
        assert " --rank 1 " in cmdline(roles["worker rank 1"][0])
        assert child_pids(roles["worker"][0]) == roles["worker rank 1"]
        assert " api-server " in cmdline(roles["api-server 1"][0]) and " api-server " in cmdline(roles["api-server 2"][0])
        assert roles["api-server 1"][0] < roles["api-server 2"][0]
        # the first API server's child, whatever its command line says (here it repeats its parent's)
        assert child_pids(roles["api-server 1"][0]) == roles["api-server 1 helpers"]
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


def test_role_cpu_per_token_and_share_of_a_core():
    assert RoleCpu.of(0.5, 1000, 2.0) == RoleCpu(cpu_s=0.5, us_per_token=500.0, busy_fraction=0.25)
    assert RoleCpu.of(0.5, 0, 2.0).us_per_token is None  # no token: no figure, not a division by zero
    assert RoleCpu.of(0.0, 10, 0.0).busy_fraction == 0.0
    assert RoleCpu.of(0.5, 1000, 2.0).to_dict() == {"cpu_s": 0.5, "us_per_token": 500.0, "busy_fraction": 0.25}


def test_server_cpu_lines_name_each_role_or_say_it_is_not_known():
    cpu = {"core": RoleCpu.of(0.9, 1000, 1.0).to_dict(), "api-server 1": RoleCpu.of(0.3, 1000, 1.0).to_dict()}
    known = {"known": True, "pids": {"core": [2], "api-server 1": [3]},
             "engines": {"pagewire": {"runs": [cpu], "aggregate": cpu}}}
    assert server_cpu_lines(known) == [
        "server CPU us per output token (share of a core), pagewire: core 900.0 (90%), api-server 1 300.0 (30%)"]
    unknown = {"known": False, "reason": "no --serve"}
    assert server_cpu_lines(unknown) == ["server CPU: not known (no --serve)"]
