"""Quantized weights on CPU (``worker_svc/cpu/quantized.py``, ``csrc/quant.c``, ``gguf_weights.py``):
the kernel against the torch dequantization for Q4_0, Q4_1 and Q8_0, in fp32 and (on CPUs with
AVX-512 BF16) with bf16 activations, a tiny Llama written as a GGUF file served from its blocks
against the same model dequantized, in fp32 and in bf16 (greedy token-exact, resident bytes),
``--quantization int8``, and the errors for what is not served."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from kvcache import paged
from pagewire import LLM
from pagewire_common.sampling import SamplingParams
from tests.tiny_models import sample_prompts
from worker_svc.config import ModelConfig
from worker_svc.cpu import attention
from worker_svc.cpu import quantized as Q
from worker_svc.weights import GGUF_SOURCE_FILE, iter_weights, load_model

GGML = gguf.GGMLQuantizationType
TYPES = [(Q.Q4_0, GGML.Q4_0), (Q.Q4_1, GGML.Q4_1), (Q.Q8_0, GGML.Q8_0)]


def quantized_blocks(weight: torch.Tensor, qtype) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.quantize(weight.numpy(), qtype))


@pytest.fixture(scope="module")
def lib(quant_lib):
    return quant_lib


def test_every_build_of_the_kernel_gives_the_same_bits(tmp_path):
    """The AVX-512, AVX2 and portable paths sum in one order (the rows' tile sums included), so the
    kernel built for this CPU, for x86-64-v3 and without -march returns the same bits, at row counts
    that take each block shape of the buffered path (AVX2: 3-row blocks of a whole group for 8 rows,
    5- and 6-row blocks in two passes for 11 and 33)."""
    import ctypes

    from worker_svc.cpu import build, features

    compiler = build.compiler()
    if compiler is None:
        pytest.skip("no C compiler")
    common = build.flag_sets()[-1][1:]  # the flags besides -O3 and -march
    flag_sets = [["-O3", "-march=native", *common], ["-O3", *common]]
    if "avx2" in features.host_cpu_info().flags:
        flag_sets.append(["-O3", "-march=x86-64-v3", "-mtune=native", *common])
    kernels = [Q.QuantKernel(ctypes.CDLL(str(build.build(Q._SOURCE, compiler, flags, tmp_path, Q._ABI))))
               for flags in flag_sets]
    assert kernels[0].simd and not kernels[1].simd  # a vector path and the portable loop
    torch.manual_seed(0)
    for btype, qtype in TYPES:
        n, k = 70, 96
        packed = Q.pack_blocks(quantized_blocks(torch.randn(n, k), qtype), btype, n, k)
        for m in (3, 8, 11, 33):
            x, bias = torch.randn(m, k), torch.randn(n)
            outputs = [kernel.linear(x, packed, btype, n, bias) for kernel in kernels]
            for other in outputs[1:]:
                assert torch.equal(other, outputs[0]), (btype.name, m)
            # int8 activations: AVX-512 VNNI (where the CPU has it), AVX2 and the portable loop (rows in
            # blocks of 4 or 2 and a tail)
            assert kernels[0].i8_simd and not kernels[1].i8_simd
            outputs = [kernel.linear_i8(x, packed, btype, n, bias) for kernel in kernels]
            for other in outputs[1:]:
                assert torch.equal(other, outputs[0]), (btype.name, m, "int8 activations")


@pytest.mark.parametrize("btype,qtype", TYPES, ids=lambda t: getattr(t, "name", ""))
@pytest.mark.parametrize("n,k", [(37, 64), (200, 96), (64, 576)])
def test_kernel_matches_the_torch_dequantization(lib, btype, qtype, n, k):
    torch.manual_seed(n + k)
    weight = torch.randn(n, k)
    blocks = quantized_blocks(weight, qtype)
    packed = Q.pack_blocks(blocks, btype, n, k)
    assert torch.equal(packed, Q.pack_blocks_ref(blocks, btype, n, k))
    assert packed.numel() == Q.padded_columns(n) * k // 32 * btype.block_bytes  # the file's bytes, padded columns
    dense = Q.dequantize_ref(packed, btype, n, k)
    assert torch.equal(dense, torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), qtype)).reshape(n, k))
    bias = torch.randn(n)
    for m in (1, 3, 8, 9, 33):
        x = torch.randn(m, k)
        y = lib.linear(x, packed, btype, n, bias)
        reference = (x.double() @ dense.double().T + bias.double()).float()
        torch.testing.assert_close(y, reference, atol=1e-4 * k**0.5, rtol=1e-4)
        # a row's result does not depend on how many rows come with it
        assert torch.equal(lib.linear(x[-1:], packed, btype, n, bias)[0], y[-1])
    ids = torch.tensor([0, n - 1, 5, 5])
    assert torch.equal(lib.rows(packed, btype, ids, n, k), dense[ids])


def int8_activations_ref(x: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
    """x rounded to int8 per row and block of 32 (scale max |x| / 127) times the dequantized weight,
    in float64: what the int8 kernel computes, up to its fp32 roundings."""
    m, k = x.shape
    blocks = x.reshape(m, k // 32, 32)
    scale = blocks.abs().amax(-1, keepdim=True) * np.float32(1 / 127)
    inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    rounded = torch.round(blocks * inverse).clamp(-127, 127) * scale
    return rounded.reshape(m, k).double() @ dense.double().T


@pytest.mark.parametrize("btype,qtype", TYPES, ids=lambda t: getattr(t, "name", ""))
@pytest.mark.parametrize("n,k", [(37, 64), (200, 96), (64, 576), (96, 1536)])
def test_int8_activation_kernel_matches_its_reference(lib, btype, qtype, n, k):
    """Each row rounded to int8 per block (the sums exact in integers, the scales applied per block);
    a row's result does not depend on its batch (rows go in pairs, then one alone)."""
    torch.manual_seed(n + k)
    packed = Q.pack_blocks(quantized_blocks(torch.randn(n, k), qtype), btype, n, k)
    dense = Q.dequantize_ref(packed, btype, n, k)
    bias = torch.randn(n)
    for m in (1, 2, 3, 8, 33):
        x = torch.randn(m, k)
        x[0, :32] = 0.0  # a block of zeros: scale 0
        y = lib.linear_i8(x, packed, btype, n, bias)
        reference = int8_activations_ref(x, dense) + bias.double()
        torch.testing.assert_close(y.double(), reference, atol=2e-6 * k, rtol=1e-5)
        # not the fp32 arithmetic: the rounding of the activations shows
        assert (y.double() - (x.double() @ dense.double().T + bias.double())).abs().max() > 1e-3
        for row in (0, m - 1):
            assert torch.equal(lib.linear_i8(x[row : row + 1], packed, btype, n, bias)[0], y[row])
        out = torch.full((m, n + 5), 7.0)
        lib.linear_i8(x, packed, btype, n, bias, out=out[:, 2 : n + 2])  # a view: columns past n untouched
        assert torch.equal(out[:, 2 : n + 2], y) and (out[:, :2] == 7).all() and (out[:, n + 2 :] == 7).all()


@pytest.fixture
def tiles_only(bf16_lib):
    """The bf16 kernel with every call on the tiles or the dot products (none in exact integer
    products: ``--deterministic``), its defaults restored afterwards."""
    bf16_lib.exact_rows = 0
    yield bf16_lib
    bf16_lib.exact_rows = None
    bf16_lib.tiles_from = None


@pytest.mark.parametrize("btype,qtype", TYPES, ids=lambda t: getattr(t, "name", ""))
@pytest.mark.parametrize("n,k", [(37, 64), (200, 96), (64, 576)])
def test_bf16_kernel_matches_the_bf16_cast_of_the_dequantized_weight(tiles_only, btype, qtype, n, k):
    bf16_lib = tiles_only
    torch.manual_seed(n + k + 1)
    blocks = quantized_blocks(torch.randn(n, k), qtype)
    packed = Q.pack_blocks(blocks, btype, n, k)
    weight = Q.dequantize_ref(packed, btype, n, k).bfloat16()  # the dense bf16 model's weight
    bias = torch.randn(n)
    x = torch.randn(33, k).bfloat16()
    for m in range(1, 34):
        y = bf16_lib.linear_bf16(x[:m], packed, btype, n, bias)
        assert y.dtype == torch.bfloat16 and y.shape == (m, n)
        reference = (x[:m].double() @ weight.double().T + bias.double()).float()
        # fp32 sums rounded to bf16 once: within a bf16 step of the exact product
        torch.testing.assert_close(y.float(), reference, atol=1e-3 * k**0.5, rtol=2**-7)


@pytest.mark.parametrize("btype,qtype", TYPES, ids=lambda t: getattr(t, "name", ""))
def test_bf16_kernel_equals_the_dense_bf16_kernel_and_is_batch_invariant(tiles_only, btype, qtype):
    from worker_svc.cpu.linear import kernel as linear_kernel

    bf16_lib = tiles_only

    n, k = 70, 160
    torch.manual_seed(7)
    packed = Q.pack_blocks(quantized_blocks(torch.randn(n, k), qtype), btype, n, k)
    bias = torch.randn(n)
    x = torch.randn(32, k).bfloat16()
    y = bf16_lib.linear_bf16(x, packed, btype, n, bias)
    # a row's result does not depend on the rows beside it (registers up to 4 rows, the buffer past)
    for m in (1, 2, 4, 5, 13):
        assert torch.equal(bf16_lib.linear_bf16(x[:m], packed, btype, n, bias), y[:m])
    for r in range(32):
        assert torch.equal(bf16_lib.linear_bf16(x[r : r + 1], packed, btype, n, bias)[0], y[r])
    # the dense bf16 model's kernel sums in the same order (its vdpbf16ps path, or on AMX the same
    # tiles): the same bits
    dense = linear_kernel()
    if dense is not None and dense.pairs_simd:
        assert dense.pairs_amx == bf16_lib.bf16_amx
        weight = Q.dequantize_ref(packed, btype, n, k).bfloat16()
        assert torch.equal(dense.linear_pairs(x, dense.pack_pairs(weight), n, bias), y)


@pytest.mark.parametrize("btype,qtype", TYPES, ids=lambda t: getattr(t, "name", ""))
def test_a_row_gets_the_same_bits_alone_and_in_any_batch(tiles_only, btype, qtype):
    """Without the exact integer path (``--deterministic``) every call goes on AMX tiles where the
    CPU has them (elsewhere the dot products, invariant already): a row alone, read in place by a
    tile of fewer rows, gets the bits it gets among 300 (copied, 19 tiles of 16 rows in chunks of
    8, the last odd), and every path stays within rounding of the exact sum."""
    lib = tiles_only
    assert lib.tiles_from == 1  # csrc/quant.c's default
    n, k = 40, 4096  # 8 KiB rows: a chunk of x holds 8 tiles of rows
    torch.manual_seed(3)
    packed = Q.pack_blocks(quantized_blocks(torch.randn(n, k), qtype), btype, n, k)
    weight = Q.dequantize_ref(packed, btype, n, k).bfloat16()
    bias = torch.randn(n)
    x = torch.randn(300, k).bfloat16()
    reference = (x.double() @ weight.double().T + bias.double()).float()
    y = lib.linear_bf16(x, packed, btype, n, bias)
    torch.testing.assert_close(y.float(), reference, atol=1e-3 * k**0.5, rtol=2**-7)
    for m in (1, 2, 3, 16, 17, 33):
        assert torch.equal(lib.linear_bf16(x[:m], packed, btype, n, bias), y[:m]), m
    for r in (0, 1, 150, 299):
        assert torch.equal(lib.linear_bf16(x[r : r + 1], packed, btype, n, bias)[0], y[r])
    # rows read in place 4 KiB apart (a view of every other row), no bias, into a view of wider rows
    plain = lib.linear_bf16(x, packed, btype, n, None)
    out = torch.zeros(16, n + 8, dtype=torch.bfloat16)
    lib.linear_bf16(x[::2][:16], packed, btype, n, None, out=out[:16, :n])
    assert torch.equal(out[:16, :n], plain[::2][:16]) and not out[:16, n:].any()
    lib.tiles_from = 3  # calls of one or two rows on the dot products
    alone = torch.cat([lib.linear_bf16(x[r : r + 1], packed, btype, n, bias) for r in range(64)])
    torch.testing.assert_close(alone.float(), reference[:64], atol=1e-3 * k**0.5, rtol=2**-7)
    assert torch.equal(lib.linear_bf16(x[:3], packed, btype, n, bias), y[:3])  # 3 rows: the tiles
    if lib.bf16_amx:  # the paths round apart now and then (about 1 in 10^4 outputs): the default matters
        n, k = 1536, 576
        packed = Q.pack_blocks(quantized_blocks(torch.randn(n, k), qtype), btype, n, k)
        x = torch.randn(64, k).bfloat16()
        tiles = lib.linear_bf16(x, packed, btype, n, None)
        alone = torch.cat([lib.linear_bf16(x[r : r + 1], packed, btype, n, None) for r in range(64)])
        assert not torch.equal(alone, tiles)


def test_int8_quantization_round_trips_within_half_a_step(lib):
    weight = torch.randn(50, 64)
    blocks = Q.quantize_q8_0(weight)
    dense = Q.dequantize_ref(Q.pack_blocks(blocks, Q.Q8_0, 50, 64), Q.Q8_0, 50, 64)
    step = (weight.reshape(50, 2, 32).abs().amax(-1, keepdim=True) / 127).half().float()  # d as stored
    assert ((dense - weight).reshape(50, 2, 32).abs() <= step * 0.501).all()


def _permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows (``LlamaModel.permute``)."""
    return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


_NAMES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output", "gate_proj": "ffn_gate",
          "up_proj": "ffn_up", "down_proj": "ffn_down", "input_layernorm": "attn_norm",
          "post_attention_layernorm": "ffn_norm"}


def write_gguf_model(source_dir, out_dir, *, tied: bool, types: dict[str, GGML]) -> tuple:
    """A model directory as ``weights.resolve_model_path`` converts a GGUF file: config, tokenizer,
    the dequantized fp32 weights, and ``gguf_source.json`` naming the file, here ``model.gguf``
    written from ``source_dir``'s weights quantized to ``types`` (by our linear name; Q8_0 for the
    rest) with q/k rows permuted as llama.cpp writes them."""
    out_dir.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(source_dir / name, out_dir / name)
    config_json = json.loads((out_dir / "config.json").read_text())
    config_json["tie_word_embeddings"] = tied
    (out_dir / "config.json").write_text(json.dumps(config_json))
    config = ModelConfig.from_pretrained(out_dir)
    writer = gguf.GGUFWriter(str(out_dir / "model.gguf"), "llama")
    dequantized = {}
    for name, tensor in iter_weights(source_dir):
        if name == "lm_head.weight" and tied:
            continue
        rows = tensor.float().numpy()
        parts = name.split(".")
        if name == "model.embed_tokens.weight":
            gguf_name, qtype = "token_embd.weight", GGML.Q8_0
        elif name == "lm_head.weight":
            gguf_name, qtype = "output.weight", GGML.Q8_0
        elif name == "model.norm.weight":
            gguf_name, qtype = "output_norm.weight", GGML.F32
        else:
            gguf_name, qtype = f"blk.{parts[2]}.{_NAMES[parts[-2]]}.{parts[-1]}", types.get(parts[-2], GGML.F32)
            if rows.ndim == 1:
                qtype = GGML.F32
        if qtype == GGML.F32:
            data, back = rows, rows
        else:
            data = gguf.quants.quantize(rows, qtype)
            back = gguf.quants.dequantize(data, qtype).reshape(rows.shape)
        dequantized[name] = torch.from_numpy(np.ascontiguousarray(back))
        heads = {"q_proj": config.num_heads, "k_proj": config.num_kv_heads}.get(parts[-2])
        if heads:
            data = _permute(data, heads)
        writer.add_tensor(gguf_name, np.ascontiguousarray(data), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    from safetensors.torch import save_file

    save_file(dequantized, str(out_dir / "model.safetensors"))
    stat = (out_dir / "model.gguf").stat()
    (out_dir / GGUF_SOURCE_FILE).write_text(json.dumps(
        {"path": str(out_dir / "model.gguf"), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}))
    return out_dir, out_dir / "model.gguf"


MIXED = {"q_proj": GGML.Q4_1, "k_proj": GGML.Q4_1, "v_proj": GGML.Q8_0, "o_proj": GGML.Q4_0, "gate_proj": GGML.Q4_1,
         "up_proj": GGML.Q4_1, "down_proj": GGML.Q4_0}


def greedy(model_dir, prompts, dtype="float32", **settings) -> list[list[int]]:
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    with LLM(model_dir, dtype=dtype, **settings) as llm:
        return [out.token_ids for out in llm.generate(prompts, params)]


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_tiny_gguf_served_from_its_blocks_equals_its_fp32_dequantization(lib, tiny_model_dir, tmp_path, caplog, tied):
    source = tiny_model_dir("llama-gqa")
    model_dir, gguf_path = write_gguf_model(source, tmp_path / "converted", tied=tied, types=MIXED)
    with caplog.at_level("INFO", logger="pagewire.worker"):
        model, _ = load_model(model_dir, torch.float32, "cpu", gguf_weights="quantized")
    linears = {name: m for name, m in model.named_modules() if isinstance(m, Q.QuantLinear)}
    qkv = linears["model.layers.0.self_attn.qkv_proj"]
    assert [t.name for t in qkv.types] == ["Q4_1", "Q4_1", "Q8_0"]  # parts of different types side by side
    assert isinstance(model.model.embed_tokens, Q.QuantEmbedding)
    assert (model.packed_lm_head is model.model.embed_tokens.head) == tied  # tied: one table, both uses
    # the blocks dequantize to the converted weights, q/k rows back in Hugging Face order
    dense = dict(iter_weights(model_dir))
    expected = torch.cat([dense[f"model.layers.0.self_attn.{p}.weight"] for p in ("q_proj", "k_proj", "v_proj")])
    assert torch.equal(qkv.dequantized(), expected)
    resident = Q.resident_weight_bytes(model)
    assert resident <= 1.15 * gguf_path.stat().st_size
    assert f"file {gguf_path.stat().st_size} bytes, resident {resident} bytes" in caplog.text

    prompts = sample_prompts(source, n=4, lengths=(1, 9, 33, 77))
    quantized = greedy(model_dir, prompts, gguf_weights="quantized")
    assert quantized == greedy(model_dir, prompts, gguf_weights="dequantize")


def test_a_gguf_cut_short_or_corrupt_is_one_clear_error(tiny_model_dir, tmp_path):
    """A download cut short, or a header that is not GGUF's: a ValueError naming the file, which
    the command line prints as one line, not the struct module's exception from deep inside."""
    from worker_svc.gguf_weights import GGUFFile
    from worker_svc.weights import convert_gguf

    _, gguf_path = write_gguf_model(tiny_model_dir("llama-gqa"), tmp_path / "converted", tied=False, types=MIXED)
    data = gguf_path.read_bytes()
    assert GGUFFile(gguf_path).types
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(ValueError, match=r"cut.gguf is truncated: tensor \S+ ends past the end of the file"):
        convert_gguf(cut, tmp_path / "out")
    for name, content in (("header.gguf", data[:20]), ("empty.gguf", b""), ("cut-metadata.gguf", data[:200])):
        (tmp_path / name).write_bytes(content)
        with pytest.raises(ValueError, match=f"{name} is not a readable GGUF file"):
            GGUFFile(tmp_path / name)


