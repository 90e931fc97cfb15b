"""The fused CPU kernels (worker_svc/cpu/fused.py) against their torch references, and a
model switched to them against the same model on torch operators, in float32 and bfloat16. The
bf16 kernels are vectorized where the kernels were built with AVX-512 BF16 and portable loops
elsewhere: each host checks the one it has."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker_svc.cpu import build
from worker_svc.cpu import fused as cpu_fused
from worker_svc.cpu import sampler as cpu_sampler
from worker_svc.cpu.fused import rms_norm_ref, silu_mul_ref, use_fused_cpu_kernels
from worker_svc.layers.activation import ActAndMul
from worker_svc.layers.norms import RMSNorm

pytestmark = pytest.mark.skipif(build.compiler() is None, reason="no C compiler on PATH")


@pytest.fixture(scope="module")
def lib() -> cpu_fused.FusedKernels:
    built = cpu_fused.kernel()
    assert built is not None, "the fused CPU kernels did not build (see the log)"
    return built


@pytest.fixture(scope="module")
def sampler_lib(lib) -> cpu_sampler.SamplerKernels:
    """The sampler's argmax and draw, built into the same library, vectorized or not."""
    return cpu_sampler.SamplerKernels(cpu_fused.library())


# rows x width: one row, widths that are and are not multiples of 8, SmolLM2's, and a prefill-sized
# step (split over threads)
SIZES = [(1, 1), (1, 7), (3, 8), (5, 77), (32, 576), (513, 1536)]


@pytest.mark.parametrize("rows, width", SIZES)
def test_rms_norm_matches_reference(lib, rows, width):
    gen = torch.Generator().manual_seed(rows + width)
    x = torch.randn(rows, width, generator=gen) * 3
    weight = torch.randn(width, generator=gen)
    # the same operations per element; only the sum of squares is added up in another order
    torch.testing.assert_close(lib.rms_norm(x, weight, 1e-5), rms_norm_ref(x, weight, 1e-5), atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("rows, width", SIZES)
@pytest.mark.parametrize("scale", [1.0, 30.0])
def test_silu_mul_matches_reference(lib, rows, width, scale):
    gen = torch.Generator().manual_seed(rows * width)
    gate_up = torch.randn(rows, 2 * width, generator=gen) * scale
    # exp from a polynomial: within a few ulp of torch's
    torch.testing.assert_close(lib.silu_mul(gate_up), silu_mul_ref(gate_up), atol=1e-6 * scale, rtol=1e-6)


def test_silu_mul_at_the_extremes(lib):
    gate = torch.tensor([-1e4, -100.0, -88.0, -87.0, -20.0, -1e-30, 0.0, 1e-30, 20.0, 88.0, 89.0, 1e4, float("inf")])
    out = lib.silu_mul(torch.cat([gate, torch.full_like(gate, 2.0)]).view(1, -1))
    expected = F.silu(gate) * 2
    torch.testing.assert_close(out[0], expected, atol=1e-30, rtol=1e-6)
    assert out[0, -1] == float("inf") and (out[0, :4] <= 0).all()
    assert torch.equal(out[0, :2], torch.zeros(2)) and torch.signbit(out[0, :2]).all()  # -0.0, as torch's


@pytest.mark.parametrize("num_tokens, q_heads, k_heads, head_dim", [(1, 9, 3, 64), (7, 4, 4, 6), (33, 2, 1, 34)])
def test_rotary_is_bit_equal_to_apply_rotary(lib, num_tokens, q_heads, k_heads, head_dim):
    from worker_svc.layers.rotary import RotaryEmbedding, apply_rotary

    gen = torch.Generator().manual_seed(num_tokens)
    rope = RotaryEmbedding(head_dim, 512, 10000.0, None)
    cos, sin = rope(torch.randint(0, 512, (num_tokens,), generator=gen), torch.float32)
    # q and k as the attention layer has them: views into one fused projection's rows
    qkv = torch.randn(num_tokens, (q_heads + 2 * k_heads) * head_dim, generator=gen) * 4
    q, k, _ = qkv.split([q_heads * head_dim, k_heads * head_dim, k_heads * head_dim], dim=-1)
    q, k = q.view(num_tokens, q_heads, head_dim), k.view(num_tokens, k_heads, head_dim)
    expected_q, expected_k, v_before = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), qkv[:, -k_heads * head_dim:].clone()
    assert lib.rotary(q, k, cos, sin)
    assert torch.equal(q, expected_q) and torch.equal(k, expected_k)
    assert torch.equal(qkv[:, -k_heads * head_dim:], v_before)  # v untouched


