"""Time the worker's sampler alone on random logits (CPU by default). Feeds docs/benchmarks.md,
section "Sampling at temperature 1.0".

    python benchmarks/sampler_speed.py [--rows 32] [--vocab 49152] [--device cpu]

Prints milliseconds per call for greedy rows, plain temperature sampling, top_k=50 + top_p=0.95,
top_p=0.9 alone, and per-row seeds; on CPU also greedy and temperature 1.0 with torch's operators
in place of the C argmax and draw the sampler takes there (``worker_svc.cpu.sampler``).
"""

from __future__ import annotations

import argparse
import time

from worker_svc.cpu import features  # torch-free

features.cap_torch_isa()  # PAGEWIRE_CPU_ISA reaches torch and oneDNN only if set before torch is imported
import torch  # noqa: E402

from pagewire_common.sampling import SamplingParams
from worker_svc.sampler import Sampler, SamplingBatch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    # peaked like a language model's logits: a few dozen likely tokens over a long tail
    logits = torch.randn(args.rows, args.vocab, generator=gen) * 3
    logits[:, :20] += 12
    logits = logits.to(args.device)
    sampler = Sampler(args.device)
    cases = {
        "greedy": [SamplingParams(temperature=0.0)] * args.rows,
        "temperature 1.0": [SamplingParams(temperature=1.0)] * args.rows,
        "top_k 50, top_p 0.95": [SamplingParams(temperature=0.8, top_k=50, top_p=0.95)] * args.rows,
        "top_p 0.9": [SamplingParams(temperature=0.8, top_p=0.9)] * args.rows,
        "seeded rows": [SamplingParams(temperature=1.0, seed=i) for i in range(args.rows)],
    }
    for name, params in cases.items():
        batch = SamplingBatch(params, list(range(args.rows)), want_logprobs=False)
        sampler(logits, batch)  # warm up
        start = time.perf_counter()
        for _ in range(args.iters):
            sampler(logits, batch)
        if args.device != "cpu":
            torch.cuda.synchronize()
        print(f"{name:>22}: {(time.perf_counter() - start) / args.iters * 1e3:8.2f} ms")
    if sampler._cpu is not None:
        sampler._cpu = None  # torch's operators
        for name in ("greedy", "temperature 1.0"):
            batch = SamplingBatch(cases[name], list(range(args.rows)), want_logprobs=False)
            sampler(logits, batch)
            start = time.perf_counter()
            for _ in range(args.iters):
                sampler(logits, batch)
            print(f"{name + ', torch':>22}: {(time.perf_counter() - start) / args.iters * 1e3:8.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
