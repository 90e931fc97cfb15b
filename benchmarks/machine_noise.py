"""How steady is this machine? Times a memory-bound loop and a compute-bound loop, interleaved,
for a while, and reports how much each one's speed moves: the noise floor under any latency
ratio measured here (docs/benchmarks.md, section 2).

    python benchmarks/machine_noise.py [--seconds 60] [--threads 2] [--window 20] [--json PATH]

- memory: one copy of a 256 MiB fp32 tensor (read 256 MiB, write 256 MiB), far larger than any
  cache, like a step streaming the model's weights;
- compute: 40 products of 384 x 384 fp32 matrices, which stay in cache.

For each it prints p50, p99 and their ratio over the whole run, and the medians of consecutive
windows of ``--window`` iterations: how far the machine's speed drifts over seconds. Identical
work has no other reason to vary, so a ratio here is a floor for ITL p99 / p50 on this machine.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch


def summarize(ms: np.ndarray, window: int) -> dict:
    medians = [float(np.median(ms[i:i + window])) for i in range(0, len(ms) - window + 1, window)]
    return {
        "iterations": len(ms),
        "p50_ms": float(np.percentile(ms, 50)),
        "p99_ms": float(np.percentile(ms, 99)),
        "p99_over_p50": float(np.percentile(ms, 99) / np.percentile(ms, 50)),
        "window_medians_ms": medians,
        "slowest_over_fastest_window": max(medians) / min(medians) if medians else float("nan"),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=60.0, help="how long to run (default: 60)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, one per core)")
    p.add_argument("--window", type=int, default=20, help="iterations per window for the drift figures (default: 20)")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    src = torch.ones(64 * 1024 * 1024)
    dst = torch.empty_like(src)
    a, b = torch.randn(384, 384), torch.randn(384, 384)
    memory, compute = [], []
    end = time.monotonic() + args.seconds
    while time.monotonic() < end:
        t = time.perf_counter()
        dst.copy_(src)
        memory.append(time.perf_counter() - t)
        t = time.perf_counter()
        for _ in range(40):
            torch.mm(a, b)
        compute.append(time.perf_counter() - t)
    mem, cmp_ = np.array(memory[1:]) * 1e3, np.array(compute[1:]) * 1e3  # the first of each warms up
    results = {"seconds": args.seconds, "threads": torch.get_num_threads(),
               "memory": summarize(mem, args.window), "compute": summarize(cmp_, args.window)}
    results["memory"]["p50_gb_per_s"] = 2 * src.numel() * 4 / (results["memory"]["p50_ms"] / 1e3) / 1e9
    for name in ("memory", "compute"):
        r = results[name]
        w = r["window_medians_ms"]
        print(f"{name:8s} p50 {r['p50_ms']:6.2f} ms  p99 {r['p99_ms']:6.2f} ms  p99/p50 {r['p99_over_p50']:.2f} | "
              f"window medians {min(w):.2f}-{max(w):.2f} ms (slowest/fastest {r['slowest_over_fastest_window']:.2f})")
    print(f"memory bandwidth at p50: {results['memory']['p50_gb_per_s']:.1f} GB/s (read + write)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
