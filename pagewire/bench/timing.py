"""Timing a small function for the micro-benchmarks in ``benchmarks/``."""

from __future__ import annotations

import time


def best_us(fn, repeats: int, loops: int | None = None, budget_s: float = 0.05) -> float:
    """The best of ``repeats`` timed loops of ``fn()``, in µs per call, after one warm-up call.
    ``loops`` calls per timed loop; by default as many as take about ``budget_s``."""
    fn()
    if loops is None:
        t = time.perf_counter()
        fn()
        loops = max(1, int(budget_s / max(time.perf_counter() - t, 1e-6)))
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(loops):
            fn()
        best = min(best, (time.perf_counter() - t) / loops)
    return best * 1e6
