"""Tensor parallelism on CPU: what a step costs with one rank and with two, and how much of it the
collectives take. Feeds docs/benchmarks.md, section "6. Tensor parallelism on CPU".

    python benchmarks/tp_collectives_cpu.py [--model PATH] [--sizes 1,2] [--batch 32]
        [--prompt-len 16] [--max-tokens 64] [--dtype float32] [--json out.json]

Without --model it builds, in a temporary directory, a Llama with SmolLM2-135M's shape (hidden 576,
30 layers, intermediate 1536, vocabulary 49152) but 8 query heads of 72 and 2 KV heads, since
SmolLM2's 9 heads do not split over 2 ranks; its weights are random (the cost of a step does not
depend on them; every run generates exactly --max-tokens with ignore_eos). For each size N the
offline engine (this process is rank 0, ranks 1..N-1 are its children, gloo over loopback) runs
one warm-up and one timed batch of --batch prompts. Rank 0 times every step and, inside it, each
torch.distributed call by kind: all_reduce (one per row-parallel layer, two per decoder layer,
and the embedding's), gather (the logits of the rows that sample) and broadcast (the plan hand-off),
plus the plan's serialization. A collective's time on rank 0 includes waiting for the slower
rank. The ranks on one machine share its cores (each takes cores / N threads).
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import tempfile
import time
from pathlib import Path


def build_model(out: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=8,
        num_key_value_heads=2, head_dim=72, max_position_embeddings=2048, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)  # no tokenizer: the prompts are token ids
    return out


class Timers:
    """Wall time of each step and of the calls made inside it, on this process (rank 0)."""

    def __init__(self):
        self.steps: list[float] = []
        self.calls: list[dict[str, list[float]]] = []
        self._current: dict[str, list[float]] | None = None

    def wrap(self, owner, name: str, label: str) -> None:
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                if self._current is not None:
                    self._current[label].append(time.perf_counter() - t0)

        setattr(owner, name, timed)

    def wrap_step(self, runner) -> None:
        original = runner.execute

        def step(plan):
            if plan.is_empty:  # only drops (the last plan of a batch): no model step
                return original(plan)
            self._current = collections.defaultdict(list)
            t0 = time.perf_counter()
            try:
                return original(plan)
            finally:
                self.steps.append(time.perf_counter() - t0)
                self.calls.append(self._current)
                self._current = None

        runner.execute = step


def run(model_dir: Path, size: int, args) -> dict:
    import torch.distributed as dist

    from pagewire import LLM, SamplingParams
    from pagewire_common import wire

    timers = Timers()
    for name in ("all_reduce", "gather", "broadcast"):
        timers.wrap(dist, name, name)
    timers.wrap(wire, "plan_to_pb", "serialize plan")
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    prompts = [[100 + (i * 7 + j) % 5000 for j in range(args.prompt_len)] for i in range(args.batch)]
    with LLM(model_dir, tensor_parallel_size=size, dtype=args.dtype, max_num_seqs=args.batch,
             enable_prefix_caching=False) as llm:
        llm.generate(prompts, sp)  # warm-up
        timers.wrap_step(llm.runner)  # the engine's executor
        t0 = time.perf_counter()
        llm.generate(prompts, sp)
        elapsed = time.perf_counter() - t0
    decode = range(1, len(timers.steps))  # the first step is the prefill
    per_step = {
        label: 1e3 * statistics.fmean(sum(timers.calls[i].get(label, [0.0])) for i in decode)
        for label in ("all_reduce", "gather", "broadcast", "serialize plan")
    }
    counts = {label: statistics.fmean(len(timers.calls[i].get(label, [])) for i in decode)
              for label in ("all_reduce", "gather", "broadcast")}
    step_ms = 1e3 * statistics.fmean(timers.steps[i] for i in decode)
    return dict(
        ranks=size, steps=len(timers.steps), tokens_per_s=args.batch * args.max_tokens / elapsed,
        decode_step_ms=step_ms, decode_step_ms_median=1e3 * statistics.median(timers.steps[i] for i in decode),
        prefill_step_ms=1e3 * timers.steps[0], collectives_ms_per_step=per_step, calls_per_step=counts,
        rest_ms_per_step=step_ms - sum(v for k, v in per_step.items()),
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model directory (default: a random SmolLM2-shaped Llama with 8 heads)")
    ap.add_argument("--sizes", default="1,2", help="tensor-parallel sizes to run, in order (default: %(default)s)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()

    from pagewire.bench.report import environment

    with tempfile.TemporaryDirectory(prefix="pagewire-tp-bench-") as tmp:
        model_dir = Path(args.model) if args.model else build_model(Path(tmp) / "llama-576x30-8h")
        results = [run(model_dir, int(n), args) for n in args.sizes.split(",")]
    print(f"{'ranks':>5} {'tok/s':>8} {'decode step':>12} {'all_reduce':>16} {'gather':>8} {'hand-off':>14} "
          f"{'serialize':>9} {'rest':>8}")
    for r in results:
        c, n = r["collectives_ms_per_step"], r["calls_per_step"]
        print(f"{r['ranks']:>5} {r['tokens_per_s']:>8.1f} {r['decode_step_ms']:>9.2f} ms "
              f"{c['all_reduce']:>7.2f} ms ({n['all_reduce']:>3.0f}) {c['gather']:>5.2f} ms "
              f"{c['broadcast']:>5.2f} ms ({n['broadcast']:.0f}) {c['serialize plan']:>6.2f} ms {r['rest_ms_per_step']:>5.2f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps({"environment": environment(), "args": vars(args), "results": results},
                                              indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
