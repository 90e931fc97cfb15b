"""``benchmarks/core_cpu.py`` runs the real core against its in-process worker and API server: a
short run finishes every request, prints one figure per ``--worker-step-ms`` value in turn, and
refuses a bad value."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "core_cpu.py"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], check=False, capture_output=True, text=True, timeout=120)


def test_each_worker_step_value_gets_a_figure_in_turn():
    out = run("--streams", "4", "--max-new-tokens", "3", "--num-requests", "8", "--prompt-len", "20",
              "--repeat", "2", "--worker-step-ms", "0,2")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert [re.match(r"worker step (\S+) ms: core CPU [\d.]+ us/token \((\d+) tokens/step\)", line).group(1)
            for line in lines] == ["0", "2", "0", "2"]


def test_one_value_of_zero_prints_the_plain_figure():
    out = run("--streams", "2", "--max-new-tokens", "2", "--num-requests", "4", "--repeat", "1")
    assert out.returncode == 0, out.stderr
    assert re.fullmatch(r"core CPU [\d.]+ us/token \(\d+ tokens/step\); .*\n", out.stdout)


def test_a_bad_worker_step_is_refused():
    for value in ("x", "-1", "0,", "1000"):
        out = run("--worker-step-ms", value)
        assert out.returncode == 2
        assert "--worker-step-ms" in out.stderr
