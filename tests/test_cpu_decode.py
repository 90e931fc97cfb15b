"""The lean CPU pass for small steps of a model with quantized linears (``worker_svc/cpu/decode.py``):
every step it serves returns bit for bit what the modules return (decodes of one and of several
sequences, prefill chunks of up to 32 tokens), larger steps go to the modules, models it does not
serve are left alone; and the parts of a quantized linear merged into one kernel call
(``quantized.merge_parts``) compute what the parts compute."""

from __future__ import annotations

import pytest
import torch

gguf = pytest.importorskip("gguf")

from pagewire import LLM
from pagewire_common.sampling import SamplingParams
from tests.test_cpu_quantized import GGML, MIXED, quantized_blocks, write_gguf_model
from tests.tiny_models import sample_prompts
from worker_svc.cpu import decode
from worker_svc.cpu import fused as cpu_fused
from worker_svc.cpu import quantized as Q


def checked_forward(monkeypatch) -> list[int]:
    """Make every lean pass also run the modules on the same step and assert the same hidden states;
    returns the list of the step sizes checked."""
    checked: list[int] = []
    lean = decode.QuantDecode.forward

    def both(self, input_ids, positions, kv_cache, meta):
        fast = lean(self, input_ids, positions, kv_cache, meta)
        self.model.cpu_decode = None
        try:
            modules = self.model.forward(input_ids, positions, kv_cache, meta)
        finally:
            self.model.cpu_decode = self
        assert fast.dtype == modules.dtype and torch.equal(fast, modules)
        checked.append(int(input_ids.shape[0]))
        return fast

    monkeypatch.setattr(decode.QuantDecode, "forward", both)
    return checked


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8-activations"])
@pytest.mark.parametrize("kind,tied", [("llama-gqa", False), ("llama-gqa", True), ("qwen2-bias", True)],
                         ids=["gguf-untied", "gguf-tied", "int8-biases"])
def test_lean_pass_equals_the_modules(quant_lib, tiny_model_dir, tmp_path, monkeypatch, dtype, kind, tied):
    """Also with --int8-activations (fp32 arithmetic around int8 products): its tokens alone equal
    its tokens in a batch."""
    int8 = dtype == "int8-activations"
    dtype = "float32" if int8 else dtype
    if dtype == "bfloat16" and not Q.bf16_kernel_available():
        pytest.skip("bf16 compute needs the AVX-512 BF16 kernel (a bf16 model computes in fp32 here)")
    fused = cpu_fused.kernel()
    if fused is None or not (fused.bf16_simd if dtype == "bfloat16" else fused.simd):
        pytest.skip("the fused C norms are not vectorized for this dtype here, so the modules serve every step")
    source = tiny_model_dir(kind)
    if kind == "qwen2-bias":  # q/k/v biases: the checkpoint's linears quantized at load (--quantization int8)
        model_dir, served = source, {"quantization": "int8"}
    else:
        model_dir, _ = write_gguf_model(source, tmp_path / "converted", tied=tied, types=MIXED)
        served = {"gguf_weights": "quantized"}
    checked = checked_forward(monkeypatch)
    # lengths: a one-token prompt, chunks the lean pass serves (9, 17) and one it leaves to the modules (40)
    prompts = sample_prompts(source, n=4, lengths=(1, 9, 17, 40))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with LLM(model_dir, dtype=dtype, enable_prefix_caching=False, int8_activations=int8, **served) as llm:
        model = llm.runner.model
        assert isinstance(model.cpu_decode, decode.QuantDecode)
        assert model.model.layers[0].self_attn.qkv_proj.int8_activations == int8
        qkv = model.model.layers[0].self_attn.qkv_proj
        if kind == "qwen2-bias":
            assert qkv.bias is not None and [t.name for t in qkv.packed_types] == ["Q8_0"]
        else:
            assert [t.name for t in qkv.packed_types] == ["Q4_1", "Q8_0"]  # q and k in one call, v in another
        together = [out.token_ids for out in llm.generate(prompts, params)]
        alone = [llm.generate([p], params)[0].token_ids for p in prompts]
        model.cpu_decode = None
        assert [out.token_ids for out in llm.generate(prompts, params)] == together
    # in bf16 where the AMX tiles are granted a call of up to 4 rows takes exact integer products and
    # a larger one the tiles, so the one-token prompt's prefill alone and in the 67-token chunk round
    # apart (--deterministic keeps them together: tests/test_cpu_exact_products.py)
    if not (dtype == "bfloat16" and quant_lib.exact_rows):
        assert together == alone
    assert 1 in checked and 4 in checked and 9 in checked  # lone and batched decodes, a prefill chunk
    assert max(checked) <= decode.MAX_TOKENS


def test_models_it_does_not_serve_keep_the_modules(quant_lib, tiny_model_dir, tmp_path):
    model_dir, _ = write_gguf_model(tiny_model_dir("llama-gqa"), tmp_path / "converted", tied=True, types=MIXED)
    with LLM(model_dir, dtype="float32", gguf_weights="dequantize") as llm:
        assert llm.runner.model.cpu_decode is None  # dense linears
    with LLM(tiny_model_dir("qwen3"), dtype="float32", quantization="int8") as llm:
        assert llm.runner.model.cpu_decode is None  # per-head q/k norms


