"""One linear layer of SmolLM2-135M on CPU, four ways: fp32 weights packed for oneDNN (the fp32
path), torch's bf16 ``F.linear`` (what bf16 ran on before, without native bf16), bf16 weights
widened to fp32 on every call (the reference), and the C kernel of
worker_svc/layers/cpu_bf16_linear.py (bf16 weights, fp32 products). Feeds docs/benchmarks.md,
section "bf16 on a CPU without native bf16".

Each figure is the best of several timed loops; the four alternate so that the VM's drifting
speed hits them alike. torch's bf16 matmul is timed only up to 32 rows (it is slow).

    python benchmarks/cpu_bf16_linear.py
    python benchmarks/cpu_bf16_linear.py --rows 1,32 --repeats 7
"""

from __future__ import annotations

import argparse
import functools

import torch
import torch.nn.functional as F

from pagewire.bench.timing import best_us
from pagewire_common.cpu_features import cpu_info
from worker_svc.layers.cpu_bf16_linear import bf16_linear_ref, kernel

# name -> (out_features, in_features); q/k/v and gate/up fused, the head tied to the embedding
SHAPES = {
    "qkv_proj 576->960": (960, 576),
    "o_proj 576->576": (576, 576),
    "gate_up_proj 576->3072": (3072, 576),
    "down_proj 1536->576": (576, 1536),
    "lm_head 576->49152": (49152, 576),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,8,32,64", help="comma-separated numbers of rows (tokens)")
    parser.add_argument("--repeats", type=int, default=5, help="timed loops per case; the best counts")
    args = parser.parse_args()
    lib = kernel()
    if lib is None:
        raise SystemExit("the bf16 linear kernel did not build (is a C compiler on PATH?)")
    rows = [int(r) for r in args.rows.split(",")]
    print(f"threads {torch.get_num_threads()}, ISA {cpu_info().isa}; times in us, best of {args.repeats}")
    print("| linear | rows | fp32 oneDNN packed | bf16 torch F.linear | bf16 widened per call | bf16 C kernel | kernel vs fp32 |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    gen = torch.Generator().manual_seed(0)
    for name, (n, k) in SHAPES.items():
        w32 = torch.randn(n, k, generator=gen) * 0.05
        w16 = w32.bfloat16()
        packed32 = torch.ops.mkldnn._reorder_linear_weight(w32, None)
        packed16 = lib.pack(w16)
        for m in rows:
            x = torch.randn(m, k, generator=gen)
            cases = {
                "fp32": functools.partial(torch.ops.mkldnn._linear_pointwise, x, packed32, None, "none", [], ""),
                "torch_bf16": functools.partial(F.linear, x.bfloat16(), w16) if m <= 32 else None,
                "widened": functools.partial(bf16_linear_ref, x, w16),
                "kernel": functools.partial(lib.linear, x, packed16, n, None),
            }
            best = {key: float("inf") for key in cases}
            for _ in range(2):  # alternate
                for key, fn in cases.items():
                    if fn is not None:
                        best[key] = min(best[key], best_us(fn, args.repeats))
            torch_bf16 = "" if cases["torch_bf16"] is None else f"{best['torch_bf16']:.0f}"
            print(f"| {name} | {m} | {best['fp32']:.0f} | {torch_bf16} | {best['widened']:.0f} | "
                  f"{best['kernel']:.0f} | {best['fp32'] / best['kernel']:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
