"""An API server's CPU per streamed token for its per-token Prometheus figures (generation tokens,
inter-token latencies), in prometheus_client's multiprocess mode as under ``pagewire serve``.
Feeds docs/benchmarks.md, section "3. Control plane".

    python benchmarks/request_metrics_cpu.py [--streams 64] [--turns 200] [--repeats 5]

``RequestMetrics.tokens`` is called for ``--streams`` one-token deltas per turn of the event loop,
as a step's deltas reach their handlers, two ways in one run: the figures summed and written once a
turn (as served), and written after every delta (``flush`` at once: what a write per token costs).
Best of ``--repeats``, process CPU time.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=64, help="deltas per turn of the loop (default: %(default)s)")
    parser.add_argument("--turns", type=int, default=200, help="turns per measurement (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=5, help="measurements, the best kept (default: %(default)s)")
    args = parser.parse_args()
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="pagewire-metrics-")
    from scheduler_svc.api.metrics import RequestMetrics  # after the folder is set: the values go to files

    gaps = [0.004 + i * 1e-5 for i in range(args.streams)]

    async def measure(name: str, write_each: bool) -> float:
        """Best CPU seconds of ``--turns`` turns; ``write_each``: the figures written after every
        delta (as a write per token would), else once a turn (as served)."""
        metrics, best = RequestMetrics(name), float("inf")
        for _ in range(args.repeats):
            start = time.process_time()
            for _ in range(args.turns):
                for gap in gaps:
                    metrics.tokens(1, gap)
                    if write_each:
                        metrics.flush()
                await asyncio.sleep(0)
            best = min(best, time.process_time() - start)
        return best

    tokens = args.turns * args.streams
    at_once = asyncio.run(measure("written-at-once", True)) / tokens * 1e6
    per_turn = asyncio.run(measure("written-once-a-turn", False)) / tokens * 1e6
    print(f"{args.streams} one-token deltas a turn: {at_once:.2f} us CPU a token written at once, "
          f"{per_turn:.2f} written once a turn")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
