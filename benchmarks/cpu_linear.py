"""SmolLM2-135M's linears on CPU, by weight layout: fp32 weights packed for oneDNN, fp32 and bf16
weights in our C kernel's panels (worker_svc/cpu/linear.py), and, per layer, torch's bf16
``F.linear`` and bf16 weights widened to fp32 on every call (the reference). On a CPU with AVX-512
BF16, the model pass also times oneDNN's bf16 linear and the kernel's bf16 pairs (bf16 x and y) on
vector dot products, and on a CPU with AMX the same pairs on AMX tiles. Feeds docs/benchmarks.md, section "The CPU linears".

Two measurements:
  * a model pass: the 4 linears of each of 30 layers and the output head, each with weights of
    its own (270 MB in bf16, 540 MB in fp32, far past the caches), as in a decode step, which
    streams every weight from memory;
  * one layer at a time (``--per-layer``), its weights warm in the caches after the first call.

Each figure is the best of several timed loops; the layouts alternate so that the VM's drifting
speed hits them alike.

    python benchmarks/cpu_linear.py
    python benchmarks/cpu_linear.py --rows 1,8,32,64,512 --per-layer
"""

from __future__ import annotations

import argparse
import functools

from worker_svc.cpu import features  # torch-free

features.cap_torch_isa()  # PAGEWIRE_CPU_ISA reaches torch and oneDNN only if set before torch is imported
import torch  # noqa: E402
import torch.nn.functional as F

from pagewire.bench.timing import best_us
from worker_svc.cpu.features import cpu_info
from worker_svc.cpu.linear import kernel, linear_ref

NUM_LAYERS = 30
# name -> (out_features, in_features); q/k/v and gate/up fused, the head tied to the embedding
LAYER_SHAPES = {
    "qkv_proj 576->960": (960, 576),
    "o_proj 576->576": (576, 576),
    "gate_up_proj 576->3072": (3072, 576),
    "down_proj 1536->576": (576, 1536),
}
HEAD_SHAPE = {"lm_head 576->49152": (49152, 576)}


def alternate(cases: dict, repeats: int, loops: int | None = None) -> dict[str, float]:
    """The best µs per call of each case, over two alternating rounds."""
    best = {key: float("inf") for key in cases}
    for _ in range(2):
        for key, fn in cases.items():
            if fn is not None:
                best[key] = min(best[key], best_us(fn, repeats, loops))
    return best


