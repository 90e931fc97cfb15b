"""docker-compose.yml stays valid and its commands run as plain processes (no Docker engine
here), so the file cannot drift from the code."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import yaml

from pagewire.v1 import generation_pb2 as pb
from tests.service_utils import REPO, Proc, free_port, sampling, stub

COMPOSE = REPO / "docker-compose.yml"


def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def test_compose_structure():
    doc = compose()
    worker, scheduler = doc["services"]["worker"], doc["services"]["scheduler"]
    assert worker["command"][0] == "worker" and scheduler["command"][0] == "scheduler"
    assert scheduler["depends_on"]["worker"]["condition"] == "service_healthy"
    assert "50051:50051" in scheduler["ports"]
    gpu = worker["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["capabilities"] == ["gpu"]
    # the scheduler reaches the worker at the address the worker listens on
    worker_port = worker["command"][worker["command"].index("--listen") + 1].rsplit(":", 1)[1]
    assert scheduler["command"][scheduler["command"].index("--worker") + 1] == f"worker:{worker_port}"
    assert (REPO / "Dockerfile").is_file()


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose (Debian package) not installed")
def test_docker_compose_config_validates():
    out = subprocess.run(["docker-compose", "-f", str(COMPOSE), "config", "-q"], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr


def _localize(command: list[str], ports: dict[str, int]) -> list[str]:
    """Rewrite the compose network's addresses to loopback ports."""
    out = []
    for arg in command:
        if arg.startswith("0.0.0.0:"):
            arg = f"127.0.0.1:{ports[arg.rsplit(':', 1)[1]]}"
        elif arg.startswith("worker:"):
            arg = f"127.0.0.1:{ports[arg.rsplit(':', 1)[1]]}"
        out.append(arg)
    return out


@pytest.mark.slow
def test_compose_commands_run_as_processes(tmp_path, smollm2_dir):
    doc = compose()
    worker_cmd, sched_cmd = doc["services"]["worker"]["command"], doc["services"]["scheduler"]["command"]
    ports = {"50052": free_port(), "50051": free_port()}
    worker = Proc(_localize(worker_cmd, ports), tmp_path / "worker.log")
    scheduler = None
    try:
        health = _localize(doc["services"]["worker"]["healthcheck"]["test"][1:], {"50052": ports["50052"]} | {})
        health = [a.replace("127.0.0.1:50052", f"127.0.0.1:{ports['50052']}") for a in health]
        worker.wait_for_output("worker ready", timeout=180)
        assert subprocess.run([sys.executable if h == "python" else h for h in health], cwd=REPO).returncode == 0
        scheduler = Proc(_localize(sched_cmd, ports), tmp_path / "scheduler.log")
        scheduler.wait_for_output("scheduler ready", timeout=60)
        s_health = [a.replace("127.0.0.1:50051", f"127.0.0.1:{ports['50051']}") for a in doc["services"]["scheduler"]["healthcheck"]["test"][1:]]
        assert subprocess.run([sys.executable if h == "python" else h for h in s_health], cwd=REPO).returncode == 0
        responses = list(
            stub(f"127.0.0.1:{ports['50051']}").Generate(
                pb.GenerateRequest(prompt="The capital of France is", sampling=sampling(max_tokens=8)), timeout=60
            )
        )
        assert "".join(r.text for r in responses).strip()
    finally:
        if scheduler:
            scheduler.stop()
        worker.stop()
