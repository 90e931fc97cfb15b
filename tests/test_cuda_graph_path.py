"""The CUDA-graph decode path (padded static buffers), run eagerly.

Capture itself needs a GPU; everything it replays — padding rows that write nowhere (slot -1),
static block tables, attention launched with host sizes fixed at capture, input ids taken from the
last step's tokens on the device when steps are launched ahead — runs through the Triton
kernels: compiled on a CUDA device where there is one, and where there is none on the CPU under
Triton's interpreter (TRITON_INTERPRET=1), in a subprocess so the interpreter setting stays there.
"""

from __future__ import annotations

import importlib.util
import os
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
    import torch
    # the interpreter only without a CUDA device (it runs programs in Python, on CPU tensors); it must
    # be on before triton's first import, which importing torch does not do
    on_cuda = torch.cuda.is_available()
    assert "triton" not in sys.modules and "TRITON_INTERPRET" not in os.environ
    if not on_cuda:
        os.environ["TRITON_INTERPRET"] = "1"
    os.environ["PAGEWIRE_ATTENTION_BACKEND"] = "triton"
    torch.set_num_threads(1)
    from pagewire import LLM, SamplingParams
    from worker_svc.cuda_graphs import DecodeGraphs, batch_ladder
    from tests.tiny_models import get_tiny_model

    assert batch_ladder(6) == [1, 2, 4, 6] and batch_ladder(256)[-1] == 256
    # no captured graphs of its own on a GPU: the reference is the eager step
    llm = LLM(get_tiny_model("llama-gqa"), block_size=16, num_kv_blocks=64, enable_prefix_caching=False,
              cuda_graphs=False)
    prompts = [[5, 6, 7, 8, 9], list(range(20, 37)), [42]]
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    eager = [o.token_ids for o in llm.generate(prompts, sp)]
    runner = llm.runner
    assert runner.device.type == ("cuda" if on_cuda else "cpu") and runner.decode_graphs is None
    from kvcache.triton_attention import _paged_attention_kernel
    interpreted = type(_paged_attention_kernel).__name__ == "InterpretedFunction"
    assert interpreted != on_cuda, type(_paged_attention_kernel)  # compiled kernels on the GPU
    graphs = DecodeGraphs(runner.model, runner.kv_cache, 4, runner.max_model_len,
                          runner.block_tables.max_blocks_per_seq, runner.device, capture=False)
    runner.decode_graphs = graphs
    padded = [o.token_ids for o in llm.generate(prompts, sp)]
    assert graphs.num_replays == 4, graphs.num_replays  # every decode step after the prefill
    assert padded == eager, (padded, eager)
    # the padding row wrote nothing: its slot stayed -1 and the cache is unchanged by it
    assert graphs.slot_mapping[3].item() == -1
    # launched ahead: each decode step's input ids come from the last step's tokens on the device,
    # copied into the graph's static ids
    runner.launch_ahead = True
    ahead = [o.token_ids for o in llm.generate(prompts, sp)]
    assert ahead == eager, (ahead, eager)
    assert graphs.num_replays == 8 and runner.num_steps_fed_from_device >= 3, runner.num_steps_fed_from_device
    print("ok", "cuda, compiled kernels" if on_cuda else "cpu, interpreted kernels", eager)
    """
)


@pytest.mark.slow
def test_padded_decode_graph_path_matches_eager():
    # the script switches the interpreter on itself, only where it needs it
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "ok" in out.stdout
