"""CPU time of the same Python work run back to back and in short bursts between sleeps. Feeds
docs/benchmarks.md, section "3. Control plane".

    python benchmarks/burst_cpu.py [--calls 3000] [--repeat 2]

A served process (the scheduler core, an API server) runs a few hundred microseconds of Python,
then sleeps on its sockets until the next message. This times one scheduler-like unit of work
(200 small objects picked at random from 4,000, a dict, a few numpy calls) with
``time.process_time``: back to back, and with a 1 ms or 5 ms sleep after each call. On a
machine whose CPUs stay hot the three agree; where an idle CPU is halted or handed to someone
else (a virtual machine's vCPU), each burst starts slow and costs more CPU for the same work,
which no change to the work itself removes. Start a busy low-priority process on the same CPU
(``chrt -i 0 taskset -c 1 python3 -c 'while True: pass'`` with this under ``taskset -c 1``) to
see how much of the difference comes from the CPU going idle.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

import numpy as np


class _Item:
    __slots__ = ("a", "b", "key", "tokens")

    def __init__(self, i: int):
        self.a = i
        self.b = 2 * i
        self.key = str(i)
        self.tokens = list(range(i % 50))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=3000, help="calls per measurement (default: %(default)s)")
    p.add_argument("--repeat", type=int, default=2, help="rounds of the three measurements (default: %(default)s)")
    args = p.parse_args()
    rng = random.Random(0)
    items = [_Item(i) for i in range(4000)]
    values = np.arange(4000)

    def work() -> int:
        total, seen = 0, {}
        for item in rng.sample(items, 200):
            total += item.a + item.b + len(item.tokens)
            seen[item.key] = item.a
            item.tokens.append(total & 7)
            item.tokens.pop()
        for _ in range(10):
            total += int(values[values % 7 == 3].sum())
        return total

    def us_per_call(sleep_s: float, calls: int) -> float:
        spent = 0.0
        for _ in range(calls):
            t0 = time.process_time()
            work()
            spent += time.process_time() - t0
            if sleep_s:
                time.sleep(sleep_s)
        return 1e6 * spent / calls

    for _ in range(args.repeat):
        hot = us_per_call(0.0, args.calls)
        short = us_per_call(0.001, args.calls)
        long = us_per_call(0.005, max(args.calls // 5, 1))
        print(f"CPU per call: back to back {hot:.0f} us; after 1 ms sleeps {short:.0f} us ({short / hot:.2f}x); "
              f"after 5 ms sleeps {long:.0f} us ({long / hot:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
