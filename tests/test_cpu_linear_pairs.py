"""The CPU linear kernel's bf16-pair layout (worker_svc/cpu/linear.py, ``PairLinear``): a
bf16 model's linears on CPUs with AVX-512 BF16 dot products or AMX tiles, bf16 in and out with
fp32 sums. Where the kernel was built without AVX-512 BF16 the same layout runs a portable loop, so
every host checks the packing, the blocking and the rounding; an AVX-512 BF16 host checks the dot
products, and a host with AMX (Intel Xeon, Sapphire Rapids on) the tiles as well: the tile path's
cases are skipped only where the CPU has no AMX or Linux does not grant its tiles."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.test_cpu_linear import SHAPES
from tests.test_dtypes import AMX, AVX2, AVX512_BF16, ZEN4
from worker_svc.cpu import build, features
from worker_svc.cpu import linear as cpu_linear
from worker_svc.cpu.linear import PackedLinear, PairLinear, pack_linears_for_cpu, pair_rows

pytestmark = pytest.mark.skipif(build.compiler() is None, reason="no C compiler on PATH")


@pytest.fixture(scope="module")
def lib() -> cpu_linear.LinearKernel:
    built = cpu_linear.kernel()
    assert built is not None, "the CPU linear kernel did not build (see the log)"
    return built


@pytest.fixture(params=["vectors", "tiles"])
def path(request, lib, monkeypatch) -> str:
    """Each case on both paths of the pair layout: vector dot products (or the portable loop), and
    AMX tiles where this CPU has them."""
    if request.param == "tiles" and not lib.pairs_amx:
        pytest.skip("this CPU has no AMX tiles (or Linux does not grant them)")
    monkeypatch.setattr(lib, "pairs_amx", request.param == "tiles")
    return request.param


def bits(values: torch.Tensor) -> torch.Tensor:
    return values.to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF


def test_pair_layout_puts_two_inputs_in_each_lane(lib):
    # 2 panels (the second 4 columns wide), 3 pairs (the last half empty), zero pairs up to 16
    weight = torch.randn(20, 5)
    packed = lib.pack_pairs(weight)
    assert packed.shape == (2, 16, 16) and packed.dtype == torch.int32
    assert [pair_rows(k) for k in (1, 2, 32, 33, 576, 1000)] == [16, 16, 16, 32, 288, 512]
    lanes = packed.to(torch.int64) & 0xFFFFFFFF
    w = bits(weight)
    for p in range(2):
        for q in range(16):
            for j in range(16):
                col = 16 * p + j
                lo = w[col, 2 * q].item() if col < 20 and 2 * q < 5 else 0
                hi = w[col, 2 * q + 1].item() if col < 20 and 2 * q + 1 < 5 else 0
                assert lanes[p, q, j].item() == lo | hi << 16, (p, q, j)


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Exact products of the bf16 inputs, summed in fp64, plus the fp32 bias."""
    out = x.double() @ weight.to(torch.bfloat16).double().T
    return out if bias is None else out + bias.double()


def assert_rounded_close(out: torch.Tensor, expected: torch.Tensor, in_features: int) -> None:
    """``out`` is bf16: the fp32 sum rounded once, so within half a bf16 step (2^-9 relative) of the
    exact sum, plus the fp32 sums' own error, which cancellation can leave large next to a small
    output: K * 2^-24 of the summed magnitudes, bounded here by the largest output's."""
    assert out.dtype == torch.bfloat16
    scale = expected.abs().max().item()
    torch.testing.assert_close(out.double(), expected, rtol=2.0**-8, atol=in_features * 2.0**-22 * scale + 1e-30)


# and 300 rows of 2000 inputs: two chunks of rows on the tiles, the second an odd number of 16
@pytest.mark.parametrize("rows, out_features, in_features", [*SHAPES, (300, 40, 2000)])
@pytest.mark.parametrize("bias", [False, True])
def test_pair_kernel_matches_exact_sums(lib, path, rows, out_features, in_features, bias):
    gen = torch.Generator().manual_seed(rows * 5 + in_features)
    weight = torch.randn(out_features, in_features, generator=gen) * 0.05
    b = torch.randn(out_features, generator=gen) if bias else None
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    out = lib.linear_pairs(x, lib.pack_pairs(weight), out_features, b)
    assert out.shape == (rows, out_features)
    assert_rounded_close(out, reference(x, weight, b), in_features)


def test_pair_module_takes_strided_3d_and_empty_inputs(lib, path):
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(40, 24, generator=gen).bfloat16()
    bias = torch.randn(40, generator=gen).bfloat16()
    layer = PairLinear(weight, bias, lib)
    wide = torch.randn(9, 48, generator=gen).bfloat16()
    shifted = torch.randn(9 * 24 + 1, generator=gen).bfloat16()[1:].view(9, 24)  # contiguous, 2-byte aligned
    # rows 48 apart; an odd start; columns 2 apart; a contiguous view whose pairs are not 4-byte aligned
    for x in (wide[:, :24], wide[:, 1:25], wide[:, ::2], shifted):
        expected = reference(x, weight, bias.float())
        assert_rounded_close(layer(x), expected, 24)
        assert_rounded_close(layer(x.reshape(3, 3, 24)).reshape(9, 40), expected, 24)
    assert_rounded_close(layer(wide[:, :24].float()), reference(wide[:, :24], weight, bias.float()), 24)
    assert layer(torch.empty(0, 24, dtype=torch.bfloat16)).shape == (0, 40)
    with pytest.raises(ValueError, match="does not fit"):
        layer(torch.randn(2, 26).bfloat16())
    with pytest.raises(ValueError, match="bfloat16 CPU inputs"):
        lib.linear_pairs(torch.randn(2, 24), layer.packed_weight, 40, None)


