"""The CPU linears (worker_svc/cpu/linear.py): the C kernel with fp32 and bf16 weights
against its torch reference, oneDNN-prepacked layers against nn.Linear, and which of the two a
model gets on each kind of CPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.test_dtypes import AVX2, AVX512_BF16, ZEN4
from worker_svc.cpu import build, features
from worker_svc.cpu import linear as cpu_linear
from worker_svc.cpu.linear import KernelLinear, PackedLinear, linear_ref, pack_linears_for_cpu

needs_compiler = pytest.mark.skipif(build.compiler() is None, reason="no C compiler on PATH")
needs_onednn = pytest.mark.skipif(not cpu_linear.mkldnn_linear_available(), reason="oneDNN not available")


@pytest.fixture(scope="module")
def lib() -> cpu_linear.LinearKernel:
    built = cpu_linear.kernel()
    assert built is not None, "the CPU linear kernel did not build (see the log)"
    return built


# (rows, out_features, in_features): one row, rows not a multiple of the 6-row block (and 32, split
# into blocks of 6 and 5), outputs not a multiple of the 16-column panel, odd and tiny K, SmolLM2's
# shapes, and K large enough that the rows split into several chunks (at most 256 KiB of x each)
SHAPES = [(1, 1, 1), (1, 17, 3), (5, 16, 8), (7, 49, 95), (13, 200, 96), (6, 33, 64), (32, 960, 576),
          (64, 576, 1536), (1, 3072, 576), (70, 40, 2000), (131, 23, 1200)]


@needs_compiler
@pytest.mark.parametrize("rows, out_features, in_features", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_reference(lib, rows, out_features, in_features, bias, weight_dtype):
    gen = torch.Generator().manual_seed(rows * 7 + out_features)
    weight = (torch.randn(out_features, in_features, generator=gen) * 0.05).to(weight_dtype)
    b = torch.randn(out_features, generator=gen) if bias else None
    x = torch.randn(rows, in_features, generator=gen)
    out = lib.linear(x, lib.pack(weight, weight_dtype), out_features, b)
    # both fp32 products and sums, in different orders
    torch.testing.assert_close(out, linear_ref(x, weight, b), atol=1e-5 * in_features**0.5, rtol=1e-5)


@needs_compiler
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_module_takes_strided_and_3d_inputs_and_no_rows(lib, weight_dtype):
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(40, 24, generator=gen).to(weight_dtype)
    bias = torch.randn(40, generator=gen).to(weight_dtype)
    layer = KernelLinear(weight, bias, lib, weight_dtype)
    wide = torch.randn(9, 48, generator=gen)
    x = wide[:, ::2]  # rows 48 apart, columns 2 apart
    expected = linear_ref(x, weight, bias)
    torch.testing.assert_close(layer(x), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(layer(x.reshape(3, 3, 24)), expected.view(3, 3, 40), atol=1e-5, rtol=1e-5)
    assert layer(torch.empty(0, 24)).shape == (0, 40)
    assert layer.packed_weight.dtype == weight_dtype and layer.packed_weight.numel() == 48 * 24  # 3 panels
    with pytest.raises(ValueError, match="does not fit"):
        layer(torch.randn(2, 23))


@needs_compiler
def test_kernel_refuses_other_weight_dtypes_and_inputs(lib):
    with pytest.raises(ValueError, match="float32 or bfloat16 weights"):
        lib.pack(torch.randn(4, 4), torch.float16)
    packed = lib.pack(torch.randn(4, 4))
    with pytest.raises(ValueError, match="float32 CPU inputs"):
        lib.linear(torch.randn(2, 4, dtype=torch.float64), packed, 4, None)


@needs_onednn
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


@pytest.mark.parametrize("cpu, layer_type, used", [
    pytest.param(AVX2, KernelLinear, "C kernel, fp32 weights (avx2)", marks=needs_compiler),
    pytest.param(AVX512_BF16, PackedLinear, "oneDNN, prepacked fp32 weights (avx512_bf16)", marks=needs_onednn),
    # Zen 4's AVX-512 is half width: the C kernel keeps fp32 linears there
    pytest.param(ZEN4, KernelLinear, "C kernel, fp32 weights (avx512_bf16)", marks=needs_compiler),
])
def test_pack_model_replaces_linears_and_keeps_logits(tiny_model_dir, monkeypatch, cpu, layer_type, used):
    from worker_svc.weights import load_model

    monkeypatch.setattr(features, "cpu_info", lambda: cpu)
    model_dir = tiny_model_dir("qwen2-bias")  # tied embeddings: the lm_head is packed separately
    model, config = load_model(model_dir, torch.float32, "cpu")
    hidden = torch.randn(5, config.hidden_size)
    before = model.compute_logits(hidden)
    assert pack_linears_for_cpu(model) == used
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert sum(isinstance(m, layer_type) for m in model.modules()) == 4 * config.num_layers + 1
    torch.testing.assert_close(model.compute_logits(hidden), before, rtol=1e-5, atol=1e-5)


def test_without_a_compiler_fp32_linears_go_to_onednn(tiny_model_dir, monkeypatch):
    from worker_svc.weights import load_model

    if not cpu_linear.mkldnn_linear_available():
        pytest.skip("oneDNN not available")
    monkeypatch.setattr(features, "cpu_info", lambda: AVX2)
    monkeypatch.setattr(cpu_linear, "kernel", lambda: None)
    model, _ = load_model(tiny_model_dir("qwen2-bias"), torch.float32, "cpu")
    assert pack_linears_for_cpu(model) == "oneDNN, prepacked fp32 weights (avx2)"
    assert any(isinstance(m, PackedLinear) for m in model.modules())
