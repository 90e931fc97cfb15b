"""The step-phase profile (``--profile-steps N``, pagewire_common.step_profile): phases add up, one
line is logged every N steps with the documented figures, and off it costs one shared no-op."""

from __future__ import annotations

import contextlib
import logging

import pytest

from pagewire_common import step_profile

KEYS = {"role", "pid", "steps", "tokens", "wall_us", "cpu_us", "phases"}
PHASE_KEYS = {"total_us", "us_per_step", "us_per_token"}


@pytest.fixture(autouse=True)
def profile_off_after():
    yield
    step_profile.configure("test", 0)


@pytest.fixture
def clock(monkeypatch):
    """A fake perf_counter_ns: each call returns the next value of ``clock.ticks`` (ns)."""

    class Clock:
        def __init__(self):
            self.ticks: list[int] = []

        def __call__(self) -> int:
            return self.ticks.pop(0)

    fake = Clock()
    monkeypatch.setattr(step_profile, "_clock", fake)
    monkeypatch.setattr(step_profile, "_cpu_clock", lambda: 7_000)  # no CPU time passes
    return fake


def profile_lines(caplog) -> list[dict]:
    return [step_profile.parse_line(r.getMessage()) for r in caplog.records
            if r.name == "pagewire.profile" and step_profile.parse_line(r.getMessage())]


def test_phases_accumulate_and_a_line_is_logged_every_n_steps(clock, caplog):
    caplog.set_level(logging.INFO, logger="pagewire.profile")
    clock.ticks = [0]  # the window starts
    step_profile.configure("worker", 2)
    clock.ticks = [1_000, 4_000, 5_000, 5_500]  # step 1: forward 3 µs, sample 0.5 µs
    with step_profile.phase("forward"):
        pass
    with step_profile.phase("sample"):
        pass
    step_profile.end_step(4)
    assert profile_lines(caplog) == []  # not yet: every 2 steps
    clock.ticks = [10_000, 11_000, 20_000]  # step 2: forward 1 µs; the window ends at 20 µs
    with step_profile.phase("forward"):
        pass
    step_profile.active().add("handlers", 2_000)
    step_profile.end_step(4)
    [line] = profile_lines(caplog)
    assert set(line) == KEYS
    assert (line["role"], line["steps"], line["tokens"], line["wall_us"], line["cpu_us"]) == ("worker", 2, 8, 20.0, 0.0)
    assert line["phases"] == {
        "forward": {"total_us": 4.0, "us_per_step": 2.0, "us_per_token": 0.5},
        "sample": {"total_us": 0.5, "us_per_step": 0.25, "us_per_token": 0.062},
        "handlers": {"total_us": 2.0, "us_per_step": 1.0, "us_per_token": 0.25},
    }
    # the next window starts empty; the summary holds every step since the start
    clock.ticks = [30_000, 36_000, 40_000]
    with step_profile.phase("forward"):
        pass
    step_profile.end_step(0)
    summary = step_profile.active().summary()
    assert (summary["steps"], summary["tokens"], summary["wall_us"]) == (3, 8, 40.0)
    assert summary["phases"]["forward"] == {"total_us": 10.0, "us_per_step": 3.33, "us_per_token": 1.25}
    assert len(profile_lines(caplog)) == 1
    clock.ticks = [50_000, 50_000]
    step_profile.active().reset()
    assert step_profile.active().summary()["phases"] == {}


def test_a_logged_line_reads_back_from_a_log_record_line():
    line = '2025-01-01 00:00:00,000 INFO pagewire.profile: step profile {"role": "core", "phases": {}}'
    assert step_profile.parse_line(line) == {"role": "core", "phases": {}}
    assert step_profile.parse_line("2025-01-01 INFO pagewire.worker: worker ready") is None


def test_off_it_logs_nothing_and_every_phase_is_one_shared_no_op(caplog):
    caplog.set_level(logging.DEBUG)
    assert step_profile.configure("worker", 0) is None and step_profile.active() is None
    first = step_profile.phase("forward")
    assert isinstance(first, contextlib.nullcontext) and step_profile.phase("sample") is first
    for _ in range(100):
        with step_profile.phase("forward"):
            pass
        step_profile.end_step(64)
    assert not caplog.records


