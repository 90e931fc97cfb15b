"""The CPU paged-attention kernel (csrc/attention.c): built once, loaded with ctypes.

On CPU the torch reference gathers every sequence's blocks into padded tensors and then runs
SDPA: the context is copied, padded to the longest sequence, and read again. The C kernel reads
K/V in place through the block table, so a step's attention costs one pass over the context it
really has. That matters most in mixed steps, where decodes with long contexts ride alongside a
prefill chunk.

Built at first use and loaded by ``worker_svc.cpu.build`` (``-O3 -march=native -fopenmp``, cached
by source, flags, compiler and CPU). No compiler, or a failed build: :func:`kernel` returns None
with one warning, and attention stays on the torch reference.

``kvcache.paged`` owns the dispatch and the torch reference, and does not import the worker: the
worker registers :func:`kernel` there at start-up (``kvcache.paged.use_cpu_attention``).
"""

from __future__ import annotations

import ctypes
import functools
import pathlib

import torch

from worker_svc.cpu import build

_SOURCE = pathlib.Path(__file__).parent / "csrc" / "attention.c"
_ABI = 3
_ERRORS = {
    -1: "num_heads is not a multiple of num_kv_heads",
    -2: "query_start_loc does not span the query tokens",
    -3: "a sequence has more query tokens than context",
    -4: "a sequence's context needs more blocks than its block table row holds",
    -5: "a block table entry is outside the cache",
    -6: "out of memory for scratch buffers",
}


class AttentionKernel:
    """The loaded library, with a torch-facing call."""

    def __init__(self, lib: ctypes.CDLL, path: pathlib.Path):
        self.path = path
        f32, bf16 = torch.float32, torch.bfloat16
        # (query and output dtype, cache dtype) -> function
        self._fns = {
            (f32, f32): lib.paged_attention_f32,
            (bf16, bf16): lib.paged_attention_bf16,
            (f32, bf16): lib.paged_attention_f32_bf16kv,
        }
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        for fn in self._fns.values():
            fn.restype = ctypes.c_int
            fn.argtypes = [p, p, p, p, p, p, i64, i64, i64, i64, i64, i64, i64, i64, ctypes.c_float, i64]
        # the K/V append of a cache in the activations' dtype, for worker_svc.cpu.decode (raw pointers)
        self.kv_write = lib.kv_write
        self.kv_write.restype = ctypes.c_int
        self.kv_write.argtypes = [p, i64, i64, p, i64, p, i64, p, i64]

    def function(self, dtype: torch.dtype, kv_dtype: torch.dtype):
        """The raw C function for queries of ``dtype`` over a cache of ``kv_dtype`` (ctypes, pointers
        and sizes as :meth:`paged_attention` passes them)."""
        return self._fns[dtype, kv_dtype]

    def supports(self, dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> bool:
        """Whether queries of ``dtype`` attend over a cache of ``kv_dtype`` (default: the same)."""
        return (dtype, kv_dtype or dtype) in self._fns

    def paged_attention(
        self,
        query: torch.Tensor,  # [T, H, D]
        kv_layer: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        query_start_loc: torch.Tensor,  # [S + 1] int32
        seq_lens: torch.Tensor,  # [S] int32
        block_tables: torch.Tensor,  # [S, max_blocks] int32
        scale: float,
        max_query_len: int | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention for every query token, or, given ``max_query_len``, only for sequences with at
        most that many query tokens: the rows of longer chunks in ``out`` are left as they are
        (for the caller to fill)."""
        num_tokens, num_heads, head_dim = query.shape
        _, num_blocks, block_size, num_kv_heads, kv_dim = kv_layer.shape
        if kv_dim != head_dim:
            raise ValueError(f"query head_dim {head_dim} != cache head_dim {kv_dim}")
        if query.device.type != "cpu" or not self.supports(query.dtype, kv_layer.dtype):
            raise ValueError("the CPU kernel takes float32 or bfloat16 CPU tensors (float32 queries over a bfloat16 "
                             f"cache too), got {query.dtype}/{kv_layer.dtype}")
        num_seqs = seq_lens.shape[0]
        if query_start_loc.shape[0] != num_seqs + 1 or block_tables.shape[0] < num_seqs:
            raise ValueError("query_start_loc, seq_lens and block_tables disagree on the number of sequences")
        query = query.contiguous()
        kv_layer = kv_layer.contiguous()
        query_start_loc = query_start_loc.to(torch.int32).contiguous()
        seq_lens = seq_lens.to(torch.int32).contiguous()
        block_tables = block_tables.to(torch.int32).contiguous()
        if out is None:
            out = torch.empty_like(query)
        elif out.shape != query.shape or out.dtype != query.dtype or not out.is_contiguous():
            raise ValueError("out must be a contiguous tensor shaped and typed like query")
        rc = self._fns[query.dtype, kv_layer.dtype](
            query.data_ptr(), kv_layer.data_ptr(), out.data_ptr(),
            query_start_loc.data_ptr(), seq_lens.data_ptr(), block_tables.data_ptr(), block_tables.shape[1],
            num_seqs, num_tokens, num_heads, num_kv_heads, head_dim, num_blocks, block_size, scale,
            num_tokens if max_query_len is None else max_query_len,
        )  # fmt: skip
        if rc:
            raise ValueError(f"CPU paged attention: {_ERRORS.get(rc, f'error {rc}')}")
        return out


@functools.cache
def kernel() -> AttentionKernel | None:
    """The kernel, built on first call; None (after one warning) when it cannot be built."""
    lib = build.load(_SOURCE, "pagewire_cpu_kernels_abi", _ABI, "CPU attention uses the slower torch reference")
    return None if lib is None else AttentionKernel(lib, pathlib.Path(lib._name))
