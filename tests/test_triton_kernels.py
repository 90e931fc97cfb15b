"""Triton paged attention and KV append against the torch references, on CPU under Triton's interpreter.

The interpreter runs every program in Python, so sizes stay tiny (few heads, short contexts, one
200-token chunk per case at most) and each case packs several properties into one mixed batch.
Tolerances: fp32 2e-5 absolute; fp16 3e-3 and bf16 3e-2 absolute against the fp32 reference on the same
(rounded) inputs, since the kernel, like any flash kernel, rounds the softmax weights to the input dtype
before the P @ V product.
"""

from __future__ import annotations

import os

import pytest
import torch

# Triton decorates its own jit'd helpers (tl.cdiv, tl.max, ...) when it is first imported: the interpreter
# must be on by then. Switch it on only for the imports and for this module's tests, so that no other
# test (or a subprocess one starts) inherits it.
_saved_interpret = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"
try:
    triton = pytest.importorskip("triton")
    from kvcache import paged
    from kvcache.paged import AttentionMetadata, paged_attention_ref, write_kv
    from tests.test_paged import make_metadata
    from kvcache.triton_append import write_kv_triton
    from kvcache.triton_attention import _paged_attention_kernel, choose_num_splits, paged_attention_triton
finally:
    if _saved_interpret is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = _saved_interpret

if type(triton.language.cdiv).__name__ != "InterpretedFunction" or type(_paged_attention_kernel).__name__ != "InterpretedFunction":
    pytest.skip("triton was imported before TRITON_INTERPRET=1 could be set; run this file alone", allow_module_level=True)


@pytest.fixture(scope="module", autouse=True)
def _interpreter_on():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        yield


def make_batch(
    query_lens: list[int],
    seq_lens: list[int],
    block_size: int,
    num_blocks: int,
    *,
    shared_prefix: dict[int, tuple[int, int]] | None = None,
    seed: int = 0,
) -> tuple[AttentionMetadata, list[list[int]]]:
    """Metadata for sequences whose last ``query_lens[i]`` of ``seq_lens[i]`` tokens are scheduled.

    Blocks are drawn at random (not contiguous, never block 0, which pads the table rows);
    ``shared_prefix[i] = (j, n)`` gives sequence i the first n blocks of sequence j (a prefix-cache hit).
    """
    generator = torch.Generator().manual_seed(seed)
    free = (torch.randperm(num_blocks - 1, generator=generator) + 1).tolist()
    block_ids: list[list[int]] = []
    for i, seq_len in enumerate(seq_lens):
        blocks = []
        if shared_prefix and i in shared_prefix:
            j, n = shared_prefix[i]
            blocks = block_ids[j][:n]
        needed = -(-seq_len // block_size) - len(blocks)
        blocks = blocks + [free.pop() for _ in range(needed)]
        block_ids.append(blocks)
    meta = make_metadata(query_lens, seq_lens, block_ids, block_size)
    return meta, block_ids


TOLERANCE = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 3e-2}


def check_attention(num_heads, num_kv_heads, head_dim, block_size, dtype, query_lens, seq_lens, *, num_splits, shared_prefix=None):
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 2
    meta, _ = make_batch(query_lens, seq_lens, block_size, num_blocks, shared_prefix=shared_prefix)
    generator = torch.Generator().manual_seed(1)
    kv_layer = torch.randn((2, num_blocks, block_size, num_kv_heads, head_dim), generator=generator).to(dtype)
    query = torch.randn((sum(query_lens), num_heads, head_dim), generator=generator).to(dtype)
    scale = head_dim**-0.5
    out = paged_attention_triton(query, kv_layer, meta, scale, num_splits=num_splits)
    expected = paged_attention_ref(query.float(), kv_layer.float(), meta, scale)
    assert out.dtype == dtype and out.shape == query.shape
    torch.testing.assert_close(out.float(), expected, atol=TOLERANCE[dtype], rtol=0)