def test_the_worker_phases_mark_nvtx_and_the_profile_with_one_call():
    from worker_svc.nvtx import nvtx_range

    step_profile.configure("worker", 0)
    assert isinstance(nvtx_range("forward"), contextlib.nullcontext)
    step_profile.configure("worker", 1000)
    with nvtx_range("forward"):
        pass
    assert "forward" in step_profile.active().summary()["phases"]


def test_every_step_setting_is_checked():
    from pagewire_common.settings import Settings

    assert Settings().profile_steps == 0
    with pytest.raises(ValueError, match="--profile-steps"):
        Settings(profile_steps=-1)
    with pytest.raises(ValueError, match="every_steps"):
        step_profile.StepProfile("worker", 0)


def test_the_offline_llm_profiles_its_steps_and_reports_them(tiny_model_dir, caplog):
    from pagewire import LLM, SamplingParams

    caplog.set_level(logging.INFO, logger="pagewire.profile")
    llm = LLM(tiny_model_dir("llama-gqa"), profile_steps=4, block_size=4, num_kv_blocks=200)
    outs = llm.generate([[5, 6, 7]] * 3, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [8, 8, 8]
    figures = llm.profile(reset=True)
    assert set(figures) == KEYS and figures["role"] == "offline" and figures["tokens"] == 24
    # the worker's phases and the core's and the API server's that run in this process
    assert {"apply plan", "prepare inputs", "forward", "sample", "schedule", "apply result", "deliver",
            "dispatch"} <= set(figures["phases"])
    assert all(set(p) == PHASE_KEYS for p in figures["phases"].values())
    lines = profile_lines(caplog)
    assert lines and all(line["steps"] == 4 and line["role"] == "offline" for line in lines)
    assert llm.profile()["steps"] == 0  # reset
    assert LLM(tiny_model_dir("llama-gqa"), block_size=4, num_kv_blocks=200).profile() is None


WORKER_PHASES = {"wait for plan", "plan decode", "apply plan", "prepare inputs", "forward", "sample", "result send"}
CORE_PHASES = {"wait for API servers", "schedule", "plan send", "wait for result", "result decode", "apply result",
               "deliver", "admission turns"}
API_PHASES = {"outputs decode", "dispatch", "hand on", "handlers"}


@pytest.mark.slow
def test_serve_with_profile_steps_logs_a_profile_line_from_every_process(tiny_model_dir, tmp_path):
    """`pagewire serve --profile-steps N` hands the setting to the worker, the core and the API
    server, and each logs its own phases every N of its steps."""
    from concurrent.futures import ThreadPoolExecutor

    from pagewire_common.v1 import generation_pb2 as pb
    from tests.service_utils import Proc, free_port, sampling, stub

    addr = f"127.0.0.1:{free_port()}"
    serve = Proc(["serve", "--model", str(tiny_model_dir("llama-gqa")), "--listen", addr, "--block-size", "4",
                  "--num-kv-blocks", "200", "--profile-steps", "4"], tmp_path / "serve.log")
    try:
        serve.wait_for_output("pagewire ready", timeout=90)
        client = stub(addr)

        def generate(i: int) -> int:
            request = pb.GenerateRequest(prompt_token_ids=[5 + i, 6, 7],
                                         sampling=sampling(max_tokens=16, ignore_eos=True))
            return sum(len(r.token_ids) for r in client.Generate(request))

        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(generate, range(4))) == [16] * 4
        serve.stop()
        lines = [line for line in map(step_profile.parse_line, serve.output().splitlines()) if line]
    finally:
        serve.kill()
    by_role = {}
    for line in lines:
        assert set(line) == KEYS and line["steps"] == 4, line
        assert all(set(p) == PHASE_KEYS for p in line["phases"].values()), line
        by_role.setdefault(line["role"], []).append(line)
    assert set(by_role) == {"worker", "core", "api-server"}
    assert WORKER_PHASES <= set(by_role["worker"][0]["phases"])
    assert CORE_PHASES <= set().union(*(line["phases"] for line in by_role["core"]))
    assert API_PHASES <= set().union(*(line["phases"] for line in by_role["api-server"]))