@pytest.fixture
def fp32_gguf_llm(quant_lib, tiny_model_dir, tmp_path):
    """An offline engine on the tiny Llama's GGUF, served from its blocks in fp32 (the lean pass on)."""
    fused = cpu_fused.kernel()
    if fused is None or not fused.simd:
        pytest.skip("the fused C norms are not vectorized for fp32 here")
    model_dir, _ = write_gguf_model(tiny_model_dir("llama-gqa"), tmp_path / "converted", tied=True, types=MIXED)
    with LLM(model_dir, dtype="float32", gguf_weights="quantized") as llm:
        yield llm


def test_lean_pass_takes_small_steps_only(fp32_gguf_llm):
    from kvcache.paged import PagedKVCache

    lean = fp32_gguf_llm.runner.model.cpu_decode

    class Meta:
        max_query_len = 1

    fp32 = PagedKVCache(2, 4, 16, 2, 16, torch.float32, "cpu")
    assert lean.accepts(1, fp32, Meta) and lean.accepts(decode.MAX_TOKENS, fp32, Meta)
    assert not lean.accepts(decode.MAX_TOKENS + 1, fp32, Meta)
    Meta.max_query_len = decode.MAX_QUERY_LEN + 1  # a chunk kvcache.paged sends to SDPA
    assert not lean.accepts(decode.MAX_QUERY_LEN + 1, fp32, Meta)
    Meta.max_query_len = 1
    assert not lean.accepts(1, PagedKVCache(2, 4, 16, 2, 16, torch.bfloat16, "cpu"), Meta)  # cache in another dtype


def test_lean_pass_refuses_a_slot_or_block_outside_the_cache(fp32_gguf_llm):
    """The C layer loop stops at the first kernel that refuses its input, and the pass says which."""
    from kvcache.attention_metadata import AttentionMetadata
    from kvcache.paged import PagedKVCache

    lean, config = fp32_gguf_llm.runner.model.cpu_decode, fp32_gguf_llm.runner.model_config
    cache = PagedKVCache(config.num_layers, 4, 4, config.num_kv_heads, config.head_dim, torch.float32, "cpu")

    def step(slot: int, block: int) -> None:
        meta = AttentionMetadata(slot_mapping=torch.tensor([slot]),
                                 query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
                                 seq_lens=torch.tensor([1], dtype=torch.int32),
                                 block_tables=torch.tensor([[block]], dtype=torch.int32), max_query_len=1,
                                 max_seq_len=1, query_lens_cpu=[1], seq_lens_cpu=[1],
                                 logits_indices=torch.tensor([0]))
        lean.forward(torch.tensor([3]), torch.tensor([0]), cache, meta)

    step(2, 0)  # inside: runs
    with pytest.raises(ValueError, match="CPU K/V append: a slot is outside the cache"):
        step(16, 0)  # 4 blocks of 4 slots
    with pytest.raises(ValueError, match="CPU paged attention: a block table entry is outside the cache"):
        step(2, 4)


def test_kv_write_equals_the_scatter_and_refuses_slots_outside_the_cache():
    from kvcache.paged import write_kv
    from worker_svc.cpu import attention

    kernel = attention.kernel()
    if kernel is None:
        pytest.skip("no C compiler")
    torch.manual_seed(0)
    kv, expected = torch.zeros(2, 3, 4, 2, 8), torch.zeros(2, 3, 4, 2, 8)  # [2, blocks, block_size, Hkv, D]
    rows = torch.randn(3, 40)  # k at columns [4, 20), v at [20, 36): strided views, as in a qkv output
    key, value = rows[:, 4:20].view(3, 2, 8), rows[:, 20:36].view(3, 2, 8)
    slots = torch.tensor([5, 0, 11])
    write_kv(expected, key, value, slots)
    assert kernel.kv_write(kv.data_ptr(), 12, 64, key.data_ptr(), 160, value.data_ptr(), 160, slots.data_ptr(), 3) == 0
    assert torch.equal(kv, expected)
    before = kv.clone()
    outside = torch.tensor([1, 12])
    assert kernel.kv_write(kv.data_ptr(), 12, 64, key.data_ptr(), 160, value.data_ptr(), 160, outside.data_ptr(), 2) == -5
    assert torch.equal(kv, before)  # nothing written


def test_merged_parts_compute_what_the_parts_compute(quant_lib):
    torch.manual_seed(3)
    k = 64
    types = [(Q.Q4_1, GGML.Q4_1, 64), (Q.Q4_1, GGML.Q4_1, 32), (Q.Q8_0, GGML.Q8_0, 32), (Q.Q8_0, GGML.Q8_0, 40),
             (Q.Q8_0, GGML.Q8_0, 32)]
    parts = []
    for btype, qtype, n in types:
        parts.append(Q.QuantPart(btype, Q.pack_blocks(quantized_blocks(torch.randn(n, k), qtype), btype, n, k), n))
    bias = torch.randn(sum(n for *_, n in types))
    linear = Q.QuantLinear(parts, k, bias)
    # Q4_1 64 + 32 merge; the Q8_0 parts merge up to the one of 40 columns, which ends its group padded
    assert [t.name for t in linear.types] == ["Q4_1", "Q4_1", "Q8_0", "Q8_0", "Q8_0"]
    assert [(t.name, n) for t, n in zip(linear.packed_types, linear.packed_sizes)] == [("Q4_1", 96), ("Q8_0", 72),
                                                                                       ("Q8_0", 32)]
    separate = torch.cat([Q.dequantize_ref(p.packed, p.btype, p.out_features, k) for p in parts])
    assert torch.equal(linear.dequantized(), separate)
    x = torch.randn(3, k)
    expected = torch.cat([quant_lib.linear(x, p.packed, p.btype, p.out_features, None) for p in parts], dim=1) + bias
    assert torch.equal(linear(x), expected)
