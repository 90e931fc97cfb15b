"""How many threads a small CPU step runs on: one, or the process's count, whichever its recent
steps took less time on.

A step of one or two tokens (a lone stream's decode) streams every weight past one or two rows.
On two threads each of its ~250 parallel regions (several per layer) ends in a barrier, which
waits for any thread that another process took the core from: the API server, the core and the
client of the same stream, or any other program on the machine. On a quiet machine two threads
finish such a step about 1.2x sooner than one; with the cores shared, one thread is faster, by
several times when other programs keep them busy. So the choice is measured: the runner times
every small step, keeps a moving mean per choice, runs on the faster one, and now and then tries
the other (less often the slower it was), so that the choice follows the load.

Torch-free: the runner sets the count it picks (``torch.set_num_threads``) around the step.
"""

from __future__ import annotations

import time
from collections.abc import Callable

# a step of at most this many tokens is small
SMALL_STEP_MAX_TOKENS = 2
# try the other choice once every this many small steps, times how much slower it was (so a try
# costs at most about 1 / PROBE_EVERY of the time however slow it is)
PROBE_EVERY = 32
# weight of a new time in a choice's moving mean
MEAN_WEIGHT = 0.25


class SmallStepThreads:
    """The thread count of small steps, chosen between 1 and ``num_threads`` by their times."""

    def __init__(self, num_threads: int, clock: Callable[[], float] = time.perf_counter):
        self.num_threads = num_threads
        self.clock = clock
        self.mean_s: dict[int, float | None] = {1: None, num_threads: None}  # threads -> moving mean of a step
        self.best = 1
        self.since_probe = 0

    def pick(self) -> int:
        """The thread count of the next small step."""
        if self.num_threads <= 1:
            return 1
        other = self.num_threads if self.best == 1 else 1
        best_s, other_s = self.mean_s[self.best], self.mean_s[other]
        if best_s is None:
            return self.best
        slower = 1.0 if other_s is None else other_s / best_s
        if self.since_probe >= PROBE_EVERY * slower:
            return other
        return self.best

    def record(self, threads: int, seconds: float) -> None:
        """A small step ran on ``threads`` in ``seconds``."""
        mean = self.mean_s[threads]
        self.mean_s[threads] = seconds if mean is None else mean + MEAN_WEIGHT * (seconds - mean)
        self.since_probe = 0 if threads != self.best else self.since_probe + 1
        other = self.num_threads if self.best == 1 else 1
        if self.mean_s[other] is not None and self.mean_s[other] < self.mean_s[self.best]:
            self.best = other