# Every batch mixes single-token decodes whose context ends exactly on a block boundary and one token
# past it, a 7-token chunk continuing a cached context, and (except the split fp16 case) a 200-token
# chunk; the 7-token chunk shares its first blocks with another sequence (a prefix-cache hit).
@pytest.mark.parametrize(
    "num_heads, num_kv_heads, head_dim, block_size, dtype, num_splits",
    [
        pytest.param(2, 2, 64, 16, torch.float32, 3, id="gqa1-d64-bs16-fp32-split3"),
        pytest.param(6, 2, 64, 16, torch.bfloat16, 1, id="gqa3-d64-bs16-bf16-nosplit"),
        pytest.param(8, 1, 128, 32, torch.float32, 1, id="gqa8-d128-bs32-fp32-nosplit"),
        pytest.param(3, 1, 128, 32, torch.float16, 4, id="gqa3-d128-bs32-fp16-split4"),
    ],
)
def test_mixed_batch_matches_reference(num_heads, num_kv_heads, head_dim, block_size, dtype, num_splits):
    long_chunk = num_splits == 1 or num_heads == 2
    query_lens = [1, 7, 1] + ([200] if long_chunk else [])
    seq_lens = [2 * block_size, 2 * block_size + 7, 2 * block_size + 1] + ([230] if long_chunk else [])
    check_attention(
        num_heads, num_kv_heads, head_dim, block_size, dtype, query_lens, seq_lens,
        num_splits=num_splits, shared_prefix={1: (0, 2)},
    )


@pytest.mark.parametrize("num_splits", [None, 2, 5])
def test_decode_batch_matches_reference(num_splits):
    # A one-token context, a fresh one-token prompt, boundary and past-boundary contexts, and a long one
    # whose splits get uneven work (the short sequences leave later splits empty).
    check_attention(
        8, 1, 64, 16, torch.float32, [1] * 5, [1, 16, 17, 64, 300],
        num_splits=num_splits, shared_prefix={4: (3, 4)},
    )


def test_more_splits_than_the_merge_reads_are_capped():
    # 40 splits asked over 700 keys of 32-key tiles: 16, the most the merge kernel reads
    check_attention(4, 2, 64, 16, torch.float32, [1, 1], [700, 9], num_splits=40)


def test_fresh_prompt_chunk_and_padding_table_rows():
    # The whole context is this step's chunk (q_len == seq_len), beside a longer table row: the short
    # row's padding (block 0) must never be read as context.
    check_attention(4, 2, 64, 16, torch.float32, [7, 1], [7, 40], num_splits=1)


def test_choose_num_splits():
    # H100 (132 SMs): 64 decodes x 2,048 keys with 3 kv heads underfill the GPU; 12 kv heads do not.
    assert choose_num_splits(num_programs=64 * 3, max_seq_len=2048, num_sms=132) == 3
    assert choose_num_splits(num_programs=64 * 12, max_seq_len=2048, num_sms=132) == 1
    assert choose_num_splits(num_programs=8, max_seq_len=32768, num_sms=132) == 16  # capped
    assert choose_num_splits(num_programs=1, max_seq_len=300, num_sms=132) == 1  # too short to split
    assert choose_num_splits(num_programs=2, max_seq_len=1024, num_sms=132) == 4  # >= 256 keys per split
    # 8 kv heads (Llama-3.2-1B): 512 programs are 3.9 per SM, close enough to 4 to stay unsplit
    assert choose_num_splits(num_programs=64 * 8, max_seq_len=2048, num_sms=132) == 1


