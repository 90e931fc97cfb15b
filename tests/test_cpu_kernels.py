"""The C paged-attention kernel for CPU (worker_svc/cpu/csrc/attention.c) against the torch reference.

It must build wherever a C compiler is on PATH (CI has one); it reads K/V in place through the
block table, so the cases put blocks in shuffled order, share prefix blocks, roll chunks over
block boundaries and run contexts long enough for the online softmax to rescale many times.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from kvcache import paged
from kvcache.paged import paged_attention, paged_attention_ref
from tests.test_paged import make_metadata
from worker_svc.cpu import attention, build

pytestmark = pytest.mark.skipif(build.compiler() is None, reason="no C compiler on PATH")


@pytest.fixture(scope="module")
def kernel() -> attention.AttentionKernel:
    built = attention.kernel()
    assert built is not None, "the CPU kernel did not build (see the log)"
    paged.use_cpu_attention(attention.kernel)  # as the worker does at start-up
    yield built
    paged.use_cpu_attention(None)


def _batch(query_lens, seq_lens, block_size, num_kv_heads, group, dtype, *, shared_prefix_blocks=0, seed=0, spread=1.0,
           head_dim=64):
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(needed) + 3
    free = (torch.randperm(num_blocks, generator=gen)).tolist()
    block_ids = [[free.pop() for _ in range(n)] for n in needed]
    if shared_prefix_blocks:
        block_ids[1][:shared_prefix_blocks] = block_ids[0][:shared_prefix_blocks]
    meta = make_metadata(query_lens, seq_lens, block_ids, block_size)
    kv = (torch.randn((2, num_blocks, block_size, num_kv_heads, head_dim), generator=gen) * spread).to(dtype)
    query = (torch.randn((sum(query_lens), num_kv_heads * group, head_dim), generator=gen) * spread).to(dtype)
    return query, kv, meta, head_dim**-0.5


CASES = [
    # (query_lens, seq_lens): decodes, a whole prompt, chunks deep into a context, block rollover
    ([1, 1, 1, 1], [1, 2, 16, 17]),
    ([7], [7]),
    ([5, 1, 32, 1], [21, 16, 40, 300]),
    ([1, 33, 1, 9, 1], [700, 64, 129, 9, 1]),
]


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("num_kv_heads,group", [(1, 1), (3, 3), (2, 4)])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_matches_reference_fp32(kernel, block_size, num_kv_heads, group, case):
    query_lens, seq_lens = CASES[case]
    query, kv, meta, scale = _batch(query_lens, seq_lens, block_size, num_kv_heads, group, torch.float32, seed=case)
    out = kernel.paged_attention(query, kv, meta.query_start_loc, meta.seq_lens, meta.block_tables, scale)
    torch.testing.assert_close(out, paged_attention_ref(query, kv, meta, scale), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("head_dim", [8, 40, 72, 128, 6])
@pytest.mark.parametrize("dtype,kv_dtype", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16)])
def test_head_dims(kernel, head_dim, dtype, kv_dtype):
    # on AVX2, multiples of 8 take the intrinsics (values: eight-lane steps only, a 64-wide chunk and
    # a tail, two chunks), 6 the plain loops
    query_lens, seq_lens = CASES[2]
    query, kv, meta, scale = _batch(query_lens, seq_lens, 16, 2, 4, dtype, seed=3, head_dim=head_dim)
    kv = kv.to(kv_dtype)
    out = kernel.paged_attention(query, kv, meta.query_start_loc, meta.seq_lens, meta.block_tables, scale)
    torch.testing.assert_close(out, paged_attention_ref(query, kv.float(), meta, scale), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("block_size", [4, 16])
def test_matches_reference_bf16(kernel, block_size):
    query_lens, seq_lens = [1, 33, 1, 9, 1], [700, 64, 129, 9, 1]
    query, kv, meta, scale = _batch(query_lens, seq_lens, block_size, 3, 3, torch.bfloat16)
    out = kernel.paged_attention(query, kv, meta.query_start_loc, meta.seq_lens, meta.block_tables, scale)
    assert out.dtype == torch.bfloat16
    expected = paged_attention_ref(query.float(), kv.float(), meta, scale)  # the same rounded inputs
    # fp32 inside; one bf16 rounding of the output (relative 2^-9) apart from summation order
    torch.testing.assert_close(out.float(), expected, atol=4e-3, rtol=8e-3)


@pytest.mark.parametrize("head_dim", [64, 72, 96, 128, 40])
@pytest.mark.parametrize("num_kv_heads,group", [(3, 1), (2, 2), (3, 3), (2, 4)])
def test_bf16_head_dims_and_groups(kernel, head_dim, num_kv_heads, group):
    """bf16 queries over a bf16 cache take, on AVX-512 BF16, dot products for the scores where
    head_dim is a multiple of 32 and every value widened once for 2 or 3 query heads (64 columns at
    a time, then a tail): each shape against the reference, as the widening loops elsewhere."""
    query_lens, seq_lens = CASES[2]
    query, kv, meta, scale = _batch(query_lens, seq_lens, 16, num_kv_heads, group, torch.bfloat16, seed=5,
                                    head_dim=head_dim)
    out = kernel.paged_attention(query, kv, meta.query_start_loc, meta.seq_lens, meta.block_tables, scale)
    expected = paged_attention_ref(query.float(), kv.float(), meta, scale)
    torch.testing.assert_close(out.float(), expected, atol=4e-3, rtol=8e-3)


@pytest.mark.parametrize("block_size", [4, 16])
def test_fp32_queries_over_a_bf16_cache_match_the_reference(kernel, block_size):
    """A bf16 model computing in fp32 (CPUs without native bf16): the cache is the only rounding."""
    query_lens, seq_lens = [1, 33, 1, 9, 1, 3], [700, 64, 129, 9, 1, 40]
    query, kv, meta, scale = _batch(query_lens, seq_lens, block_size, 3, 3, torch.float32)
    kv16 = kv.bfloat16()
    expected = paged_attention_ref(query, kv16.float(), meta, scale)
    out = kernel.paged_attention(query, kv16, meta.query_start_loc, meta.seq_lens, meta.block_tables, scale)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)
    # the dispatch: the kernel for short queries, SDPA over the cast cache for longer chunks
    torch.testing.assert_close(paged_attention(query, kv16, meta, scale), expected, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(paged_attention_ref(query, kv16, meta, scale), expected, atol=2e-6, rtol=1e-5)
    assert paged.prepare_cpu_attention(torch.float32, torch.bfloat16) == "C kernel"


def test_shared_prefix_blocks_and_large_scores(kernel):
    """Two sequences reading the same prefix blocks; scores spread wide enough that the running
    max changes block after block (the rescaling path) and most weights underflow to 0."""
    query, kv, meta, scale = _batch([20, 1], [200, 180], 16, 3, 3, torch.float32, shared_prefix_blocks=8, spread=6.0)
    out = kernel.paged_attention(query, kv, meta.query_start_loc, meta.seq_lens, meta.block_tables, scale)
    # Scores reach +-100 here, so any fp32 summation order is off by ~1e-4 in the output: hold the
    # kernel to the float64 truth, and to no worse than the fp32 reference's own error.
    truth = paged_attention_ref(query.double(), kv.double(), meta, scale)
    kernel_error = (out.double() - truth).abs().max().item()
    reference_error = (paged_attention_ref(query, kv, meta, scale).double() - truth).abs().max().item()
    assert kernel_error < 5e-4 and kernel_error <= 2 * reference_error, (kernel_error, reference_error)


def test_max_query_len_leaves_longer_chunks_to_the_caller(kernel):
    query, kv, meta, scale = _batch([1, 9, 4, 1], [30, 40, 4, 77], 16, 3, 3, torch.float32)
    out = torch.full_like(query, float("nan"))
    kernel.paged_attention(query, kv, meta.query_start_loc, meta.seq_lens, meta.block_tables, scale, max_query_len=4, out=out)
    expected = paged_attention_ref(query, kv, meta, scale)
    chunk = slice(1, 10)  # the 9-token chunk: not computed
    assert torch.isnan(out[chunk]).all()
    rest = torch.ones(len(query), dtype=torch.bool)
    rest[chunk] = False
    torch.testing.assert_close(out[rest], expected[rest], atol=2e-6, rtol=1e-5)


def test_bad_metadata_is_an_error_and_writes_nothing(kernel):
    query, kv, meta, scale = _batch([1, 4], [20, 4], 4, 1, 1, torch.float32)
    tables = meta.block_tables.clone()
    tables[0, 1] = kv.shape[1]  # one past the last block
    with pytest.raises(ValueError, match="block table entry is outside the cache"):
        kernel.paged_attention(query, kv, meta.query_start_loc, meta.seq_lens, tables, scale)
    seq_lens = meta.seq_lens.clone()
    seq_lens[1] = 3  # 4 query tokens, 3 of context
    with pytest.raises(ValueError, match="more query tokens than context"):
        kernel.paged_attention(query, kv, meta.query_start_loc, seq_lens, meta.block_tables, scale)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        kernel.paged_attention(query.half(), kv.half(), meta.query_start_loc, meta.seq_lens, meta.block_tables, scale)


def test_loading_it_leaves_subnormals_alone(kernel):
    """-ffast-math would link crtfastmath.o, which flushes subnormals to zero in the whole process."""
    tiny = torch.tensor([1e-38], dtype=torch.float32) / 1000.0
    assert tiny.item() != 0.0


def test_build_is_cached_by_content(tmp_path):
    compiler = build.compiler()
    flags = build.flag_sets()[-1]
    source, abi = attention._SOURCE, attention._ABI
    first = build.build(source, compiler, flags, tmp_path, abi)
    stamp = first.stat().st_mtime_ns
    assert build.build(source, compiler, flags, tmp_path, abi) == first and first.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary files left behind


def test_backend_variable_selects_the_kernel(kernel, monkeypatch):
    query, kv, meta, scale = _batch([3, 1], [19, 40], 16, 3, 3, torch.float32)
    expected = paged_attention_ref(query, kv, meta, scale)
    try:
        monkeypatch.setenv("PAGEWIRE_ATTENTION_BACKEND", "cpu")
        paged.attention_backend.cache_clear()
        calls = []
        monkeypatch.setattr(kernel, "paged_attention", lambda *a, **kw: calls.append(1) or expected)
        assert paged_attention(query, kv, meta, scale) is expected and calls == [1]
        with pytest.raises(ValueError, match="float32 or bfloat16"):
            paged_attention(query.half(), kv.half(), meta, scale)
        monkeypatch.setenv("PAGEWIRE_ATTENTION_BACKEND", "torch")
        paged.attention_backend.cache_clear()
        assert torch.equal(paged_attention(query, kv, meta, scale), expected) and calls == [1]
    finally:
        monkeypatch.delenv("PAGEWIRE_ATTENTION_BACKEND", raising=False)
        paged.attention_backend.cache_clear()


def test_no_compiler_falls_back_to_the_reference(monkeypatch, caplog):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.delenv("CC", raising=False)
    attention.kernel.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="pagewire.worker"):
            assert attention.kernel() is None
        assert "no C compiler found" in caplog.text
    finally:
        attention.kernel.cache_clear()


def test_a_forced_cpu_backend_needs_the_registered_kernel(kernel, monkeypatch):
    query, kv, meta, scale = _batch([3, 1], [19, 40], 16, 3, 3, torch.float32)
    paged.use_cpu_attention(None)
    try:
        monkeypatch.setenv("PAGEWIRE_ATTENTION_BACKEND", "cpu")
        paged.attention_backend.cache_clear()
        with pytest.raises(RuntimeError, match="no CPU attention kernel is registered"):
            paged_attention(query, kv, meta, scale)
    finally:
        paged.use_cpu_attention(attention.kernel)
        monkeypatch.delenv("PAGEWIRE_ATTENTION_BACKEND", raising=False)
        paged.attention_backend.cache_clear()


def test_a_cpu_worker_registers_the_kernel_at_start(kernel, tiny_model_dir, caplog):
    from worker_svc.runner import ModelRunner, RunnerConfig

    paged.use_cpu_attention(None)
    try:
        with caplog.at_level("INFO", logger="pagewire.worker"):
            ModelRunner(tiny_model_dir("llama-gqa"), RunnerConfig(dtype="float32", device="cpu", num_kv_blocks=8))
        assert "; attention C kernel" in caplog.text
        assert paged.prepare_cpu_attention(torch.float32) == "C kernel"
    finally:
        paged.use_cpu_attention(attention.kernel)


def test_worker_start_reports_the_path(kernel, monkeypatch):
    assert paged.prepare_cpu_attention(torch.float32) == "C kernel"
    assert paged.prepare_cpu_attention(torch.bfloat16) == "C kernel"
    assert paged.prepare_cpu_attention(torch.float16) == "torch reference"
    try:
        monkeypatch.setenv("PAGEWIRE_ATTENTION_BACKEND", "torch")
        paged.attention_backend.cache_clear()
        assert paged.prepare_cpu_attention(torch.float32) == "torch reference"
    finally:
        monkeypatch.delenv("PAGEWIRE_ATTENTION_BACKEND", raising=False)
        paged.attention_backend.cache_clear()
