"""``kvcache.triton_attention.warm_up``: every attention kernel a model's steps launch is compiled
before the first step, so that no step waits for Triton's compiler.

Two checks, each in a subprocess (the interpreter setting must be made before triton's first import):

- the launches' compile keys: with the kernels' launches recorded instead of run, Triton's own
  binder for an sm_90 target (the one ``JITFunction.run`` keys its cache by; no GPU needed) gives
  the key of every launch; the keys of steps of every shape the worker makes (decodes of any batch
  and context, prefill chunks, mixed batches, any key split, graph-sized static buffers, queries
  that are views of a fused qkv projection, lengths staged at the worker's offsets of one buffer:
  Triton keys pointers by their 16-byte alignment) must all be among the warm-up's.
- the warm-up's launches run: compiled on a CUDA device, under the interpreter on CPU.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.service_utils import REPO

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")


def run_script(script: str, interpret: bool) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0 and "ok" in out.stdout, out.stdout + out.stderr
    return out.stdout


KEYS_SCRIPT = textwrap.dedent(
    """
    import random
    import numpy as np
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature
    import kvcache.triton_attention as ta
    from kvcache.attention_metadata import AttentionMetadata
    from kvcache.paged import PagedKVCache

    backend = make_backend(GPUTarget("cuda", 90, 32))
    keys = []

    class Recorded:  # a kernel's launches recorded: the compile key Triton's binder gives each
        def __init__(self, kernel):
            self.binder = create_function_from_signature(kernel.signature, kernel.params, backend)
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                _, specialization, options = self.binder(*args, **kwargs)
                keys.append((self.binder, str(specialization), str(options)))
            return launch

    ta._paged_attention_kernel = Recorded(ta._paged_attention_kernel)
    ta._merge_splits_kernel = Recorded(ta._merge_splits_kernel)
    ta.check_device = lambda device: None
    ta._num_sms = lambda device: 132  # an H100's count: the key split a GPU would choose

    from worker_svc.step_io import HostToDevice, Section
    staging, staged = HostToDevice(torch.device("cpu")), torch.zeros(1 << 20, dtype=torch.uint8)

    def worker_launches(num_heads, kv_layer, rng, max_model_len):
        _, num_blocks, block_size, num_kv_heads, head_dim = kv_layer.shape
        max_blocks = -(-max_model_len // block_size)
        table = torch.randint(1, num_blocks, (300, max_blocks), dtype=torch.int32)  # the worker's rows
        for trial in range(60):
            graph = trial % 5 == 0  # a captured decode: static buffers, attention sized for the model length
            num_seqs = rng.choice([1, 2, 3, 16, 17, 64, 100, 256])
            decode = graph or trial % 2 == 0
            q_lens = [1 if decode else rng.choice([1, 1, 5, 16, 33, 200]) for _ in range(num_seqs)]
            seq_lens = [min(q + rng.choice([0, 7, 300, 1500, 3000]), max_model_len) for q in q_lens]
            q_lens = [min(q, s) for q, s in zip(q_lens, seq_lens)]
            num_cols = max(-(-s // block_size) for s in seq_lens)
            rows = torch.tensor(rng.sample(range(300), num_seqs))
            block_tables = table[:num_seqs] if graph else table.index_select(0, rows)[:, :num_cols]
            cu = [0]
            for q in q_lens:
                cu.append(cu[-1] + q)
            # the step's arrays as the worker stages them: views at its offsets of one buffer
            slots, query_start_loc, lens = staging.stage([
                Section(np.zeros(cu[-1], dtype=np.int64), torch.int64), Section(np.array(cu), torch.int32),
                Section(np.array(seq_lens), torch.int32)], dest=staged)
            meta = AttentionMetadata(
                slot_mapping=slots, query_start_loc=query_start_loc, seq_lens=lens,
                block_tables=block_tables, max_query_len=max(q_lens),
                max_seq_len=max_model_len if graph else max(seq_lens),
                query_lens_cpu=q_lens, seq_lens_cpu=seq_lens, logits_indices=torch.tensor(cu[1:]) - 1,
            )
            # the query as the model makes it: a view of the fused qkv projection's output
            qkv = torch.zeros((cu[-1], (num_heads + 2 * num_kv_heads) * head_dim), dtype=kv_layer.dtype)
            query = qkv[:, : num_heads * head_dim].view(cu[-1], num_heads, head_dim)
            ta.paged_attention_triton(query, kv_layer, meta, head_dim**-0.5)

    rng = random.Random(0)
    checked = 0
    for num_heads, num_kv_heads, dtype, block_size in [(9, 3, torch.bfloat16, 16), (32, 8, torch.bfloat16, 16),
                                                       (12, 12, torch.float16, 16), (4, 2, torch.float32, 8)]:
        cache = PagedKVCache(2, 800, block_size, num_kv_heads, 64, dtype, "cpu")
        keys.clear()
        ta.warm_up(num_heads, cache.layer(1))
        warm = set(keys)
        keys.clear()
        worker_launches(num_heads, cache.layer(0), rng, max_model_len=4096)
        new = set(keys) - warm
        assert not new, (num_heads, num_kv_heads, dtype, sorted(k[1] for k in new)[:2])
        checked += len(keys)
    print("ok", checked)
    """
)


RUN_SCRIPT = textwrap.dedent(
    """
    import torch
    from kvcache.paged import PagedKVCache
    from kvcache.triton_attention import warm_up
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # GQA in 16 bits adds the wide key tiles of long decodes: 8 launches, else 6
    assert warm_up(9, PagedKVCache(1, 64, 16, 3, 64, torch.bfloat16, device).layer(0)) == 8
    assert warm_up(4, PagedKVCache(1, 4, 16, 4, 64, torch.float32, device).layer(0)) == 6  # a small cache
    print("ok")
    """
)


def test_steps_of_every_shape_compile_nothing_after_the_warm_up():
    import triton

    if not (Path(triton.__file__).parent / "backends" / "nvidia").is_dir():
        pytest.skip("this triton has no NVIDIA backend to key the launches with")
    assert int(run_script(KEYS_SCRIPT, interpret=False).split()[-1]) > 200


def test_warm_up_launches_run():
    import torch

    run_script(RUN_SCRIPT, interpret=not torch.cuda.is_available())
