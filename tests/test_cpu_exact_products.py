"""Quantized bf16 linears of few rows in exact integer products (``csrc/quant.c``: x split into
three int8 digits per block, ``QuantKernel.exact_rows``; the default where the AMX tiles are
granted, forced here on any CPU whose build has the path): the outputs against the exact product
rounded to bf16, the edge cases of the digits, and ``--deterministic``, which keeps every call on
the tiles, on a model served from its GGUF blocks."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("gguf")

from kvcache import paged
from pagewire import LLM
from pagewire_common.sampling import SamplingParams
from tests.test_cpu_quantized import MIXED, TYPES, quantized_blocks, write_gguf_model
from tests.tiny_models import sample_prompts
from worker_svc.cpu import attention
from worker_svc.cpu import quantized as Q


@pytest.fixture
def exact_path(bf16_lib):
    """The bf16 kernel with calls of up to 4 rows in exact integer products (the default where the
    AMX tiles are granted; forced here on any CPU whose build has the path), defaults restored."""
    bf16_lib.exact_rows = 4
    if bf16_lib.exact_rows != 4:
        pytest.skip("this build of the kernel has no exact integer path (it needs AVX-512 VNNI and VBMI)")
    yield bf16_lib
    bf16_lib.exact_rows = None


def test_exact_rows_default_to_four_where_the_tiles_are_granted(bf16_lib):
    bf16_lib.exact_rows = None
    assert bf16_lib.exact_rows == (4 if bf16_lib.bf16_amx else 0)
    with pytest.raises(ValueError, match="at least 0"):
        bf16_lib.exact_rows = -1


def _near_a_bf16_tie(exact: torch.Tensor, magnitude: torch.Tensor, blocks: int) -> torch.Tensor:
    """Where a float64 value lies closer to a midpoint between two bf16 values (where rounding to
    bf16 flips) than an fp32 sum of ``blocks`` blocks' terms of total ``magnitude`` may stray: one
    rounding per block's sum and one per fma into the output, 2^-24 of the magnitude each."""
    e = torch.frexp(exact.abs().clamp_min(1e-300))[1].double()  # |v| in [2^(e-1), 2^e)
    step = torch.ldexp(torch.ones_like(e), (e - 8).int())  # bf16 keeps 8 significant bits
    distance = (torch.remainder(exact.abs() / step, 1.0) - 0.5).abs() * step
    return distance <= (2 * blocks + 2) * 2.0**-24 * magnitude


