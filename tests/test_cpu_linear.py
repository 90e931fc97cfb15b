"""oneDNN-prepacked linear layers (the CPU fast path) compute what nn.Linear computes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from worker_svc.layers.cpu_linear import PackedLinear, pack_linears_for_cpu

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN not available")


@pytest.mark.parametrize("rows", [1, 7, 32, 130])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_linear(rows, bias):
    torch.manual_seed(rows)
    lin = nn.Linear(96, 200, bias=bias)
    x = torch.randn(rows, 96)
    packed = PackedLinear(lin.weight, lin.bias)
    torch.testing.assert_close(packed(x), lin(x), rtol=1e-5, atol=1e-5)
    # 3-D input keeps its leading dims
    torch.testing.assert_close(packed(x.view(1, rows, 96)), lin(x).view(1, rows, 200), rtol=1e-5, atol=1e-5)


def test_pack_model_replaces_linears_and_keeps_logits(tiny_model_dir):
    from kvcache.paged import AttentionMetadata, PagedKVCache  # noqa: F401
    from worker_svc.weights import load_model

    model_dir = tiny_model_dir("qwen2-bias")  # tied embeddings: the lm_head is packed separately
    model, config = load_model(model_dir, torch.float32, "cpu")
    hidden = torch.randn(5, config.hidden_size)
    before = model.compute_logits(hidden)
    n = pack_linears_for_cpu(model)
    assert n == 4 * config.num_layers + 1
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    torch.testing.assert_close(model.compute_logits(hidden), before, rtol=1e-5, atol=1e-5)