def test_rotary_declines_layouts_it_does_not_take(lib):
    cos, sin = torch.ones(2, 1, 4), torch.zeros(2, 1, 4)
    q = torch.randn(2, 3, 8)
    assert not lib.rotary(q.double(), q.double(), cos.double(), sin.double())
    assert not lib.rotary(q.transpose(0, 1).contiguous().transpose(0, 1), q, cos, sin)  # heads not in rows
    assert not lib.rotary(q, q, torch.ones(2, 1, 3), torch.ones(2, 1, 3))


def test_takes_strided_and_batched_inputs_and_refuses_others(lib):
    gen = torch.Generator().manual_seed(1)
    wide = torch.randn(6, 40, generator=gen)
    x = wide[:, :20]  # rows 40 apart
    weight = torch.randn(20, generator=gen)
    torch.testing.assert_close(lib.rms_norm(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6), atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(lib.silu_mul(wide.view(2, 3, 40)), silu_mul_ref(wide).view(2, 3, 20), atol=1e-6, rtol=1e-6)
    assert lib.silu_mul(torch.empty(0, 8)).shape == (0, 4)
    with pytest.raises(ValueError, match="float32 or bfloat16 CPU tensors"):
        lib.rms_norm(x.double(), weight, 1e-6)
    with pytest.raises(ValueError, match="does not fit"):
        lib.rms_norm(x, torch.randn(21), 1e-6)
    with pytest.raises(ValueError, match="odd width"):
        lib.silu_mul(torch.randn(2, 7))


@pytest.mark.parametrize("kind", ["llama_gqa_tied", "llama_bias_llama3_rope"])
def test_model_on_fused_kernels_keeps_its_logits(kind, tmp_path):
    from tests.test_models import PagedRunner, hf_tiny, prompts
    from worker_svc.weights import load_model

    _, model_dir = hf_tiny(kind, tmp_path)
    model, config = load_model(model_dir, torch.float32, "cpu")
    batch = [[(i, p) for i, p in enumerate(prompts(seed=2))]]
    expected = torch.cat(PagedRunner(model, config, seed=3).step(batch[0]))
    switched = use_fused_cpu_kernels(model)
    assert switched == 4 * config.num_layers + 1  # two norms, the attention and the MLP per layer, the final norm
    assert all(m.cpu_kernels is not None for m in model.modules() if isinstance(m, (RMSNorm, ActAndMul)))
    torch.testing.assert_close(torch.cat(PagedRunner(model, config, seed=3).step(batch[0])), expected, atol=1e-5, rtol=1e-5)


def assert_within_a_bf16_step(out: torch.Tensor, expected: torch.Tensor) -> None:
    """bf16 results that round the same fp32 values, but for sums added in another order or an exp
    a few fp32 ulp off: mostly equal, never more than one bf16 step apart; below 2^-126, where
    AVX-512 BF16's conversion flushes to zero, zero instead of a subnormal."""
    assert out.dtype == expected.dtype == torch.bfloat16 and out.shape == expected.shape
    step = 2.0 ** (torch.floor(torch.log2(expected.float().abs().clamp_min(2.0**-126))) - 7)
    assert ((out.float() - expected.float()).abs() <= step.clamp_min(2.0**-126)).all()
    assert (out == expected).float().mean() >= 0.95


@pytest.mark.parametrize("rows, width", SIZES)
def test_bf16_rms_norm_rounds_as_the_torch_layer(lib, rows, width):
    gen = torch.Generator().manual_seed(rows + width)
    x = (torch.randn(rows, width, generator=gen) * 3).bfloat16()
    norm = RMSNorm(width, 1e-5).bfloat16()  # the torch path: normalize in fp32, round, scale in bf16
    with torch.no_grad():
        norm.weight.copy_(torch.randn(width, generator=gen))
    assert_within_a_bf16_step(lib.rms_norm(x, norm.weight.data, 1e-5), norm(x))


@pytest.mark.parametrize("rows, width", SIZES)
@pytest.mark.parametrize("scale", [1.0, 30.0])
def test_bf16_silu_mul_rounds_as_torch(lib, rows, width, scale):
    gen = torch.Generator().manual_seed(rows * width)
    gate_up = (torch.randn(rows, 2 * width, generator=gen) * scale).bfloat16()
    assert_within_a_bf16_step(lib.silu_mul(gate_up), silu_mul_ref(gate_up))


@pytest.mark.parametrize("num_tokens, q_heads, k_heads, head_dim", [(1, 9, 3, 64), (7, 4, 4, 6), (33, 2, 1, 34)])
def test_bf16_rotary_is_bit_equal_to_apply_rotary(lib, num_tokens, q_heads, k_heads, head_dim):
    from worker_svc.layers.rotary import RotaryEmbedding, apply_rotary

    gen = torch.Generator().manual_seed(num_tokens)
    rope = RotaryEmbedding(head_dim, 512, 10000.0, None)
    cos, sin = rope(torch.randint(0, 512, (num_tokens,), generator=gen), torch.bfloat16)
    qkv = (torch.randn(num_tokens, (q_heads + 2 * k_heads) * head_dim, generator=gen) * 4).bfloat16()
    q, k, _ = qkv.split([q_heads * head_dim, k_heads * head_dim, k_heads * head_dim], dim=-1)
    q, k = q.view(num_tokens, q_heads, head_dim), k.view(num_tokens, k_heads, head_dim)
    expected_q, expected_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    assert lib.rotary(q, k, cos, sin)
    assert torch.equal(q, expected_q) and torch.equal(k, expected_k)
    # one dtype for all four, or nothing done
    assert not lib.rotary(q, k, cos.float(), sin.float())


@pytest.mark.parametrize("kind", ["llama_gqa_tied", "llama_bias_llama3_rope"])
def test_bf16_model_on_fused_kernels_keeps_its_logits(kind, tmp_path, lib, monkeypatch):
    from tests.test_models import PagedRunner, hf_tiny, prompts
    from worker_svc.weights import load_model

    _, model_dir = hf_tiny(kind, tmp_path)
    model, config = load_model(model_dir, torch.bfloat16, "cpu")
    batch = [(i, p) for i, p in enumerate(prompts(seed=2))]
    expected = torch.cat(PagedRunner(model, config, seed=3).step(batch)).float()
    monkeypatch.setattr(lib, "bf16_simd", True)  # where they are portable loops, switch to them all the same
    switched = use_fused_cpu_kernels(model, torch.bfloat16)
    assert switched == 4 * config.num_layers + 1
    got = torch.cat(PagedRunner(model, config, seed=3).step(batch)).float()
    # the same roundings, a bf16 step apart here and there, carried through the layers
    torch.testing.assert_close(got, expected, atol=2.0**-5 * expected.abs().max().item(), rtol=0)


def test_kernels_are_used_only_for_the_dtype_they_are_vectorized_for(tmp_path, lib, monkeypatch):
    from tests.test_models import hf_tiny
    from worker_svc.weights import load_model

    _, model_dir = hf_tiny("llama_gqa_tied", tmp_path)
    model, _ = load_model(model_dir, torch.bfloat16, "cpu")
    monkeypatch.setattr(lib, "bf16_simd", False)
    assert use_fused_cpu_kernels(model, torch.bfloat16) == 0
    assert use_fused_cpu_kernels(model, torch.float16) == 0
    assert use_fused_cpu_kernels(model, torch.float32) == 0 or lib.simd  # no fp32 norms in a bf16 model
    assert not any(m.cpu_kernels is not None for m in model.modules() if isinstance(m, RMSNorm))


@pytest.mark.parametrize("width", [1, 7, 8, 31, 32, 33, 100, 49152])
def test_argmax_is_torchs_first_maximum(sampler_lib, width):
    gen = torch.Generator().manual_seed(width)
    rows = torch.randn(6, width, generator=gen)
    rows[1] = 0.25  # all equal: the first
    rows[2, width // 2:] = rows[2].max() + 1  # a tie far from the start: its first
    rows[3] = torch.round(rows[3])  # many ties among the largest
    rows[4] = float("-inf")
    rows[5, -1] = rows[5].max() + 1  # the last element, in the scalar tail
    assert torch.equal(sampler_lib.argmax(rows), rows.argmax(dim=-1))
    wide = torch.randn(6, width + 5, generator=gen)
    assert torch.equal(sampler_lib.argmax(wide[:, 3:3 + width]), wide[:, 3:3 + width].argmax(dim=-1))  # strided rows


@pytest.mark.parametrize("where", [0, 5, 40, 99])
def test_argmax_takes_the_first_nan_as_torch_does(sampler_lib, where):
    row = torch.randn(100, generator=torch.Generator().manual_seed(where))
    row[where] = float("nan")
    row[min(where + 7, 99)] = float("nan")
    row[50] = float("inf")
    assert sampler_lib.argmax(row.view(1, -1)).item() == row.argmax().item() == where


def test_argmax_refuses_what_it_does_not_take(sampler_lib):
    with pytest.raises(ValueError, match="float32 logits"):
        sampler_lib.argmax(torch.randn(2, 8).bfloat16())
    with pytest.raises(ValueError, match="V > 0"):
        sampler_lib.argmax(torch.empty(2, 0))
    assert sampler_lib.argmax(torch.empty(0, 8)).shape == (0,)


def test_the_cpu_sampler_takes_the_c_argmax_where_it_is_vectorized(lib):
    from pagewire_common.sampling import SamplingParams
    from worker_svc.sampler import Sampler, SamplingBatch

    sampler = Sampler("cpu")
    assert (sampler._cpu is not None) == lib.simd == (cpu_sampler.kernel() is not None)
    logits = torch.randn(5, 1000, generator=torch.Generator().manual_seed(9))
    logits[2, 10] = logits[2, 600] = logits[2].max() + 1
    tokens, _ = sampler(logits, SamplingBatch([SamplingParams(temperature=0)] * 5, [0] * 5, want_logprobs=False))
    assert torch.equal(tokens, logits.argmax(dim=-1)) and tokens[2] == 10


def assert_draws_invert_the_cdf(tokens: torch.Tensor, scaled: torch.Tensor, u: torch.Tensor) -> None:
    """Each token's interval of the cumulative distribution (in fp64) holds u, up to fp32 rounding
    of the sums, and has a nonzero probability."""
    probs = torch.softmax(scaled.double(), dim=-1)
    cdf = probs.cumsum(dim=-1)
    for row, token in enumerate(tokens.tolist()):
        assert probs[row, token] > 0, (row, token)
        low = cdf[row, token - 1].item() if token else 0.0
        assert low - 1e-5 <= u[row].item() <= cdf[row, token].item() + 1e-5, (row, token, low, u[row].item())


@pytest.mark.parametrize("width", [1, 5, 64, 100, 49152])
def test_draw_inverts_each_rows_cdf(sampler_lib, width):
    gen = torch.Generator().manual_seed(width)
    logits = torch.randn(9, width, generator=gen) * 3
    logits[1, ::3] = float("-inf")  # masked tokens: never drawn
    logits[1, min(1, width - 1)] = 0.0
    u = torch.rand(9, 1, generator=gen)
    u[2], u[3] = 0.0, 1.0 - 2.0**-24  # the first token with a probability, the last one
    temps = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.5, 2.0, 1e-3, 0.7, 1.3])
    draws = ((sampler_lib.draw(logits, u), logits), (sampler_lib.draw(logits, u, temps), logits / temps.unsqueeze(1)))
    for tokens, scaled in draws:
        assert_draws_invert_the_cdf(tokens, scaled, u[:, 0])
    assert sampler_lib.draw(logits[:, :width], u).shape == (9,)