def test_long_gqa_decodes_read_wide_key_tiles():
    from kvcache.attention_metadata import AttentionMetadata
    from kvcache.triton_attention import Tiles, plan_launch

    def plan(num_heads, num_kv_heads, dtype, seq_len, num_seqs=64, num_splits=1, tiles=None):
        meta = AttentionMetadata(
            slot_mapping=torch.zeros(num_seqs, dtype=torch.int64), query_start_loc=torch.arange(num_seqs + 1),
            seq_lens=torch.full((num_seqs,), seq_len), block_tables=torch.zeros((num_seqs, 1), dtype=torch.int32),
            max_query_len=1, max_seq_len=seq_len, query_lens_cpu=[1] * num_seqs, seq_lens_cpu=[seq_len] * num_seqs,
            logits_indices=torch.arange(num_seqs),
        )
        return plan_launch(torch.zeros((num_seqs, num_heads, 64), dtype=dtype), num_kv_heads, meta, num_splits, tiles)

    assert plan(32, 8, torch.bfloat16, 2048).block_n == 128  # 4 heads per kv head, 2,048 keys a program
    assert plan(32, 8, torch.bfloat16, 2048, num_splits=3).block_n == 64  # 683 keys a program
    assert plan(9, 3, torch.bfloat16, 4096, num_splits=3).block_n == 128  # 3 heads pad to 4
    assert plan(12, 12, torch.bfloat16, 2048).block_n == 64  # one head per kv head
    assert plan(32, 8, torch.float32, 2048).block_n == 32  # fp32 keeps its smaller tiles
    assert plan(32, 8, torch.bfloat16, 2048, tiles=Tiles(16, 32, 4, 2)).block_n == 32  # given tiles are kept


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_triton_matches_reference_and_skips_negative_slots(dtype):
    block_size, num_kv_heads, head_dim = 4, 3, 64
    kv_ref = torch.randn((2, 6, block_size, num_kv_heads, head_dim)).to(dtype)
    kv_triton = kv_ref.clone()
    # Sequence A fills block 5 from offset 1 and rolls over into block 2; B writes block 0 offset 3;
    # two padding tokens (slot -1) must leave the cache untouched.
    slots = torch.tensor([21, 22, 23, 8, 9, -1, 3, -1], dtype=torch.int64)
    # key/value as strided views of a fused qkv projection, as the models produce them
    qkv = torch.randn((len(slots), 3, num_kv_heads, head_dim)).to(dtype)
    key, value = qkv[:, 1], qkv[:, 2]
    write_kv_triton(kv_triton, key, value, slots)
    keep = slots >= 0
    write_kv(kv_ref, key[keep], value[keep], slots[keep])
    assert torch.equal(kv_triton, kv_ref)
    flat = kv_triton.view(2, -1, num_kv_heads, head_dim)
    assert torch.equal(flat[0, 9], key[4]) and torch.equal(flat[1, 3], value[6])


def test_write_kv_triton_converts_to_cache_dtype():
    kv = torch.zeros((2, 2, 16, 1, 64), dtype=torch.float16)
    key, value = torch.randn((3, 1, 64)), torch.randn((3, 1, 64))
    slots = torch.tensor([0, 17, 31], dtype=torch.int64)
    write_kv_triton(kv, key, value, slots)
    flat = kv.view(2, -1, 1, 64)
    assert torch.equal(flat[0, slots], key.half()) and torch.equal(flat[1, slots], value.half())


@pytest.fixture
def backend(monkeypatch):
    """Set PAGEWIRE_ATTENTION_BACKEND for one test (the value is cached after the first read)."""

    def set_backend(value: str) -> None:
        monkeypatch.setenv("PAGEWIRE_ATTENTION_BACKEND", value)
        paged.attention_backend.cache_clear()

    yield set_backend
    monkeypatch.delenv("PAGEWIRE_ATTENTION_BACKEND", raising=False)
    paged.attention_backend.cache_clear()


def test_dispatch_follows_the_backend_variable(backend, monkeypatch):
    from worker_svc.cpu.attention import kernel

    block_size, num_kv_heads, head_dim = 16, 1, 64
    meta, _ = make_batch([5, 1], [21, 16], block_size, num_blocks=5)
    kv_ref = torch.randn((2, 5, block_size, num_kv_heads, head_dim))  # the cached context
    kv_triton = kv_ref.clone()
    key, value = torch.randn((2, 6, num_kv_heads, head_dim))
    query = torch.randn((6, 3, head_dim))
    write_kv(kv_ref, key, value, meta.slot_mapping)
    expected = paged_attention_ref(query, kv_ref, meta, 0.125)

    backend("triton")
    monkeypatch.setattr(paged, "paged_attention_ref", _must_not_run)
    # a padding token with slot -1 (only the Triton append accepts it)
    padded_slots = torch.cat((meta.slot_mapping, torch.tensor([-1])))
    paged.write_kv(kv_triton, torch.cat((key, key[:1])), torch.cat((value, value[:1])), padded_slots)
    assert torch.equal(kv_triton, kv_ref)
    torch.testing.assert_close(paged.paged_attention(query, kv_triton, meta, 0.125), expected, atol=2e-5, rtol=0)

    backend("torch")  # always the reference
    with pytest.raises(AssertionError, match="reference"):
        paged.paged_attention(query, kv_triton, meta, 0.125)
    backend("auto")  # CPU tensors: the reference until the worker registers its C kernel
    # a worker started earlier in this process (an LLM in another test) may have registered it
    monkeypatch.setattr(paged, "_load_cpu_attention", None)
    with pytest.raises(AssertionError, match="reference"):
        paged.paged_attention(query, kv_triton, meta, 0.125)
    paged.use_cpu_attention(kernel)  # then the C kernel (tests/test_cpu_kernels.py checks that it builds here)
    torch.testing.assert_close(paged.paged_attention(query, kv_triton, meta, 0.125), expected, atol=2e-5, rtol=0)

    backend("cuda")
    with pytest.raises(ValueError, match="PAGEWIRE_ATTENTION_BACKEND"):
        paged.paged_attention(query, kv_triton, meta, 0.125)


