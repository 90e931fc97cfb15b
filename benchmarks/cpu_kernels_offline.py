"""Offline throughput with the worker's CPU kernels in three configurations, alternated, each in a
process of its own. Feeds docs/benchmarks.md, section "The CPU linears".

    python benchmarks/cpu_kernels_offline.py [--rounds 2] [--num-prompts 32] [--max-tokens 64] [--dtype bfloat16]

  onednn   linears prepacked for oneDNN, norms, SiLU and rotary as torch operators
  linears  linears on the C kernel (worker_svc/cpu/csrc/linear.c: fp32 panels, or for --dtype bfloat16 its
           bf16 pairs, on AMX tiles or AVX-512 BF16 dot products), the rest as torch operators
  all      the worker's own choice on this CPU: on AVX2, the C linears and the fused C steps

A configuration is chosen by replacing the worker's decisions in the child process
(``worker_svc.cpu.linear.kernel_beats_onednn`` and ``pair_instructions``, and
``use_fused_cpu_kernels`` as ``worker_svc.cpu.prepare`` calls it). Each child runs
``LLM.generate`` in --dtype (float32 by default; a bfloat16 model computes in bf16 only on a CPU
with native bf16) on --num-prompts 16-token prompts, greedy, EOS ignored, after a warm-up, and
prints the best completion tok/s of --repeats runs.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

CONFIGS = ("onednn", "linears", "all")


def child(config: str, num_prompts: int, max_tokens: int, repeats: int, dtype: str) -> None:
    from worker_svc.cpu import linear as cpu_linear
    from worker_svc.cpu import prepare

    if config == "onednn":
        cpu_linear.kernel_beats_onednn = lambda cpu: False
        cpu_linear.pair_instructions = lambda cpu, lib: None
    elif config == "linears":
        cpu_linear.kernel_beats_onednn = lambda cpu: True
    if config in ("onednn", "linears"):
        prepare.use_fused_cpu_kernels = lambda model, dtype=None: 0
    from pagewire import LLM, SamplingParams

    prompts = [[100 + 7 * i + j for j in range(16)] for i in range(num_prompts)]
    with LLM(dtype=dtype) as llm:
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        best = 0.0
        for _ in range(repeats):
            start = time.perf_counter()
            llm.generate(prompts, params)
            best = max(best, num_prompts * max_tokens / (time.perf_counter() - start))
    print(f"{best:.1f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2, help="rounds through the three configurations")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per child; the best counts")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="the model's dtype")
    ap.add_argument("--child", choices=CONFIGS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.num_prompts, args.max_tokens, args.repeats, args.dtype)
        return 0
    from worker_svc.cpu.features import cpu_info

    results: dict[str, list[str]] = {c: [] for c in CONFIGS}
    for _ in range(args.rounds):
        for config in CONFIGS:
            out = subprocess.run([sys.executable, __file__, "--child", config, "--num-prompts", str(args.num_prompts),
                                  "--max-tokens", str(args.max_tokens), "--repeats", str(args.repeats),
                                  "--dtype", args.dtype],
                                 capture_output=True, text=True, check=True)
            results[config].append(out.stdout.split()[-1])
            print(f"{config}: {results[config][-1]} tok/s", file=sys.stderr, flush=True)
    print(f"ISA {cpu_info().isa_description}, {args.dtype}; completion tok/s, best of {args.repeats}, per round")
    for config in CONFIGS:
        print(f"{config:8s} {', '.join(results[config])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
