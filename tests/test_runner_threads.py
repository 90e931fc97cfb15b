"""A CPU step's thread count (``worker_svc.step_threads``): one or the process's, whichever steps of
its size ran faster on lately, the other tried now and then; the runner sets it around the step
only, and the tokens are the same either way."""

from __future__ import annotations

import pytest
import torch

from pagewire_common.plan import NewSequence, RunningSequence, StepPlan
from pagewire_common.sampling import SamplingParams
from worker_svc.runner import ModelRunner, RunnerConfig
from worker_svc.step_threads import PROBE_EVERY, StepThreads

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


def run_steps(chooser: StepThreads, num_tokens: int, seconds: dict[int, float], num_steps: int) -> list[int]:
    """The thread counts ``chooser`` picks over ``num_steps`` steps of ``num_tokens`` tokens that
    take ``seconds[threads]``."""
    picked = []
    for _ in range(num_steps):
        threads = chooser.pick(num_tokens)
        chooser.record(num_tokens, threads, seconds[threads])
        picked.append(threads)
    return picked


def test_a_size_starts_on_all_threads_tries_one_then_takes_the_faster_choice():
    chooser = StepThreads(2)
    picked = run_steps(chooser, 1, {1: 0.010, 2: 0.008}, 6)
    # each choice's first step is not counted: two threads twice, then one thread twice, slower: two kept
    assert picked == [2, 2, 1, 1, 2, 2]
    # the machine gets busy: two threads take 5x one's time; one step on them and a try of one, kept
    picked = run_steps(chooser, 1, {1: 0.012, 2: 0.060}, 400)
    switch = picked.index(1)
    assert switch <= PROBE_EVERY + 1 and chooser.pick(1) == 1
    tries = [i for i, t in enumerate(picked) if t == 2 and i > switch]
    # two threads are tried again, each time later as their mean slows towards 5x
    gaps = [b - a for a, b in zip([switch, *tries], tries)]
    assert 3 <= len(tries) <= 5 and gaps == sorted(gaps) and gaps[0] > PROBE_EVERY and gaps[-1] > 3 * PROBE_EVERY


def test_each_size_of_step_is_measured_apart_per_token():
    chooser = StepThreads(4)
    # 32-token steps start on all four threads, try one after two steps, and keep four
    assert run_steps(chooser, 32, {1: 0.080, 4: 0.040}, 6) == [4, 4, 1, 1, 4, 4]
    # a 40-token step is of the same size (32 to 63 tokens): its time per token is compared
    assert chooser.pick(40) == 4
    # single-token steps know nothing of that: all threads first, then one, then the faster
    assert run_steps(chooser, 1, {1: 0.010, 4: 0.030}, 5) == [4, 4, 1, 1, 1]
    # two threads' tries of the slower 32-token choice come once per PROBE_EVERY x 2 steps or later
    picked = run_steps(chooser, 32, {1: 0.080, 4: 0.040}, 4 * PROBE_EVERY)
    assert 1 <= picked.count(1) <= 2


def test_a_single_thread_process_has_nothing_to_choose():
    chooser = StepThreads(1)
    assert run_steps(chooser, 1, {1: 0.01}, 3) == [1, 1, 1] and run_steps(chooser, 64, {1: 0.01}, 3) == [1, 1, 1]


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


def test_the_runner_sets_the_picked_threads_around_each_step(tiny_model_dir, two_threads, monkeypatch):
    tokens, threads = decode(tiny_model_dir, [5, 9, 3, 11, 2], 6)
    # the 5-token prefill on the process's two threads, the first two decodes too, the third on one
    assert threads[:4] == [2, 2, 2, 1]
    monkeypatch.setattr(StepThreads, "pick", lambda self, num_tokens: self.num_threads)  # always both
    same, threads = decode(tiny_model_dir, [5, 9, 3, 11, 2], 6)
    assert threads == [2] * 7 and same == tokens


def test_a_try_must_beat_the_current_choice_clearly_to_take_over():
    chooser = StepThreads(2)
    # one thread 5% faster than two: noise, two kept; 20% faster: one takes over
    assert run_steps(chooser, 1, {1: 0.0095, 2: 0.010}, 5) == [2, 2, 1, 1, 2]
    assert run_steps(StepThreads(2), 1, {1: 0.008, 2: 0.010}, 5) == [2, 2, 1, 1, 1]


def test_a_choices_first_step_of_a_size_is_not_counted():
    chooser = StepThreads(2)
    slow_start = iter([0.300] + [0.008] * 20)  # two threads' first step pays the threads' start
    picked = []
    for _ in range(8):
        threads = chooser.pick(1)
        chooser.record(1, threads, next(slow_start) if threads == 2 else 0.010)
        picked.append(threads)
    assert picked == [2, 2, 1, 1, 2, 2, 2, 2]  # one thread (0.010) never beat two's 0.008