def test_a_llama_gguf_with_q_and_k_biases_gets_them_back_in_hugging_face_order(lib, tiny_model_dir, tmp_path):
    """llama.cpp permutes a llama GGUF's q and k bias elements as it permutes their rows."""
    source = tiny_model_dir("qwen2-bias")  # its head is its embedding
    model_dir, _ = write_gguf_model(source, tmp_path / "converted", tied=True, types=MIXED)
    model, _ = load_model(model_dir, torch.float32, "cpu", gguf_weights="quantized")
    qkv = model.get_submodule("model.layers.0.self_attn.qkv_proj")
    dense = dict(iter_weights(model_dir))
    expected = torch.cat([dense[f"model.layers.0.self_attn.{p}.bias"] for p in ("q_proj", "k_proj", "v_proj")])
    assert torch.equal(qkv.bias, expected)
    prompts = sample_prompts(source, n=3, lengths=(1, 9, 33))
    assert greedy(model_dir, prompts, gguf_weights="quantized") == greedy(model_dir, prompts, gguf_weights="dequantize")


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_tiny_gguf_served_from_its_blocks_in_bf16_equals_its_bf16_dequantization(bf16_lib, tiny_model_dir, tmp_path,
                                                                                 caplog, tied):
    """With --deterministic every call takes the tiles (or the dot products), whose weights and sums
    are the dense bf16 model's: the same tokens. By default, where the tiles are granted, calls of
    up to 4 rows take the exact integer products instead (the log says so)."""
    source = tiny_model_dir("llama-gqa")
    model_dir, _ = write_gguf_model(source, tmp_path / "converted", tied=tied, types=MIXED)
    prompts = sample_prompts(source, n=4, lengths=(1, 9, 33, 77))
    try:
        with caplog.at_level("INFO", logger="pagewire.worker"):
            quantized = greedy(model_dir, prompts, "bfloat16", gguf_weights="quantized", deterministic=True)
        on = "AMX tiles" if bf16_lib.bf16_amx else "AVX-512 BF16 dot products"
        assert f"bf16 arithmetic (C kernel, {on}, " in caplog.text
        # the same bf16 weights, embedding rows and sums (csrc/linear.c's order, or on AMX the same
        # tiles): the same tokens
        assert quantized == greedy(model_dir, prompts, "bfloat16", gguf_weights="dequantize", deterministic=True)
    finally:  # as a worker without --deterministic sets them
        paged.use_cpu_attention(attention.kernel)
        bf16_lib.exact_rows = None
    caplog.clear()
    with caplog.at_level("INFO", logger="pagewire.worker"):
        greedy(model_dir, prompts[:1], "bfloat16", gguf_weights="quantized")
    assert ("calls of up to 4 rows in exact integer products" in caplog.text) == bf16_lib.bf16_amx
    assert bf16_lib.exact_rows == (4 if bf16_lib.bf16_amx else 0)  # the worker's default restored