def _must_not_run(*args, **kwargs):
    raise AssertionError("the torch reference ran")


# Compiles (without running) the kernels for an H100 the way the JIT would at launch, in a process where
# the interpreter is off: it catches what the interpreter accepts but the compiler does not (loop-carried
# types, dot shapes, shared memory over the SM's 227 KiB).
_COMPILE_FOR_HOPPER = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kvcache.triton_append import _write_kv_kernel
from kvcache.triton_attention import _kernel_config, _merge_splits_kernel, _paged_attention_kernel

POINTERS = {"part_m_ptr": "fp32", "part_l_ptr": "fp32", "part_acc_ptr": "fp32", "block_tables_ptr": "i32",
            "query_start_loc_ptr": "i32", "seq_lens_ptr": "i32", "slot_mapping_ptr": "i64"}

def compile_kernel(kernel, dtype, constexprs, num_warps, num_stages=2):
    signature, attrs = {}, {}
    for i, param in enumerate(kernel.params):
        name = param.name
        if param.is_constexpr:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = "*" + POINTERS.get(name, dtype)
            attrs[(i,)] = [["tt.divisibility", 16]]  # torch allocations are 16-byte aligned
        else:
            signature[name] = "fp32" if name == "qk_scale" else "i32"
            if name.startswith("stride"):
                attrs[(i,)] = [["tt.divisibility", 16]]  # head_dim 64 / 128: every stride is a multiple of 16
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": num_stages})
    return {"shared": compiled.metadata.shared, "cubin": len(compiled.asm["cubin"])}

results = {}
for dtype, group, head_dim, decode_like, splits in [("bf16", 3, 64, True, 3), ("fp16", 8, 128, False, 1), ("fp32", 3, 64, False, 2)]:
    group_pad = 1 << (group - 1).bit_length()
    block_m, block_n, num_warps, num_stages = _kernel_config(decode_like, group_pad, head_dim, dtype == "fp32")
    constexprs = dict(GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_m // group_pad, BLOCK_M=block_m, BLOCK_N=block_n,
                      HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim, BLOCK_SIZE=16, SPLIT=splits > 1, ONE_BLOCK_PER_SEQ=decode_like,
                      DOT_PRECISION="tf32x3" if dtype == "fp32" else "tf32", DOT_UPCAST=False)
    results[f"attention-{dtype}"] = compile_kernel(_paged_attention_kernel, dtype, constexprs, num_warps, num_stages)
results["merge"] = compile_kernel(_merge_splits_kernel, "bf16", dict(HEAD_DIM=64, HEAD_DIM_PAD=64, SPLITS_PAD=16), 1)
results["append"] = compile_kernel(_write_kv_kernel, "bf16", dict(HEAD_DIM=64, HEAD_DIM_PAD=64, HEADS_PER_PROGRAM=4, BLOCK_SIZE=16), 1)
print(json.dumps(results))
"""


@pytest.mark.slow
def test_kernels_compile_for_hopper(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    if not (Path(triton.__file__).parent / "backends" / "nvidia").is_dir():
        pytest.skip("this triton has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # triton 3.9 warns when it is unset
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compile from scratch, write nothing outside the test
    done = subprocess.run(
        [sys.executable, "-c", _COMPILE_FOR_HOPPER],
        cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(results) == {"attention-bf16", "attention-fp16", "attention-fp32", "merge", "append"}
    for name, result in results.items():
        assert result["cubin"] > 0 and result["shared"] <= 227 * 1024, (name, result)
