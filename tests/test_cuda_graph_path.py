"""The CUDA-graph decode path (padded static buffers), run eagerly on CPU.

Capture itself needs a GPU; everything it replays — padding rows that write nowhere (slot -1),
static block tables, attention launched with host sizes fixed at capture — runs here with the
Triton kernels under TRITON_INTERPRET=1, in a subprocess so the interpreter setting stays there.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap

import pytest

from tests.service_utils import REPO

# find_spec, not import: importing triton here would stop test_triton_kernels from switching on
# its interpreter (TRITON_INTERPRET must be set before triton's first import in the process)
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

SCRIPT = textwrap.dedent(
    """
    import os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["PAGEWIRE_ATTENTION_BACKEND"] = "triton"
    import torch
    torch.set_num_threads(1)
    from pagewire import LLM, SamplingParams
    from worker_svc.cuda_graphs import DecodeGraphs, batch_ladder
    from tests.tiny_models import get_tiny_model

    assert batch_ladder(6) == [1, 2, 4, 6] and batch_ladder(256)[-1] == 256
    llm = LLM(get_tiny_model("llama-gqa"), block_size=16, num_kv_blocks=64, enable_prefix_caching=False)
    prompts = [[5, 6, 7, 8, 9], list(range(20, 37)), [42]]
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    eager = [o.token_ids for o in llm.generate(prompts, sp)]
    runner = llm.runner
    graphs = DecodeGraphs(runner.model, runner.kv_cache, 4, runner.max_model_len,
                          runner.block_tables.max_blocks_per_seq, runner.device, capture=False)
    runner.decode_graphs = graphs
    padded = [o.token_ids for o in llm.generate(prompts, sp)]
    assert graphs.num_replays == 4, graphs.num_replays  # every decode step after the prefill
    assert padded == eager, (padded, eager)
    # the padding row wrote nothing: its slot stayed -1 and the cache is unchanged by it
    assert graphs.slot_mapping[3].item() == -1
    print("ok", eager)
    """
)


@pytest.mark.slow
def test_padded_decode_graph_path_matches_eager():
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "ok" in out.stdout