def test_bf16_model_computes_in_fp32_without_avx512_bf16(lib, tiny_model_dir, tmp_path, monkeypatch):
    from worker_svc.cpu import features

    model_dir, _ = write_gguf_model(tiny_model_dir("llama-gqa"), tmp_path / "converted", tied=True, types=MIXED)
    model, _ = load_model(model_dir, torch.bfloat16, "cpu", gguf_weights="quantized")
    avx2 = features.CpuInfo("an AVX2 CPU", frozenset({"avx", "avx2", "fma", "f16c"}), "AuthenticAMD", 25)
    monkeypatch.setattr(features, "cpu_info", lambda: avx2)
    dtype, line = Q.compute_quantized_model(model, torch.bfloat16)
    assert dtype == torch.float32
    assert "fp32 arithmetic" in line and "--dtype bfloat16 computes in fp32 here, as this CPU has no AVX-512 BF16" in line
    assert all(m.compute_dtype == torch.float32 for m in model.modules() if isinstance(m, Q.QuantLinear))
    assert model.model.norm.weight.dtype == torch.float32
    assert model.model.embed_tokens(torch.tensor([1, 2])).dtype == torch.float32


def test_int8_quantization_equals_its_dequantized_checkpoint(lib, tiny_model_dir, tmp_path):
    from safetensors.torch import save_file

    source = tiny_model_dir("llama-gqa")
    reference_dir = tmp_path / "int8-dequantized"
    shutil.copytree(source, reference_dir)
    weights = {}
    for name, tensor in iter_weights(source):
        if tensor.dim() == 2 and name != "model.embed_tokens.weight":  # linears and the untied head
            n, k = tensor.shape
            tensor = Q.dequantize_ref(Q.pack_blocks(Q.quantize_q8_0(tensor), Q.Q8_0, n, k), Q.Q8_0, n, k)
        weights[name] = tensor.float().contiguous()
    save_file(weights, str(reference_dir / "model.safetensors"))
    prompts = sample_prompts(source, n=3, lengths=(1, 17, 50))
    assert greedy(source, prompts, quantization="int8") == greedy(reference_dir, prompts)


