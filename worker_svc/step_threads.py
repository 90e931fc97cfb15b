"""How many threads a CPU step runs on: one, or the process's count, whichever recent steps of its
size took less time on.

Every parallel region of a step (several per layer, ~250 a step) ends in a barrier, which waits
for any thread that another process took the core from: the API server, the core and the
clients, or any other program on the machine. On a quiet machine two threads finish a lone
stream's decode about 1.2x sooner than one (SmolLM2-135M in bf16 on Zen 5: a pass at one row took
8.1 ms against 9.7), and steps of many rows sooner still; with the cores shared, one thread is
faster, by several times when other programs keep them busy (there a 16-row linear took 31 ms on
two threads and 0.9 ms on one). So the choice is measured, per size of step
(its tokens, rounded down to a power of two): the runner times every step, keeps a moving mean of
the faster choice's time per token and the other's last try, runs on the faster one, tries the
other on the second step of a size and then now and then (less often the slower it was), so that
the choice follows the load.

A step of each size starts on all threads; a try of the slower choice costs at most about
1 / PROBE_EVERY of the steps' time. Each choice's first step of a size is not counted: it carries
one-off costs (the threads' start, first touches of the weights and of buffers kept per step size:
36 ms against ~4 for a lone stream's decode on two threads), and counted it made the second
choice, tried after them, look faster for a long while. Torch-free: the runner sets the count it picks
(``torch.set_num_threads``) around the step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

# try the other choice once every this many steps of a size, times how much slower it was
PROBE_EVERY = 32
# weight of a new time in the faster choice's moving mean
MEAN_WEIGHT = 0.25
# the other choice takes over only below this share of the current one's time: a lucky try (a
# quiet moment for one thread while two share the cores with the API server and the core) must
# not flip a quiet machine's lone stream to one thread, which takes it ~1.2x as long
SWITCH_BELOW = 0.9


@dataclass(slots=True)
class _SizeChoice:
    """What is known of the steps of one size: each choice's mean seconds per token (None until it
    ran), the faster one, and the steps since the other was last tried."""

    best: int
    mean_s: dict[int, float | None]
    since_probe: int = 0
    warmed: set[int] = field(default_factory=set)  # the choices whose first step (not counted) ran


class StepThreads:
    """The thread count of each step, chosen between 1 and ``num_threads`` by measured times."""

    def __init__(self, num_threads: int, clock: Callable[[], float] = time.perf_counter):
        self.num_threads = num_threads
        self.clock = clock
        self._sizes: dict[int, _SizeChoice] = {}  # size class (bit length of the token count) -> choice

    def _size(self, num_tokens: int) -> _SizeChoice:
        size = num_tokens.bit_length()
        choice = self._sizes.get(size)
        if choice is None:
            self._sizes[size] = choice = _SizeChoice(self.num_threads, {1: None, self.num_threads: None})
        return choice

    def _other(self, threads: int) -> int:
        return self.num_threads if threads == 1 else 1

    def pick(self, num_tokens: int) -> int:
        """The thread count of the next step, of ``num_tokens`` tokens."""
        if self.num_threads <= 1:
            return 1
        choice = self._size(num_tokens)
        other = self._other(choice.best)
        best_s, other_s = choice.mean_s[choice.best], choice.mean_s[other]
        if best_s is None:
            return choice.best
        if other_s is None:  # the third step of this size tries the other choice (twice: see record)
            return other
        if choice.since_probe >= PROBE_EVERY * other_s / best_s:
            return other
        return choice.best

    def record(self, num_tokens: int, threads: int, seconds: float) -> None:
        """A step of ``num_tokens`` tokens ran on ``threads`` in ``seconds``."""
        if self.num_threads <= 1:
            return
        choice = self._size(num_tokens)
        if threads not in choice.warmed:
            choice.warmed.add(threads)
            return
        per_token = seconds / num_tokens
        mean = choice.mean_s[threads]
        # the faster choice runs most steps and keeps a moving mean; a try of the other stands for it
        # alone until the next, so one slow first step does not keep a choice out for long
        weight = MEAN_WEIGHT if threads == choice.best else 1.0
        choice.mean_s[threads] = per_token if mean is None else mean + weight * (per_token - mean)
        choice.since_probe = 0 if threads != choice.best else choice.since_probe + 1
        best_s, other_s = choice.mean_s[choice.best], choice.mean_s[self._other(choice.best)]
        if other_s is not None and (best_s is None or other_s < SWITCH_BELOW * best_s):
            choice.best = self._other(choice.best)