def model_pass(lib, rows: list[int], repeats: int) -> None:
    """fp32 and bf16 weights widened in the kernel, against oneDNN's fp32; on a CPU with native
    bf16 also oneDNN's bf16 and the kernel's bf16 pairs (bf16 x and y, AVX-512 BF16 dot products),
    and with AMX the pairs on AMX tiles."""
    native = cpu_info().native_bf16 and lib.pairs_simd
    amx = native and lib.pairs_amx
    print(f"\nmodel pass: {NUM_LAYERS} layers x 4 linears + the head, ms per pass")
    extra = " bf16, oneDNN packed | bf16 pairs, C kernel | pairs vs oneDNN bf16 | GFLOP/s, pairs |" if native else ""
    extra += " bf16 pairs, AMX tiles | AMX vs oneDNN bf16 | GFLOP/s, AMX |" if amx else ""
    print(f"| rows | fp32, oneDNN packed | fp32, C kernel | bf16, C kernel | C fp32 vs oneDNN | GFLOP/s, C fp32 |{extra}")
    print("| ---: " * (6 + 4 * native + 3 * amx) + "|")
    gen = torch.Generator().manual_seed(0)
    shapes = list(LAYER_SHAPES.values()) * NUM_LAYERS + list(HEAD_SHAPE.values())
    weights = []
    for n, k in shapes:
        w = torch.randn(n, k, generator=gen) * 0.05
        weights.append((n, k, torch.ops.mkldnn._reorder_linear_weight(w, None), lib.pack(w), lib.pack(w, torch.bfloat16),
                        torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), None) if native else None,
                        lib.pack_pairs(w) if native else None))
    flops_per_row = sum(2 * n * k for n, k in shapes)
    for m in rows:
        xs = {k: torch.randn(m, k, generator=gen) for k in {k for _, k in shapes}}
        xs16 = {k: x.bfloat16() for k, x in xs.items()}

        def onednn(index, inputs):
            for weight in weights:
                torch.ops.mkldnn._linear_pointwise(inputs[weight[1]], weight[index], None, "none", [], "")

        def c_kernel(index):
            for weight in weights:
                lib.linear(xs[weight[1]], weight[index], weight[0], None)

        def pairs(on_tiles: bool):
            lib.pairs_amx = on_tiles
            try:
                for weight in weights:
                    lib.linear_pairs(xs16[weight[1]], weight[6], weight[0], None)
            finally:
                lib.pairs_amx = amx

        cases = {"onednn": functools.partial(onednn, 2, xs), "fp32": functools.partial(c_kernel, 3),
                 "bf16": functools.partial(c_kernel, 4)}
        if native:
            cases.update(onednn_bf16=functools.partial(onednn, 5, xs16), pairs=functools.partial(pairs, False))
        if amx:
            cases.update(amx=functools.partial(pairs, True))
        best = alternate(cases, repeats, loops=1)
        line = (f"| {m} | {best['onednn'] / 1e3:.1f} | {best['fp32'] / 1e3:.1f} | {best['bf16'] / 1e3:.1f} | "
                f"{best['onednn'] / best['fp32']:.2f}x | {flops_per_row * m / best['fp32'] / 1e3:.0f} |")
        if native:
            line += (f" {best['onednn_bf16'] / 1e3:.1f} | {best['pairs'] / 1e3:.1f} | "
                     f"{best['onednn_bf16'] / best['pairs']:.2f}x | {flops_per_row * m / best['pairs'] / 1e3:.0f} |")
        if amx:
            line += (f" {best['amx'] / 1e3:.1f} | {best['onednn_bf16'] / best['amx']:.2f}x |"
                     f" {flops_per_row * m / best['amx'] / 1e3:.0f} |")
        print(line, flush=True)


def per_layer(lib, rows: list[int], repeats: int) -> None:
    print("\none linear at a time (weights warm in the caches), µs per call")
    print("| linear | rows | fp32, oneDNN packed | fp32, C kernel | bf16, torch F.linear | bf16 widened per call "
          "| bf16, C kernel |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    gen = torch.Generator().manual_seed(0)
    for name, (n, k) in {**LAYER_SHAPES, **HEAD_SHAPE}.items():
        w32 = torch.randn(n, k, generator=gen) * 0.05
        w16 = w32.bfloat16()
        dnn = torch.ops.mkldnn._reorder_linear_weight(w32, None)
        packed32, packed16 = lib.pack(w32), lib.pack(w16, torch.bfloat16)
        for m in rows:
            x = torch.randn(m, k, generator=gen)
            best = alternate({
                "onednn": functools.partial(torch.ops.mkldnn._linear_pointwise, x, dnn, None, "none", [], ""),
                "fp32": functools.partial(lib.linear, x, packed32, n, None),
                "torch_bf16": functools.partial(F.linear, x.bfloat16(), w16) if m <= 32 else None,  # slow
                "widened": functools.partial(linear_ref, x, w16),
                "bf16": functools.partial(lib.linear, x, packed16, n, None),
            }, repeats)
            torch_bf16 = "" if best["torch_bf16"] == float("inf") else f"{best['torch_bf16']:.0f}"
            print(f"| {name} | {m} | {best['onednn']:.0f} | {best['fp32']:.0f} | {torch_bf16} | {best['widened']:.0f} | "
                  f"{best['bf16']:.0f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,8,32,64,512", help="comma-separated numbers of rows (tokens)")
    parser.add_argument("--repeats", type=int, default=3, help="timed loops per case; the best counts")
    parser.add_argument("--per-layer", action="store_true", help="also time each linear alone")
    args = parser.parse_args()
    lib = kernel()
    if lib is None:
        raise SystemExit("the CPU linear kernel did not build (is a C compiler on PATH?)")
    rows = [int(r) for r in args.rows.split(",")]
    print(f"threads {torch.get_num_threads()}, ISA {cpu_info().isa_description}; best of {args.repeats} timed loops, alternated")
    model_pass(lib, rows, args.repeats)
    if args.per_layer:
        per_layer(lib, rows, args.repeats)


if __name__ == "__main__":
    main()