def test_unsupported_block_type_is_named_and_auto_falls_back(lib, tiny_model_dir, tmp_path, caplog):
    model_dir, gguf_path = write_gguf_model(tiny_model_dir("llama-gqa"), tmp_path / "converted", tied=False, types=MIXED)
    # the file rewritten with a Q5_K tensor (one block of 256 weights, 176 bytes, per row): not served from blocks
    writer = gguf.GGUFWriter(str(gguf_path), "llama")
    writer.add_tensor("blk.0.ffn_down.weight", np.zeros((64, 176), dtype=np.uint8), raw_dtype=GGML.Q5_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    stat = gguf_path.stat()
    (model_dir / GGUF_SOURCE_FILE).write_text(json.dumps({"path": str(gguf_path), "size": stat.st_size,
                                                          "mtime_ns": stat.st_mtime_ns}))
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_down\.weight is Q5_K.*supported block types: Q4_0, Q4_1, Q8_0"):
        load_model(model_dir, torch.float32, "cpu", gguf_weights="quantized")
    with caplog.at_level("INFO", logger="pagewire.worker"):
        model, _ = load_model(model_dir, torch.float32, "cpu")  # auto: the dequantized copy
    assert not any(isinstance(m, Q.QuantLinear) for m in model.modules())
    assert "serving model.gguf dequantized" in caplog.text and "Q5_K" in caplog.text


def test_int8_activations_serve_quantized_weights_only(lib, tiny_model_dir, tmp_path, caplog):
    source = tiny_model_dir("llama-gqa")
    with pytest.raises(ValueError, match="--int8-activations multiplies quantized weights"):
        LLM(source, dtype="float32", int8_activations=True)
    model_dir, _ = write_gguf_model(source, tmp_path / "converted", tied=True, types=MIXED)
    prompts = sample_prompts(source, n=3, lengths=(1, 17, 50))
    with caplog.at_level("INFO", logger="pagewire.worker"):
        with LLM(model_dir, dtype="float32", int8_activations=True, enable_prefix_caching=False) as llm:
            linears = [m for m in llm.runner.model.modules() if isinstance(m, Q.QuantLinear)]
            assert linears and all(m.int8_activations for m in linears)
            tokens = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0,
                                                                                ignore_eos=True))]
    assert all(len(t) == 8 for t in tokens)
    assert any("activations rounded to int8 per block of 32" in r.getMessage() for r in caplog.records)


def test_int8_activations_need_the_cpu(tiny_model_dir):
    from worker_svc.runner import ModelRunner, RunnerConfig

    with pytest.raises(ValueError, match="--int8-activations runs on CPU"):  # refused before any weight loads
        ModelRunner(tiny_model_dir("llama-gqa"), RunnerConfig(device="meta", int8_activations=True))


def test_quantization_needs_cpu_and_one_rank(tiny_model_dir):
    with pytest.raises(ValueError, match="--quantization int8 runs on CPU with one rank"):
        load_model(tiny_model_dir("llama-gqa"), torch.float32, "meta", quantization="int8")
