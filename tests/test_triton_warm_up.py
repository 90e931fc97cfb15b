"""``kvcache.triton_attention.warm_up``: every attention variant a model can launch is compiled before
the first step. On CPU the launches run under Triton's interpreter (nothing is compiled there, so
the count of variants is what is checked); on a CUDA device, after the warm-up, steps of every shape
(decodes of any batch, prefill chunks, mixed batches, any key split) compile nothing new.
Each case runs in a subprocess so that the interpreter setting stays there."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap

import pytest

from tests.service_utils import REPO

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

SCRIPT = textwrap.dedent(
    """
    import os, random, sys
    import torch
    on_cuda = torch.cuda.is_available()
    if not on_cuda:
        os.environ["TRITON_INTERPRET"] = "1"
    from kvcache.attention_metadata import AttentionMetadata
    from kvcache.triton_attention import _merge_splits_kernel, _paged_attention_kernel, paged_attention_triton, warm_up

    device = torch.device("cuda" if on_cuda else "cpu")
    # (heads, kv heads, dtype, variants): GQA in 16 bits adds the wide key tiles of long decodes
    cases = [(9, 3, torch.bfloat16, 8), (4, 4, torch.float32, 6)] if not on_cuda else \\
        [(9, 3, torch.bfloat16, 8), (32, 8, torch.bfloat16, 8), (12, 12, torch.float16, 6), (4, 2, torch.float32, 6)]

    def compiled():
        caches = [k.device_caches[torch.cuda.current_device()][0] for k in (_paged_attention_kernel, _merge_splits_kernel)]
        return sum(len(c) for c in caches)

    for num_heads, num_kv_heads, dtype, variants in cases:
        assert warm_up(num_heads, num_kv_heads, 64, 16, dtype, device) == variants, (num_heads, dtype)
        if not on_cuda:
            continue
        before = compiled()
        rng = random.Random(0)
        num_blocks = 4096
        kv = torch.randn((2, num_blocks, 16, num_kv_heads, 64), dtype=dtype, device=device)
        for trial in range(40):
            num_seqs = rng.choice([1, 2, 3, 16, 17, 64, 100])
            decode = trial % 2 == 0
            q_lens = [1 if decode else rng.choice([1, 5, 16, 33, 200]) for _ in range(num_seqs)]
            seq_lens = [q + rng.choice([0, 7, 300, 1500, 3000]) for q in q_lens]
            blocks = [(s + 15) // 16 for s in seq_lens]
            table = torch.zeros((num_seqs, max(blocks)), dtype=torch.int32)
            for i, n in enumerate(blocks):
                table[i, :n] = torch.randint(1, num_blocks, (n,))
            cu = [0]
            for q in q_lens:
                cu.append(cu[-1] + q)
            meta = AttentionMetadata(
                slot_mapping=torch.zeros(cu[-1], dtype=torch.int64, device=device),
                query_start_loc=torch.tensor(cu, dtype=torch.int32, device=device),
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
                block_tables=table.to(device), max_query_len=max(q_lens), max_seq_len=max(seq_lens),
                query_lens_cpu=q_lens, seq_lens_cpu=seq_lens,
                logits_indices=torch.tensor(cu[1:], device=device) - 1,
            )
            query = torch.randn((cu[-1], num_heads, 64), dtype=dtype, device=device)
            paged_attention_triton(query, kv, meta, 0.125)
        torch.cuda.synchronize()
        assert compiled() == before, (num_heads, dtype, before, compiled())
    print("ok", "cuda" if on_cuda else "cpu")
    """
)


def test_warm_up_compiles_every_variant():
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=600,
                         env={k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"})
    assert out.returncode == 0 and out.stdout.strip().startswith("ok"), out.stdout + out.stderr
