"""Physical paged KV cache: the K/V tensors, the batched append, block copies and paged attention.

The scheduler owns block *allocation* (kvcache.allocator); this module only holds the tensors and
applies what a step plan says. A token's K/V lives at a *slot*: ``block_id * block_size + offset``.
``AttentionMetadata`` (``kvcache.attention_metadata``) is re-exported here for the model code.

Attention dispatches to the Triton kernels (``kvcache.triton_*``) on CUDA, to a C kernel on CPU,
else to the torch reference here. The C kernel belongs to the worker's CPU package
(``worker_svc.cpu.attention``: its source, its build, the ISA it is built for), and kvcache never
imports the worker: the worker hands this module the kernel's loader at start-up
(:func:`use_cpu_attention`, from ``worker_svc.cpu.prepare.prepare_model``). Until then, and in a process
that never registers one, CPU attention is the torch reference. The same registration says whether
every chunk goes to the kernel (``--deterministic``) or prefill chunks of more than 32 queries go to
torch's SDPA, which rounds differently in bf16.
"""

from __future__ import annotations

import functools
import sys
from typing import Callable, NamedTuple, Protocol

import torch
import torch.nn.functional as F

from kvcache.attention_metadata import AttentionMetadata
from pagewire_common import envs


class PagedKVCache:
    """K/V for all layers: kv[layer] has shape [2, num_blocks, block_size, num_kv_heads, head_dim].

    All layers live in one tensor ``kv`` of shape [num_layers, 2, num_blocks, block_size, Hkv, D], so a
    block copy for every layer is a single gather + scatter over the block dimension.
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        for name, value in (
            ("num_layers", num_layers),
            ("num_blocks", num_blocks),
            ("block_size", block_size),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
        ):
            if value <= 0:
                raise ValueError(f"PagedKVCache: {name} must be positive, got {value}")
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        # [L, 2, N, B, Hkv, D]; zeros so that padded (never written) slots hold finite values.
        self.kv = torch.zeros(
            (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim), dtype=dtype, device=self.device
        )

    def layer(self, i: int) -> torch.Tensor:
        """The [2, num_blocks, block_size, Hkv, D] view of layer ``i`` (contiguous)."""
        return self.kv[i]

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy block ``src`` to block ``dst`` in every layer, for each (src, dst) pair, in one op.

        All sources are read before any destination is written, so a block may be both a source and
        a destination in the same call. Destinations must be distinct.
        """
        if not copies:
            return
        pairs = torch.tensor(copies, dtype=torch.int64).to(self.device, non_blocking=True)  # [P, 2]
        src, dst = pairs[:, 0], pairs[:, 1]
        self.kv.index_copy_(2, dst, self.kv.index_select(2, src))

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes one block takes across all layers, K and V."""
        element_size = torch.empty((), dtype=dtype).element_size()
        return num_layers * 2 * block_size * num_kv_heads * head_dim * element_size

    @classmethod
    def num_blocks_for_budget(
        cls,
        budget_bytes: int,
        num_layers: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
    ) -> int:
        """How many whole blocks fit in ``budget_bytes`` (0 when not even one does)."""
        per_block = cls.bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype)
        return max(0, int(budget_bytes) // per_block)


def write_kv(kv_layer: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Batched append: key/value [T, Hkv, D] into their slots with one scatter for the layer.

    No per-sequence loop: a token that rolls over into a new block is just a slot in that block.
    Slots must be valid here; the Triton kernel (CUDA, or forced by PAGEWIRE_ATTENTION_BACKEND=triton)
    also skips negative slots, which padded (CUDA-graph) batches use for their padding tokens.
    """
    if uses_triton(kv_layer):
        return _triton_kernels().write_kv(kv_layer, key, value, slot_mapping)
    num_kv_heads, head_dim = kv_layer.shape[-2], kv_layer.shape[-1]
    flat = kv_layer.view(2, -1, num_kv_heads, head_dim)  # [2, num_slots, Hkv, D]
    flat.index_copy_(1, slot_mapping, torch.stack((key, value)).to(kv_layer.dtype))


