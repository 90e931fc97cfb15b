"""The processes `pagewire serve` starts: what they import, and the temp folder they share."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import pytest

from pagewire_common.v1 import generation_pb2 as pb
from tests.service_utils import free_port, sampling, stub, wait_until


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama-gqa")


@pytest.mark.slow
def test_serve_started_in_a_folder_with_a_module_named_like_the_standard_library_s(model_dir, tmp_path):
    """`pagewire serve` run where the user keeps a queue.py: its processes import Python's own
    queue, not the user's (the children run without the current folder on their import path)."""
    script = shutil.which("pagewire", path=os.path.dirname(sys.executable))
    if script is None:
        pytest.fail("the pagewire console script is not installed beside this interpreter (pip install -e .)")
    here = tmp_path / "work"
    here.mkdir()
    (here / "queue.py").write_text("raise RuntimeError('the user\\'s queue.py was imported')\n")
    addr = f"127.0.0.1:{free_port()}"
    log = open(tmp_path / "serve.log", "wb")
    proc = subprocess.Popen([script, "serve", "--model", str(model_dir), "--listen", addr, "--http-listen", "off",
                             "--num-kv-blocks", "100"], cwd=here, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        wait_until(lambda: "pagewire ready" in (tmp_path / "serve.log").read_text() or proc.poll() is not None,
                   timeout=90)
        out = (tmp_path / "serve.log").read_text()
        assert "pagewire ready" in out and "queue.py was imported" not in out, out
        responses = list(stub(addr).Generate(pb.GenerateRequest(prompt="The river ", sampling=sampling(max_tokens=4))))
        assert sum(len(r.token_ids) for r in responses) == 4
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def test_a_run_folder_written_into_while_it_is_removed_is_removed_all_the_same(tmp_path, monkeypatch):
    """A child that outlives serve removes serve's temp folder while a sibling, still starting,
    adds a file to it: the removal goes on until the folder is gone."""
    from pagewire_common import supervisor

    run_dir = tmp_path / "pagewire-run"
    (run_dir / "metrics").mkdir(parents=True)
    real_rmtree, calls = shutil.rmtree, []

    def racing_rmtree(path, ignore_errors=False):
        calls.append(path)
        real_rmtree(path, ignore_errors=ignore_errors)
        if len(calls) == 1:  # a sibling writes its first file just behind it
            (run_dir / "metrics").mkdir(parents=True)
            (run_dir / "metrics" / "counter_1234.db").write_bytes(b"x")

    monkeypatch.setattr(supervisor.shutil, "rmtree", racing_rmtree)
    supervisor.remove_run_dir(str(run_dir))
    assert not run_dir.exists() and len(calls) == 2
