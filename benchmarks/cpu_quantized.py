"""Quantized weights on CPU (worker_svc/cpu/quantized.py) against bf16 and fp32, four measurements:

  * a model pass through SmolLM2-135M's linears (4 per layer x 30 layers and the head, each with
    weights of its own, far past the caches) at 1 row (one stream's decode step) and more: Q4_1
    linears with a Q8_0 head (the embedded file's types) and all Q8_0 (``--quantization int8``),
    each with fp32 activations, activations rounded to int8 (``--int8-activations``) and (where
    the CPU has AVX-512 BF16) bf16 ones (on AMX also each of its three paths alone: every call on
    the dot products, on the tiles, in exact integer products), the dense kernel's bf16 pairs
    (there too) and fp32 packed for oneDNN; µs and the GB/s of weights read;
  * offline one-stream decode of the embedded model, ``pagewire.LLM``, one prompt, 128 greedy new
    tokens: served from its GGUF blocks (``--dtype auto``, and fp32) against its dequantized copy
    in bf16 and fp32, and with ``--deterministic``, in alternating rounds; tok/s of the whole
    ``generate`` (its 6-token prefill is about one step);
  * offline throughput at 32 streams (32 distinct prompts x 64 greedy new tokens, one
    ``generate``), the same servings alternated (the dequantized fp32 one left out): many rows per
    step, where the kernel's arithmetic (bf16 dot products or fp32 FMAs) decides;
  * greedy agreement on SmolLM2: the quantized model (fp32, ``--dtype auto`` with the prompts
    at once and one at a time, ``--deterministic``, ``--int8-activations``) and the dequantized
    bf16 model against the dequantized fp32 model over a few prompts, and the quantized models in
    bf16 against the dequantized bf16 one: the share of identical tokens position by position, and
    where each prompt first differs.

    python benchmarks/cpu_quantized.py --threads 1 --json docs/bench/cpu-quantized-avx512-zen5-1thread.json

Feeds docs/benchmarks.md, section "Quantized weights".
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

from worker_svc.cpu import features  # torch-free

features.cap_torch_isa()  # PAGEWIRE_CPU_ISA reaches torch and oneDNN only if set before torch is imported
import torch  # noqa: E402

from pagewire.bench.timing import best_us
from worker_svc.cpu import quantized as Q
from worker_svc.cpu.features import cpu_info
from worker_svc.cpu.linear import PackedLinear, mkldnn_linear_available
from worker_svc.cpu.linear import kernel as linear_kernel

NUM_LAYERS = 30
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down
HEAD = (49152, 576)
SERVINGS = {"quantized (GGUF blocks, --dtype auto)": {},
            "quantized fp32": {"gguf_weights": "quantized", "dtype": "float32"},
            "quantized, --int8-activations": {"gguf_weights": "quantized", "int8_activations": True},
            "quantized, --deterministic": {"gguf_weights": "quantized", "deterministic": True},
            "dequantized bf16": {"gguf_weights": "dequantize", "dtype": "bfloat16"},
            "dequantized fp32": {"gguf_weights": "dequantize", "dtype": "float32"}}
PROMPTS = ["The capital of France is", "Write a short poem about the sea.", "def fibonacci(n):",
           "Explain photosynthesis to a child.", "List three uses of a paperclip."]


def on_path(lib, mats: list, xb: dict, *, tiles_from: int, exact_rows: int) -> None:
    """One pass of bf16 calls with the kernel's AMX tiles taking calls of ``tiles_from`` rows or
    more, calls of up to ``exact_rows`` rows in exact integer products before them."""
    lib.tiles_from, lib.exact_rows = tiles_from, exact_rows
    try:
        for p, t, n, k in mats:
            lib.linear_bf16(xb[k], p, t, n, None)
    finally:
        lib.tiles_from = lib.exact_rows = None


def as_served(kw: dict) -> None:
    """The kernel's process-wide settings as a worker with these settings makes them (several
    ``LLM`` in one process share the quantized kernel, and the last one prepared set them)."""
    lib = Q.kernel()
    if lib is not None:
        lib.exact_rows = 0 if kw.get("deterministic") else None


def linear_pass(rows: int, repeats: int) -> dict:
    """µs per model pass and GB/s of weights, per layout, alternated over two rounds."""
    torch.manual_seed(0)
    shapes = SHAPES * NUM_LAYERS + [HEAD]
    xs = {k: torch.randn(rows, k) for k in (576, 1536)}
    cases = {}
    lib = Q.kernel()
    native_bf16 = lib.bf16_simd and "avx512_bf16" in cpu_info().flags
    xb = {k: x.bfloat16() for k, x in xs.items()}
    for name, types in (("Q4_1 (Q8_0 head)", (Q.Q4_1, Q.Q8_0)), ("Q8_0", (Q.Q8_0, Q.Q8_0))):
        mats = []
        for i, (n, k) in enumerate(shapes):
            btype = types[1] if i == len(shapes) - 1 else types[0]
            weight = torch.randn(n, k) * 0.05
            if btype is Q.Q8_0:
                blocks = Q.quantize_q8_0(weight)
            else:
                import gguf

                blocks = torch.from_numpy(gguf.quants.quantize(weight.numpy(), gguf.GGMLQuantizationType.Q4_1))
            mats.append((Q.pack_blocks(blocks, btype, n, k), btype, n, k))
        nbytes = sum(p.numel() for p, *_ in mats)
        cases[f"{name} fp32"] = (lambda mats=mats: [lib.linear(xs[k], p, t, n, None) for p, t, n, k in mats], nbytes)
        cases[f"{name} int8 act."] = (lambda mats=mats: [lib.linear_i8(xs[k], p, t, n, None) for p, t, n, k in mats],
                                      nbytes)
        if native_bf16:
            cases[f"{name} bf16"] = (lambda mats=mats: [lib.linear_bf16(xb[k], p, t, n, None) for p, t, n, k in mats],
                                     nbytes)
        if native_bf16 and lib.bf16_amx:  # each path alone: every call on the dot products, the tiles, exact
            cases[f"{name} bf16 dot products"] = (
                lambda mats=mats: on_path(lib, mats, xb, tiles_from=1 << 62, exact_rows=0), nbytes)
            cases[f"{name} bf16 tiles"] = (lambda mats=mats: on_path(lib, mats, xb, tiles_from=1, exact_rows=0), nbytes)
            cases[f"{name} bf16 exact"] = (
                lambda mats=mats: on_path(lib, mats, xb, tiles_from=1, exact_rows=1 << 62), nbytes)
    kern = linear_kernel()
    if kern is not None and "avx512_bf16" in cpu_info().flags:
        packs = [(kern.pack_pairs(torch.randn(n, k).bfloat16()), n, k) for n, k in shapes]
        cases["bf16 pairs"] = (lambda: [kern.linear_pairs(xb[k], p, n, None) for p, n, k in packs],
                               sum(p.numel() * 4 for p, *_ in packs))
    if mkldnn_linear_available():
        mods = [(PackedLinear(torch.randn(n, k), None), k) for n, k in shapes]
        cases["fp32 oneDNN"] = (lambda: [m(xs[k]) for m, k in mods], sum(n * k * 4 for n, k in shapes))
    best = {name: float("inf") for name in cases}
    for _ in range(3):
        for name, (fn, _) in cases.items():
            best[name] = min(best[name], best_us(fn, repeats, 1))
    return {name: {"us": round(best[name], 1), "weight_bytes": nbytes, "gb_per_s": round(nbytes / best[name] / 1e3, 1)}
            for name, (_, nbytes) in cases.items()}


def decode_rates(rounds: int, new_tokens: int, threads: int | None) -> dict:
    """One-stream decode tok/s of the embedded model, per serving, alternated."""
    from pagewire import LLM
    from pagewire_common.sampling import SamplingParams

    llms = {name: LLM(num_threads=threads, **kw) for name, kw in SERVINGS.items()}
    many = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    rates = {name: [] for name in llms}
    for name, llm in llms.items():  # warm up
        llm.generate(PROMPTS[0], many)
    for _ in range(rounds):
        for name, llm in llms.items():
            as_served(SERVINGS[name])
            start = time.perf_counter()
            llm.generate(PROMPTS[0], many)
            rates[name].append(round(new_tokens / (time.perf_counter() - start), 1))
    for llm in llms.values():
        llm.close()
    return rates


def streams_rates(rounds: int, streams: int, new_tokens: int, threads: int | None) -> dict:
    """Offline tok/s with ``streams`` prompts at once, per serving, alternated."""
    from pagewire import LLM
    from pagewire_common.sampling import SamplingParams

    servings = {name: kw for name, kw in SERVINGS.items() if name != "dequantized fp32"}
    llms = {name: LLM(enable_prefix_caching=False, num_threads=threads, **kw) for name, kw in servings.items()}
    prompts = [f"Question {i}: what do you know about the number {i * 7 + 3}?" for i in range(streams)]
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    rates = {name: [] for name in llms}
    for llm in llms.values():
        llm.generate(prompts[:4], params)
    for _ in range(rounds):
        for name, llm in llms.items():
            as_served(servings[name])
            start = time.perf_counter()
            llm.generate(prompts, params)
            rates[name].append(round(streams * new_tokens / (time.perf_counter() - start), 1))
    for llm in llms.values():
        llm.close()
    return rates


def agreement(new_tokens: int) -> dict:
    """Greedy tokens of the quantized model (and the dequantized bf16 one) against the dequantized
    fp32 model, per prompt."""
    from pagewire import LLM
    from pagewire_common.sampling import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    outputs = {}
    for name, kw in (("fp32 dequantized", {"gguf_weights": "dequantize", "dtype": "float32"}),
                     ("quantized fp32", {"gguf_weights": "quantized", "dtype": "float32"}),
                     ("quantized, --dtype auto", {"gguf_weights": "quantized"}),
                     ("quantized, --dtype auto, one prompt at a time", {"gguf_weights": "quantized"}),
                     ("quantized, --deterministic", {"gguf_weights": "quantized", "deterministic": True}),
                     ("quantized, --int8-activations", {"gguf_weights": "quantized", "int8_activations": True}),
                     ("dequantized bf16", {"gguf_weights": "dequantize", "dtype": "bfloat16"})):
        with LLM(**kw) as llm:
            if "one prompt at a time" in name:  # decode steps of one row (exact integer products on AMX)
                outputs[name] = [llm.generate(prompt, params)[0].token_ids for prompt in PROMPTS]
            else:  # five rows a step
                outputs[name] = [o.token_ids for o in llm.generate(PROMPTS, params)]
    reference = outputs.pop("fp32 dequantized")

    def compare(tokens: list[list[int]], reference: list[list[int]]) -> dict:
        same = sum(a == b for ours, ref in zip(tokens, reference) for a, b in zip(ours, ref))
        first = [next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), None) for ours, ref in zip(tokens, reference)]
        return {"identical_share": round(same / sum(map(len, reference)), 4), "first_difference": first}

    result = {name: compare(tokens, reference) for name, tokens in outputs.items()}
    # bf16 against bf16: the same weights and sums on the tiles or dot products (--deterministic, or rows a step past
    # the exact integer path), the exact weights and sums of few rows on AMX
    for name in ("quantized, --dtype auto", "quantized, --dtype auto, one prompt at a time",
                 "quantized, --deterministic"):
        result[f"{name}, against dequantized bf16"] = compare(outputs[name], outputs["dequantized bf16"])
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,8,32", help="rows of the linear passes (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3, help="alternated decode rounds (default: %(default)s)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, help="CPU threads (default: torch's, one per core)")
    parser.add_argument("--streams", type=int, default=32, help="prompts at once in the throughput part")
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: linears,decode,streams,agreement")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    if args.threads:
        torch.set_num_threads(args.threads)
    cpu = cpu_info()
    result = {"environment": {"cpu_model": cpu.model, "cpu_family": cpu.family, "cpu_isa": cpu.isa,
                              "cpu_isa_flags": cpu.isa_flags, "threads": args.threads or torch.get_num_threads(),
                              "load_average_at_start": list(os.getloadavg()),
                              "torch": torch.__version__, "python": platform.python_version()},
              "command": " ".join(sys.argv)}
    if "linears" not in skip:
        result["linear_pass"] = {int(r): linear_pass(int(r), args.repeats) for r in args.rows.split(",")}
        for rows, cases in result["linear_pass"].items():
            for name, figures in cases.items():
                print(f"{rows:>4} rows  {name:<24} {figures['us']:>10.0f} us  {figures['gb_per_s']:>6.1f} GB/s", flush=True)
    if "decode" not in skip:
        result["one_stream_decode_tok_s"] = decode_rates(args.rounds, args.new_tokens, args.threads)
        for name, rates in result["one_stream_decode_tok_s"].items():
            print(f"decode {name}: {rates} tok/s", flush=True)
    if "streams" not in skip:
        result[f"offline_{args.streams}_streams_tok_s"] = rates = streams_rates(args.rounds, args.streams, 64, args.threads)
        for name, figures in rates.items():
            print(f"{args.streams} streams {name}: {figures} tok/s", flush=True)
    if "agreement" not in skip:
        result["greedy_agreement_vs_fp32"] = agreement(args.new_tokens)
        print("agreement", result["greedy_agreement_vs_fp32"], flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