def paged_attention(query: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """query [T, H, D] -> out [T, H, D] over the paged cache (H a multiple of Hkv), in the query's
    dtype. The cache may be bfloat16 under float32 queries (a bf16 model that computes in fp32).

    The dispatch point (see ``attention_backend``): the Triton kernel on CUDA, the C kernel
    (registered by the worker, :func:`use_cpu_attention`) for float32/bfloat16 on CPU, the torch
    reference otherwise.
    """
    if uses_triton(query):
        return _triton_kernels().paged_attention(query, kv_layer, meta, scale)
    cpu = _cpu_kernel_for(query.device, query.dtype, kv_layer.dtype)
    if cpu is not None:
        # Decodes and chunks of up to 32 queries in C; longer prefill chunks in torch's fused
        # SDPA, whose GEMM-shaped inner loops beat the kernel's per-query work over deep contexts.
        # Registered for every chunk (--deterministic), all in C: a sequence's rounding then does
        # not depend on how its prompt was chunked or how much of it a prefix-cache hit skipped.
        max_query_len = None if _cpu_attention_every_chunk else _CPU_KERNEL_MAX_QUERY_LEN
        out = cpu.paged_attention(
            query, kv_layer, meta.query_start_loc, meta.seq_lens, meta.block_tables, scale,
            max_query_len=max_query_len,
        )  # fmt: skip
        if max_query_len is not None:
            _attend_chunks(query, kv_layer, meta, scale, out, longer_than=max_query_len)
        return out
    return paged_attention_ref(query, kv_layer, meta, scale)


# Sequences with at most this many query tokens go to the C kernel on CPU; the kernel and SDPA
# break even at about 32 queries over a 500-token context (benchmarks/cpu_attention.py, avx2).
_CPU_KERNEL_MAX_QUERY_LEN = 32


_ATTENTION_BACKENDS = ("auto", "torch", "triton", "cpu")


@functools.cache
def attention_backend() -> str:
    """PAGEWIRE_ATTENTION_BACKEND, read once: ``auto`` (default: Triton kernels for CUDA tensors when
    Triton imports; the C kernel for float32/bfloat16 CPU tensors when the worker registered it
    and it builds; else the torch reference), ``torch`` (always the reference), ``triton`` (always
    the Triton kernels; on CPU tensors they run under Triton's interpreter, which must be switched
    on with TRITON_INTERPRET=1 before triton is imported; this is how tests exercise the dispatch)
    or ``cpu`` (the C kernel for CPU attention, an error when it is not registered or cannot be
    built; the append stays torch's scatter).
    Tests that change the variable call ``attention_backend.cache_clear()``."""
    backend = envs.attention_backend()
    if backend not in _ATTENTION_BACKENDS:
        raise ValueError(f"PAGEWIRE_ATTENTION_BACKEND={backend!r}; choose one of {', '.join(_ATTENTION_BACKENDS)}")
    return backend


def uses_triton(tensor: torch.Tensor) -> bool:
    """Whether attention and the KV append over ``tensor``'s device run the Triton kernels."""
    backend = attention_backend()
    if backend == "auto":
        return tensor.is_cuda and _triton_kernels() is not None
    return backend == "triton"


class CpuAttention(Protocol):
    """The C paged-attention kernel for CPU, as the dispatch calls it (``worker_svc.cpu.attention``)."""

    def supports(self, dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> bool: ...

    def paged_attention(
        self, query: torch.Tensor, kv_layer: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
        block_tables: torch.Tensor, scale: float, max_query_len: int | None = None, out: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


# The loader of the C kernel for CPU attention, set by the worker (use_cpu_attention); None: none.
_load_cpu_attention: Callable[[], CpuAttention | None] | None = None
# Set with it: True sends every chunk to the kernel, False only those of up to 32 queries.
_cpu_attention_every_chunk = False


def use_cpu_attention(load: Callable[[], CpuAttention | None] | None, *, every_chunk: bool = False) -> None:
    """Take the C kernel for CPU attention from ``load`` (the worker's, registered at its start:
    ``worker_svc.cpu.attention.kernel``), which builds or loads it on its first call, caches it,
    and returns None when it cannot be built. It is called when the backend first sends CPU queries
    to it (or at :func:`prepare_cpu_attention`). None unregisters it: the torch reference again.
    ``every_chunk`` (the worker's ``--deterministic``) sends prefill chunks of any length to the
    kernel too, not only those of up to 32 queries; each registration sets it anew."""
    global _load_cpu_attention, _cpu_attention_every_chunk
    _load_cpu_attention = load
    _cpu_attention_every_chunk = every_chunk


def prepare_cpu_attention(dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> str:
    """Build (or load) the registered C kernel now, at worker start, if the dispatch will use it for
    CPU queries of ``dtype`` over a cache of ``kv_dtype`` (default: the same), instead of during the
    first request. Returns the CPU attention path: ``"C kernel"`` or ``"torch reference"`` (or
    ``"triton"`` when forced)."""
    backend = attention_backend()
    if backend in ("torch", "triton"):
        return "torch reference" if backend == "torch" else "triton"
    return "C kernel" if _cpu_kernel_for(torch.device("cpu"), dtype, kv_dtype) is not None else "torch reference"


def _cpu_kernel_for(device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> CpuAttention | None:
    """The C kernel when the backend picks it for queries on ``device`` of ``dtype`` over a cache of
    ``kv_dtype`` (default: the same), else None."""
    backend = attention_backend()
    if backend == "torch" or device.type != "cpu":
        return None
    cpu = None if _load_cpu_attention is None else _load_cpu_attention()
    if backend == "cpu":
        if _load_cpu_attention is None:
            raise RuntimeError("PAGEWIRE_ATTENTION_BACKEND=cpu, but no CPU attention kernel is registered "
                               "(the worker registers it at start-up: kvcache.paged.use_cpu_attention)")
        if cpu is None:
            raise RuntimeError("PAGEWIRE_ATTENTION_BACKEND=cpu, but the CPU attention kernel could not be built (see the log)")
        if not cpu.supports(dtype, kv_dtype):
            raise ValueError(f"PAGEWIRE_ATTENTION_BACKEND=cpu takes float32 or bfloat16, got {dtype}")
        return cpu
    return cpu if cpu is not None and cpu.supports(dtype, kv_dtype) else None


def keep_triton_out() -> None:
    """Make ``import triton`` fail in this process, unless the backend is forced to ``triton``.

    For a worker whose model is not on CUDA: Triton's kernels never run there, yet torch imports
    the package whenever it is installed (``torch._dynamo`` does, and initializing parameters on
    the meta device pulls that in). Its nanobind extension then prints dozens of "leaked" lines
    when the process exits. A ``None`` entry in ``sys.modules`` makes the import raise
    ImportError, which torch and ``_triton_kernels`` take as "Triton is not installed"."""
    if attention_backend() != "triton" and "triton" not in sys.modules:
        sys.modules["triton"] = None


class _TritonKernels(NamedTuple):
    paged_attention: Callable[..., torch.Tensor]
    write_kv: Callable[..., None]


@functools.cache
def _triton_kernels() -> _TritonKernels | None:
    """The Triton kernels, or None when Triton does not import (``auto`` then keeps the reference;
    a forced ``triton`` backend re-raises the ImportError)."""
    try:
        from kvcache.triton_append import write_kv_triton
        from kvcache.triton_attention import paged_attention_triton
    except ImportError:
        if attention_backend() == "triton":
            raise
        return None
    return _TritonKernels(paged_attention_triton, write_kv_triton)


# Bound on gathered key positions per decode group ([S_group, max_len]), so that the padded gather of a
# large decode batch does not materialize the whole context of every sequence at once.
_DECODE_GATHER_TOKENS = 1 << 16


def paged_attention_ref(
    query: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Plain torch paged attention; CPU-friendly, the production path without a GPU kernel. The
    gathered K/V are cast to the query's dtype (a bfloat16 cache under float32 queries).

    Each sequence's queries are the last q_len positions of its context (seq_len - q_len .. seq_len - 1),
    causal inside the chunk; keys/values come from the cache through the block table (the step's own
    K/V must already be written). Decodes (q_len == 1) run together in one padded computation;
    longer chunks run one by one. Keys are gathered whole blocks at a time (contiguous copies, much
    faster than per-slot gathers) and positions past seq_len are masked.
    """
    num_heads = query.shape[1]
    num_kv_heads = kv_layer.shape[-2]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    out = torch.empty_like(query)
    starts = _attend_chunks(query, kv_layer, meta, scale, out, longer_than=1)
    decode_seqs = [seq for seq, q_len in enumerate(meta.query_lens_cpu) if q_len == 1]
    decode_rows = [starts[seq] for seq in decode_seqs]

    if decode_seqs:
        seq_lens = [meta.seq_lens_cpu[s] for s in decode_seqs]
        per_group = max(1, _DECODE_GATHER_TOKENS // max(seq_lens))
        for g in range(0, len(decode_seqs), per_group):
            rows = torch.tensor(decode_rows[g : g + per_group], dtype=torch.int64).to(query.device, non_blocking=True)
            out[rows] = _decode_attention(
                query[rows], kv_layer, meta.block_tables, decode_seqs[g : g + per_group], seq_lens[g : g + per_group], scale
            )
    return out


def _attend_chunks(
    query: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float, out: torch.Tensor, longer_than: int
) -> list[int]:
    """Fill ``out`` for every sequence with more than ``longer_than`` query tokens, one chunk at a
    time; returns each sequence's first query row."""
    starts = []
    start = 0
    for seq, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        starts.append(start)
        if q_len > longer_than:
            out[start : start + q_len] = _chunk_attention(
                query[start : start + q_len], kv_layer, meta.block_tables[seq], seq_len, scale
            )
        start += q_len
    if start != query.shape[0]:
        raise ValueError(f"query has {query.shape[0]} tokens but the metadata schedules {start}")
    return starts


def _chunk_attention(
    query: torch.Tensor,  # [q_len, H, D]
    kv_layer: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    block_table: torch.Tensor,  # [max_blocks] int32
    seq_len: int,
    scale: float,
) -> torch.Tensor:
    q_len, _, head_dim = query.shape
    block_size, num_kv_heads = kv_layer.shape[2], kv_layer.shape[3]
    num_blocks = -(-seq_len // block_size)
    blocks = block_table[:num_blocks].long()
    kv = kv_layer.index_select(1, blocks).view(2, -1, num_kv_heads, head_dim)[:, :seq_len].to(query.dtype)  # [2, seq_len, Hkv, D]
    key, value = kv[0].transpose(0, 1), kv[1].transpose(0, 1)  # [Hkv, seq_len, D]
    # 4-D with a batch of one: torch's fused CPU attention takes only 4-D inputs; 3-D ones (or GQA
    # on them) fall back to the math path, which was 2-3x slower for a chunk deep into a prompt.
    q = query.transpose(0, 1)[None]  # [1, H, q_len, D]
    key, value = key[None], value[None]  # [1, Hkv, seq_len, D]
    if q_len == seq_len:
        out = F.scaled_dot_product_attention(q, key, value, is_causal=True, scale=scale, enable_gqa=True)
    else:
        # Query i sits at position seq_len - q_len + i and sees keys 0 .. that position.
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        k_pos = torch.arange(seq_len, device=query.device)
        mask = k_pos[None, :] <= q_pos[:, None]  # [q_len, seq_len]
        out = F.scaled_dot_product_attention(q, key, value, attn_mask=mask[None, None], scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)  # [q_len, H, D]


def _decode_attention(
    query: torch.Tensor,  # [S, H, D]
    kv_layer: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [S_all, max_blocks] int32
    seqs: list[int],
    seq_lens: list[int],
    scale: float,
) -> torch.Tensor:
    device = query.device
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = kv_layer.shape[2], kv_layer.shape[3]
    num_blocks = -(-max(seq_lens) // block_size)
    padded_len = num_blocks * block_size
    seq_index = torch.tensor(seqs, dtype=torch.int64).to(device, non_blocking=True)
    lens = torch.tensor(seq_lens, dtype=torch.int64).to(device, non_blocking=True)
    blocks = block_tables.index_select(0, seq_index)[:, :num_blocks].long().flatten()  # [S * nb]
    # Padding entries of a block table point at block 0: gathered, then masked, never used as context.
    kv = kv_layer.index_select(1, blocks).view(2, num_seqs, padded_len, num_kv_heads, head_dim).to(query.dtype)
    key, value = kv[0].transpose(1, 2), kv[1].transpose(1, 2)  # [S, Hkv, padded_len, D]
    valid = torch.arange(padded_len, device=device)[None, :] < lens[:, None]  # [S, padded_len]
    # GQA without repeating K/V: the group's query heads act as the query "length" of each KV head.
    q = query.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)  # [S, Hkv, G, D]
    out = F.scaled_dot_product_attention(q, key, value, attn_mask=valid[:, None, None, :], scale=scale)
    return out.reshape(num_seqs, num_heads, head_dim)
