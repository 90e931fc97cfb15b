"""Offline throughput: pagewire's LLM.generate beside transformers' generate, same process. Feeds
docs/benchmarks.md, section "Offline, in one process".

    python benchmarks/offline_throughput.py [--model PATH] [--dtype float32|bfloat16]
        [--gguf-weights auto|dequantize] [--num-prompts 32] [--max-tokens 64] [--repeats 2]

Both generate exactly --max-tokens tokens per prompt (ours with ignore_eos, transformers with
min_new_tokens, which masks EOS), greedy, from the same prompts. transformers runs all prompts
as one left-padded batch. Prints completion tokens/s for each and the ratio.
"""

from __future__ import annotations

import argparse
import json
import time

from pagewire_common.settings import GGUF_WEIGHTS
from worker_svc.cpu import features  # torch-free

features.cap_torch_isa()  # PAGEWIRE_CPU_ISA reaches torch and oneDNN only if set before torch is imported
import torch  # noqa: E402

PROMPT_TEXTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Photosynthesis is the process by which plants",
    "The three primary colors are",
    "In 1969, Neil Armstrong became",
    "Write a haiku about autumn leaves.",
    "The quick brown fox jumps over",
    "To make a good cup of tea, first",
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model dir or .gguf (default: embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--gguf-weights", default="auto", choices=GGUF_WEIGHTS,
                    help="a GGUF model's weights, as serve's flag: its own blocks (auto, on CPU) or the converted "
                    "copy (dequantize), which transformers runs too (default: %(default)s)")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2, help="timed runs of each (best is reported)")
    ap.add_argument("--json", default=None, help="write results here")
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    from pagewire import LLM, SamplingParams
    from pagewire.bench.report import environment
    from worker_svc.weights import resolve_model_path

    model_dir = resolve_model_path(args.model)
    llm = LLM(model_dir, dtype=args.dtype, gguf_weights=args.gguf_weights, max_num_seqs=args.num_prompts,
              enable_prefix_caching=False)
    tok = llm.tokenizer
    # distinct prompts of ~8-20 tokens: a text with a numbered suffix
    prompts = [tok.encode(f"{PROMPT_TEXTS[i % len(PROMPT_TEXTS)]} ({i})") for i in range(args.num_prompts)]
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)

    llm.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    ours = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp)
        ours.append(time.perf_counter() - t0)
        assert sum(len(o.token_ids) for o in outs) == args.num_prompts * args.max_tokens

    dtype = getattr(torch, args.dtype)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    pad = llm.engine.worker_info.eos_token_ids[0]
    width = max(map(len, prompts))
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        hf.generate(input_ids[:4], attention_mask=mask[:4], max_new_tokens=4, do_sample=False, pad_token_id=pad)
    theirs = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(
                input_ids, attention_mask=mask, max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens,
                do_sample=False, pad_token_id=pad,
            )
        theirs.append(time.perf_counter() - t0)
        assert out.shape[1] - width == args.max_tokens

    n = args.num_prompts * args.max_tokens
    result = {
        "model": model_dir.name,
        "dtype": args.dtype,
        "num_prompts": args.num_prompts,
        "max_tokens": args.max_tokens,
        "pagewire_tokens_per_s": n / min(ours),
        "transformers_generate_tokens_per_s": n / min(theirs),
        "ratio": min(theirs) / min(ours),
        "pagewire_seconds": ours,
        "transformers_seconds": theirs,
        "threads": torch.get_num_threads(),
        "environment": environment(),  # versions, CPU model, ISA and cores
    }
    print(
        f"{model_dir.name} {args.dtype}, {args.num_prompts} prompts x {args.max_tokens} tokens: "
        f"pagewire {result['pagewire_tokens_per_s']:.1f} tok/s, transformers generate "
        f"{result['transformers_generate_tokens_per_s']:.1f} tok/s, ratio {result['ratio']:.2f}x"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