def _on_block_scales(x: torch.Tensor) -> torch.Tensor:
    """bf16 x [M, K] as the exact integer path sees it (float64): each block of 32 rounded to the
    nearest even multiple of its scale, 2^(E - 147) for E the largest biased exponent in the block
    (csrc/quant.c): unchanged but for values more than 13 binades below the block's largest."""
    m, k = x.shape
    blocks = x.view(torch.int16).view(m, k // 32, 32).int() & 0xFFFF
    e = ((blocks >> 7) & 0xFF).amax(-1, keepdim=True).clamp_min(1)  # bf16 subnormals: exact on 2^-146
    scale = torch.ldexp(torch.ones_like(e, dtype=torch.float64), e - 147)
    values = x.double().view(m, k // 32, 32)
    return (torch.round(values / scale) * scale).view(m, k)


@pytest.mark.parametrize("btype,qtype", TYPES, ids=lambda t: getattr(t, "name", ""))
@pytest.mark.parametrize("n,k", [(37, 64), (200, 96), (1536, 576)])
def test_calls_of_few_rows_are_the_exact_products_rounded_to_bf16(exact_path, btype, qtype, n, k):
    """x split into three int8 digits per block multiplies the quants in integers, so each block's
    sum is exact and rounded once: the outputs are the exact product (the dequantized fp32 weights,
    the bf16 inputs on their blocks' scales, float64 sums) rounded to bf16, but for values within
    fp32 rounding of a bf16 midpoint; the tiles, which round the weights to bf16 first, miss about
    a third of them."""
    lib = exact_path
    torch.manual_seed(n + k + 2)
    packed = Q.pack_blocks(quantized_blocks(torch.randn(n, k), qtype), btype, n, k)
    weight = Q.dequantize_ref(packed, btype, n, k).double()
    bias = torch.randn(n)
    x = torch.randn(9, k).bfloat16()
    x[0, :32] *= 2.0**-20  # a block whose values are all small
    x[1, 5] = 3000.0  # a block wider than 13 binades: its smallest values round to the scale's integers
    scaled = _on_block_scales(x)
    assert torch.equal(scaled[0], x[0].double()) and not torch.equal(scaled[1], x[1].double())
    exact = scaled @ weight.T + bias.double()
    lib.exact_rows = 9  # two passes of 4 rows and one of 1
    y = lib.linear_bf16(x, packed, btype, n, bias)
    lib.exact_rows = 4
    near_a_tie = _near_a_bf16_tie(exact, scaled.abs() @ weight.T.abs() + bias.double().abs(), k // 32)
    assert near_a_tie.float().mean() < 0.05  # the check is not empty
    assert ((y == exact.float().bfloat16()) | near_a_tie).all()
    lib.exact_rows = 0
    tiles = lib.linear_bf16(x, packed, btype, n, bias)
    lib.exact_rows = 4
    assert (tiles != exact.float().bfloat16()).float().mean() > 0.15
    # a row's bits do not depend on the rows beside it, up to exact_rows; x read at a stride, no
    # bias, into a view of wider rows
    for m in (1, 2, 3, 4):
        assert torch.equal(lib.linear_bf16(x[:m], packed, btype, n, bias), y[:m])
    for r in range(9):
        assert torch.equal(lib.linear_bf16(x[r : r + 1], packed, btype, n, bias)[0], y[r])
    wide = torch.randn(4, 2 * k).bfloat16()
    wide[:, :k] = x[:4]
    plain = lib.linear_bf16(x[:4], packed, btype, n, None)
    out = torch.zeros(4, n + 8, dtype=torch.bfloat16)
    lib.linear_bf16(wide[:, :k], packed, btype, n, None, out=out[:, :n])
    assert torch.equal(out[:, :n], plain) and not out[:, n:].any()


@pytest.mark.parametrize("btype,qtype", TYPES, ids=lambda t: getattr(t, "name", ""))
def test_exact_products_of_zero_tiny_and_non_finite_blocks(exact_path, btype, qtype):
    """A block of zeros adds nothing; blocks of tiny values, whose largest exponent is 20 (its digits
    made one value at a time) or 21 (the vector path's smallest), and values below 2^-110, still
    count exactly; an infinity or NaN in a block makes the outputs NaN, as any multiply would."""
    lib = exact_path
    n, k = 40, 96
    torch.manual_seed(11)
    packed = Q.pack_blocks(quantized_blocks(torch.randn(n, k), qtype), btype, n, k)
    weight = Q.dequantize_ref(packed, btype, n, k).double()
    x = torch.randn(5, k).clamp(-1.9, 1.9).bfloat16()
    x[0, :32] = 0.0
    x[1] = x[1] * 2.0**-110
    for row, exponent in ((2, 20), (3, 21)):  # biased exponents: 1.5 * 2^(e - 127) is a block's largest
        x[row] = (x[row].float() * 2.0 ** (exponent - 128)).bfloat16()
        x[row, ::32] = 1.5 * 2.0 ** (exponent - 127)
    assert ((x[2:4].view(torch.int16).int() >> 7) & 0xFF).amax(-1).tolist() == [20, 21]
    scaled = _on_block_scales(x)
    exact = scaled @ weight.T
    y = lib.linear_bf16(x[:4], packed, btype, n, None)
    near_a_tie = _near_a_bf16_tie(exact[:4], scaled[:4].abs() @ weight.T.abs(), k // 32)
    assert ((y == exact[:4].float().bfloat16()) | near_a_tie).all()
    assert (y[1:4] != 0).any(dim=1).all()  # the tiny rows count
    # one block of bf16 subnormals (exponent 0), zeros elsewhere: exact on the scale 2^-146; the
    # outputs that are normal fp32 numbers (bf16 rounding flushes the others) are the exact ones
    sub = torch.zeros(1, k)
    sub[0, :32] = torch.empty(32).uniform_(0.5, 0.99) * torch.randn(32).sign() * 2.0**-126
    sub = sub.bfloat16()
    assert ((sub.view(torch.int16).int() >> 7) & 0xFF).max() == 0 and sub.any()
    exact = sub.double() @ weight.T
    tiny = lib.linear_bf16(sub, packed, btype, n, None)
    normal = exact.abs() > 2.0**-125
    assert normal.sum() > 5 and torch.allclose(tiny.double()[normal], exact[normal], rtol=2**-7, atol=0)
    x[4, 40] = float("inf")
    assert torch.isnan(lib.linear_bf16(x[4:], packed, btype, n, None)).all()
    x[4, 40] = float("nan")
    assert torch.isnan(lib.linear_bf16(x[4:], packed, btype, n, None)).all()


def test_seeded_tokens_of_a_quantized_bf16_model_alone_batched_and_after_a_hit(bf16_lib, tiny_model_dir, tmp_path):
    """--deterministic on a model served from its blocks in bf16: a seeded request alone, after a
    prefix hit and batched with 16 others gets the same tokens and logprobs (its calls alone would
    take the exact integer products by default where the tiles are granted, and the tiles batched)."""
    source = tiny_model_dir("llama-gqa")
    model_dir, _ = write_gguf_model(source, tmp_path / "converted", tied=False, types=MIXED)
    prompts = sample_prompts(source, lengths=[60] + [8 + 3 * i for i in range(16)], seed=5)
    seeded = SamplingParams(temperature=0.8, seed=11, max_tokens=24, ignore_eos=True, logprobs=True)
    common = {"dtype": "bfloat16", "block_size": 16, "num_kv_blocks": 256, "gguf_weights": "quantized",
              "deterministic": True}
    try:
        with LLM(model_dir, **common) as llm:
            assert bf16_lib.exact_rows == 0
            alone = llm.generate([prompts[0]], seeded)[0]
            again = llm.generate([prompts[0]], seeded)[0]
        assert again.usage.cached_prompt_tokens == 48
        assert (again.token_ids, again.logprobs) == (alone.token_ids, alone.logprobs)
        others = [SamplingParams(temperature=0.9, seed=i, max_tokens=24) for i in range(16)]
        with LLM(model_dir, enable_prefix_caching=False, **common) as llm:
            batched = llm.generate(prompts, [seeded, *others])[0]
        assert (batched.token_ids, batched.logprobs) == (alone.token_ids, alone.logprobs)
    finally:  # as a worker without --deterministic sets them
        paged.use_cpu_attention(attention.kernel)
        bf16_lib.exact_rows = None
