"""A small CPU step's thread count (``worker_svc.step_threads``): one or the process's, whichever
its recent steps took less time on, the other tried now and then; the runner sets it around the
step only, and the tokens are the same either way."""

from __future__ import annotations

import pytest
import torch

from pagewire_common.plan import NewSequence, RunningSequence, StepPlan
from pagewire_common.sampling import SamplingParams
from worker_svc import step_threads
from worker_svc.runner import ModelRunner, RunnerConfig
from worker_svc.step_threads import PROBE_EVERY, SmallStepThreads

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


def run_steps(chooser: SmallStepThreads, seconds: dict[int, float], num_steps: int) -> list[int]:
    """The thread counts ``chooser`` picks over ``num_steps`` steps that take ``seconds[threads]``."""
    picked = []
    for _ in range(num_steps):
        threads = chooser.pick()
        chooser.record(threads, seconds[threads])
        picked.append(threads)
    return picked


def test_one_thread_first_then_the_faster_choice_with_rarer_tries_of_a_slower_one():
    chooser = SmallStepThreads(2)
    picked = run_steps(chooser, {1: 0.010, 2: 0.008}, PROBE_EVERY + 3)
    # one thread until the first try of two, which was faster: two from then on
    assert picked == [1] * PROBE_EVERY + [2, 2, 2]
    assert chooser.best == 2
    # the machine gets busy: two threads take 5x one's time; one step on them and one thread is back
    picked = run_steps(chooser, {1: 0.012, 2: 0.060}, 400)
    assert picked[:2] == [2, 1] and chooser.best == 1
    tries = [i for i, t in enumerate(picked) if t == 2][1:]
    # two threads are tried again, each time later as their mean slows towards 5x
    gaps = [b - a for a, b in zip([1, *tries], tries)]
    assert 3 <= len(tries) <= 5 and gaps == sorted(gaps) and gaps[0] > PROBE_EVERY and gaps[-1] > 3 * PROBE_EVERY


def test_a_single_thread_process_has_nothing_to_choose():
    chooser = SmallStepThreads(1)
    assert run_steps(chooser, {1: 0.01}, PROBE_EVERY * 3) == [1] * (PROBE_EVERY * 3)


@pytest.fixture()
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def decode(tiny_model_dir, prompt: list[int], steps: int) -> tuple[list[int], list[int]]:
    """Greedy tokens of one sequence (prefill, then ``steps`` decodes) on a new runner, and the
    thread count each step's forward ran on."""
    runner = ModelRunner(tiny_model_dir("llama-gqa"), RunnerConfig(block_size=4, num_kv_blocks=16, device="cpu",
                                                                   dtype="float32"))
    threads = []
    model_forward = runner.model.forward

    def forward(*args):
        threads.append(torch.get_num_threads())
        return model_forward(*args)

    runner.model.forward = forward
    tokens = list(runner.execute(StepPlan(1, new_seqs=[NewSequence(7, prompt, [0, 1, 2, 3], 0, len(prompt), GREEDY)])).token_ids)
    for step in range(steps):
        tokens += runner.execute(StepPlan(2 + step, running_seqs=[RunningSequence(7, 1)])).token_ids
        assert torch.get_num_threads() == 2  # the process's count outside a step
    return tokens, threads


def test_the_runner_sets_the_picked_threads_around_small_steps_only(tiny_model_dir, two_threads, monkeypatch):
    monkeypatch.setattr(step_threads, "PROBE_EVERY", 3)
    tokens, threads = decode(tiny_model_dir, [5, 9, 3, 11, 2], 6)
    # the 5-token prefill on the process's two threads; decodes on one, then a try of two
    assert threads[:5] == [2, 1, 1, 1, 2]
    monkeypatch.setattr("worker_svc.runner.SMALL_STEP_MAX_TOKENS", 0)
    same, threads = decode(tiny_model_dir, [5, 9, 3, 11, 2], 6)
    assert threads == [2] * 7 and same == tokens