def test_draw_leaves_rows_with_a_nan_or_nothing_finite_to_the_caller(sampler_lib):
    logits = torch.randn(3, 70)
    logits[0, 40] = float("nan")
    logits[1] = float("-inf")
    assert sampler_lib.draw(logits, torch.full((3, 1), 0.5)).tolist()[:2] == [-1, -1]
    with pytest.raises(ValueError, match="uniforms"):
        sampler_lib.draw(logits, torch.rand(2, 1))


def test_the_cpu_sampler_draws_with_the_c_kernel_and_torch_for_what_it_leaves(lib, monkeypatch):
    from pagewire_common.sampling import SamplingParams
    from worker_svc.sampler import Sampler, SamplingBatch

    sampler = Sampler("cpu")
    if sampler._cpu is None:
        pytest.skip("the fused kernels are not vectorized here: the sampler keeps torch's operators")
    logits = torch.randn(4, 500, generator=torch.Generator().manual_seed(4))
    logits[3, 7] = float("nan")
    params = [SamplingParams(temperature=t, seed=i) for i, t in enumerate((1.0, 0.5, 2.0, 1.0))]
    batch = SamplingBatch(params, [3] * 4, want_logprobs=False)
    tokens, _ = sampler(logits, batch)
    u = sampler._uniforms(batch, 4, torch.float32)  # seeded rows: the same uniforms again
    temps = torch.tensor([p.temperature for p in params])
    assert_draws_invert_the_cdf(tokens[:3], logits[:3] / temps[:3].unsqueeze(1), u[:3, 0])
    monkeypatch.setattr(sampler, "_cpu", None)  # torch's operators, for the NaN row too
    assert sampler(logits, batch)[0][3] == tokens[3]