def test_the_pair_kernel_rounds_to_nearest_even(lib, path):
    # one input: each output is w * 1.0 + bias exactly in fp32, then rounded to bf16 as torch rounds
    gen = torch.Generator().manual_seed(2)
    bias = torch.randn(64, generator=gen)
    weight = torch.randn(64, 1, generator=gen).bfloat16()
    x = torch.ones(3, 1, dtype=torch.bfloat16)
    out = lib.linear_pairs(x, lib.pack_pairs(weight), 64, bias)
    expected = (weight.float().T + bias).to(torch.bfloat16).expand(3, 64)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("cpu, pairs_simd, pairs_amx, layer_type, used", [
    (ZEN4, True, False, PairLinear, "C kernel, bf16 weights, AVX-512 BF16 dot products (avx512_bf16)"),
    (AVX512_BF16, True, False, PairLinear, "C kernel, bf16 weights, AVX-512 BF16 dot products (avx512_bf16)"),
    (AMX, True, True, PairLinear, "C kernel, bf16 weights, AMX tiles (amx_bf16)"),
    # AMX without the tiles granted: oneDNN, not the dot products, which run at half rate there
    (AMX, True, False, PackedLinear, "oneDNN, prepacked bf16 weights (amx_bf16)"),
    # a kernel built without AVX-512 BF16 is only the portable loop
    (ZEN4, False, False, PackedLinear, "oneDNN, prepacked bf16 weights (avx512_bf16)"),
])
def test_a_bf16_model_on_a_native_bf16_cpu_gets_the_pair_kernel_where_it_wins(
        tiny_model_dir, lib, monkeypatch, cpu, pairs_simd, pairs_amx, layer_type, used):
    from worker_svc.weights import load_model

    if layer_type is PackedLinear and not cpu_linear.mkldnn_linear_available(torch.bfloat16):
        pytest.skip("torch's oneDNN packs no bf16 weights on this CPU (it needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT)")
    monkeypatch.setattr(features, "cpu_info", lambda: cpu)
    # on other hosts, the portable loop stands in for the dot products, and the vector path (or
    # that loop) for the tiles: linear_bf16_pairs_amx falls back to it where AMX is not granted
    monkeypatch.setattr(lib, "pairs_simd", pairs_simd)
    monkeypatch.setattr(lib, "pairs_amx", pairs_amx)
    model_dir = tiny_model_dir("qwen2-bias")  # biases, and a tied head packed on its own
    model, config = load_model(model_dir, torch.bfloat16, "cpu")
    hidden = torch.randn(5, config.hidden_size, generator=torch.Generator().manual_seed(3)).bfloat16()
    before = model.compute_logits(hidden).float()
    assert pack_linears_for_cpu(model) == used
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert sum(isinstance(m, layer_type) for m in model.modules()) == 4 * config.num_layers + 1
    after = model.compute_logits(hidden).float()
    # torch's bf16 matmul and the kernel both sum in fp32 and round once: within a bf16 step or two
    torch.testing.assert_close(after, before, atol=2.0**-6 * before.abs().max().item(), rtol=0)


def test_the_pairs_run_on_amx_tiles_where_granted_and_dot_products_where_there_is_no_amx(lib, monkeypatch):
    monkeypatch.setattr(lib, "pairs_simd", True)
    monkeypatch.setattr(lib, "pairs_amx", True)
    assert cpu_linear.pair_instructions(AMX, lib) == "AMX tiles"
    assert cpu_linear.pair_instructions(ZEN4, lib) == "AVX-512 BF16 dot products"
    assert cpu_linear.pair_instructions(AVX2, lib) is None
    monkeypatch.setattr(lib, "pairs_amx", False)
    assert cpu_linear.pair_instructions(AMX, lib) is None
    monkeypatch.setattr(lib, "pairs_simd", False)
    assert cpu_linear.pair_instructions(ZEN4, lib) is None


@pytest.mark.parametrize("in_features", [576, 100], ids=["rows-in-place", "rows-padded"])
def test_a_row_gets_the_same_bits_alone_and_in_any_batch(lib, path, in_features):
    """By default every call goes on the tiles where the CPU has them (x read in place up to 16 rows
    when the inputs fill whole tiles, copied with zeros past them otherwise; more rows copied into
    whole tiles), all with the same tiles in the same order: a row's bits do not depend on its batch.
    The dot products (and the portable loop) are invariant too."""
    assert lib.tiles_from == 1  # csrc/linear.c's default
    torch.manual_seed(in_features)
    out_features = 1536
    pairs = lib.pack_pairs(torch.randn(out_features, in_features) * 0.05)
    bias = torch.randn(out_features)
    x = torch.randn(80, in_features).bfloat16()
    full = lib.linear_pairs(x, pairs, out_features, bias)
    for m in (1, 2, 3, 16, 17, 33):
        assert torch.equal(lib.linear_pairs(x[:m], pairs, out_features, bias), full[:m]), m
    alone = torch.cat([lib.linear_pairs(x[r : r + 1], pairs, out_features, bias) for r in range(80)])
    assert torch.equal(alone, full)
    # rows 2 x in_features apart (every other row), read in place where the inputs fill whole tiles
    assert torch.equal(lib.linear_pairs(x[::2][:16], pairs, out_features, bias), full[::2][:16])
    if path == "tiles" and in_features == 576:  # the dot products at one row (tiles_from 2) round
        try:  # apart in about 1 output in 10^4 (10 here): the default matters
            lib.tiles_from = 2
            dots = torch.cat([lib.linear_pairs(x[r : r + 1], pairs, out_features, bias) for r in range(80)])
        finally:
            lib.tiles_from = None
        assert not torch.equal(dots, full)
