"""CPU paged attention: the C kernel (worker_svc/cpu/attention.py) beside the torch reference, one layer.
Feeds docs/benchmarks.md, section "CPU paged attention".

Decode batches with contexts drawn from a range (the reference pads them to the longest), and
single prefill chunks at a given depth (where the dispatch hands chunks longer than 32 queries
to SDPA). Each figure is the best of several timed loops; the cases alternate between the two
implementations so that the VM's drifting speed hits both alike.

    python benchmarks/cpu_attention.py                 # fp32 and bf16
    python benchmarks/cpu_attention.py --dtype bfloat16 --repeats 7
"""

from __future__ import annotations

import argparse
import random

from worker_svc.cpu import features  # torch-free

features.cap_torch_isa()  # PAGEWIRE_CPU_ISA reaches torch and oneDNN only if set before torch is imported
import torch  # noqa: E402

from kvcache.paged import AttentionMetadata, paged_attention_ref
from pagewire.bench.timing import best_us
from worker_svc.cpu.attention import kernel

BLOCK, KV_HEADS, GROUP, HEAD_DIM = 16, 3, 3, 64  # SmolLM2-135M's attention shape


def make_step(query_lens: list[int], seq_lens: list[int], dtype: torch.dtype, rng: random.Random):
    needed = [-(-s // BLOCK) for s in seq_lens]
    num_blocks = sum(needed) + 1
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    tables = torch.zeros((len(seq_lens), max(needed)), dtype=torch.int32)
    for i, n in enumerate(needed):
        tables[i, :n] = torch.tensor([free.pop() for _ in range(n)], dtype=torch.int32)
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(starts[-1], dtype=torch.int64),  # unused by attention
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=list(seq_lens),
        logits_indices=torch.zeros(0, dtype=torch.int64),
    )
    kv = torch.randn((2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM)).to(dtype)
    query = torch.randn((starts[-1], KV_HEADS * GROUP, HEAD_DIM)).to(dtype)
    return query, kv, meta


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "both"], default="both")
    parser.add_argument("--repeats", type=int, default=5, help="timed loops per case; the best counts")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    cpu = kernel()
    if cpu is None:
        raise SystemExit("the CPU kernel did not build (is a C compiler on PATH?)")
    dtypes = [torch.float32, torch.bfloat16] if args.dtype == "both" else [getattr(torch, args.dtype)]
    rng = random.Random(args.seed)
    cases = []
    for num_seqs, lo, hi in ((32, 16, 80), (8, 16, 576), (32, 16, 576), (64, 200, 600)):
        lens = [rng.randint(lo, hi) for _ in range(num_seqs)]
        cases.append((f"{num_seqs} decodes, context {lo}-{hi}", [1] * num_seqs, lens))
    for q_len, depth in ((4, 500), (16, 0), (32, 64), (32, 500), (128, 0), (128, 500), (512, 0)):
        cases.append((f"one {q_len}-token chunk at depth {depth}", [q_len], [depth + q_len]))
    print(f"threads {torch.get_num_threads()}, block {BLOCK}, {KV_HEADS * GROUP}/{KV_HEADS} heads, head_dim {HEAD_DIM}")
    print(f"{'dtype':9s} {'case':40s} {'torch ref (us)':>15s} {'C kernel (us)':>14s} {'speedup':>8s}")
    for dtype in dtypes:
        for name, query_lens, seq_lens in cases:
            query, kv, meta = make_step(query_lens, seq_lens, dtype, rng)
            scale = HEAD_DIM**-0.5
            ref = lambda: paged_attention_ref(query, kv, meta, scale)  # noqa: E731
            ker = lambda: cpu.paged_attention(query, kv, meta.query_start_loc, meta.seq_lens, meta.block_tables, scale)  # noqa: E731
            loops = max(5, int(20000 / max(50.0, best_us(ref, 1, loops=1))))
            ref_t, ker_t = float("inf"), float("inf")
            for _ in range(2):  # alternate
                ref_t = min(ref_t, best_us(ref, args.repeats, loops=loops))
                ker_t = min(ker_t, best_us(ker, args.repeats, loops=loops))
            print(f"{str(dtype).removeprefix('torch.'):9s} {name:40s} {ref_t:15.0f} {ker_t:14.0f} {ref_t / ker_t:7.2f}x")


if __name__ == "__main__":
    main()
