"""Triton paged attention for the flattened mixed batch (prefill chunks and decodes in one launch).

Same contract as ``kvcache.paged.paged_attention_ref``: query [T, H, D] -> out [T, H, D]; sequence s owns
query rows ``query_start_loc[s] .. query_start_loc[s+1]`` and its q_len queries are the last q_len of its
seq_len context (query i sits at position seq_len - q_len + i, causal inside the chunk). Keys and values
are read through the block table from ``kv_layer`` [2, num_blocks, block_size, Hkv, D].

Grid: (query block, kv head, key split).
  * A *query block* is BLOCK_Q consecutive query tokens of one sequence together with all
    G = H / Hkv query heads that share the kv head, i.e. BLOCK_M = BLOCK_Q * G_PAD rows (G padded to a
    power of two). Every K/V tile is loaded once for the whole group and fed to ``tl.dot``.
  * Query blocks are numbered without a host loop: sequence s's blocks start at the virtual index
    ``query_start_loc[s] // BLOCK_Q + s``, which is >= the true count of earlier blocks, so the grid
    ``T // BLOCK_Q + S`` covers every block; a program finds its sequence by binary search over
    ``query_start_loc`` and exits when its local block is past the sequence's queries (at most S idle
    programs). Nothing is read back to the host. When every sequence fits in one query block (decode
    batches), program i simply is sequence i and the grid is S.
  * Key splits (flash-decoding): with num_splits > 1, each program walks only its share of the query
    block's key tiles and writes an unnormalized partial (running max m, sum l, accumulator) to fp32
    scratch; a second kernel merges the splits of every (token, head). See ``choose_num_splits``.

Softmax runs online in the exp2 domain with fp32 statistics and accumulator, whatever the input dtype.
On CPU tensors the same kernels run under Triton's interpreter (TRITON_INTERPRET=1; slow, for tests).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kvcache.attention_metadata import AttentionMetadata

_LOG2E = 1.4426950408889634

# Split heuristic knobs (see choose_num_splits).
_TARGET_PROGRAMS_PER_SM = 4  # enough resident programs per SM to hide memory latency and even out the tail
_MIN_KEYS_PER_SPLIT = 256  # below this a split's fixed cost (q load, partial write, merge) is not worth it
_MAX_SPLITS = 16


def check_device(device: torch.device) -> None:
    """Kernels run on GPU tensors, or on CPU tensors under Triton's interpreter. The interpreter must be
    on (TRITON_INTERPRET=1) before ``triton`` is first imported: Triton's own jit'd helpers
    (``tl.cdiv``, ``tl.max``, ...) are decorated at import time and only run interpreted if so."""
    if device.type == "cpu" and type(tl.cdiv).__name__ != "InterpretedFunction":
        raise RuntimeError(
            "Triton kernels on CPU tensors need TRITON_INTERPRET=1 in the environment before triton is imported"
        )


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1  # the interpreter runs programs one after another: extra programs buy nothing


def choose_num_splits(num_programs: int, max_seq_len: int, num_sms: int) -> int:
    """How many key partitions each (query block, kv head) gets.

    Split only when the unsplit grid leaves the GPU underfilled (clearly fewer than 4 programs per
    SM) and sequences are long enough that every split still walks >= 256 keys:
        splits = min(round(4 * num_sms / num_programs), max_seq_len // 256, 16), at least 1.
    Rounded, not ceiled: a grid just short of 4 per SM runs best unsplit (on an H200, 132 SMs, 64
    decodes x 2,048 keys of Llama-3.2-1B's 8 kv heads, 512 programs: 73 us unsplit, 83 us in 2).
    E.g. 64 decodes x 2,048 keys with 3 kv heads (192 programs) -> 3 splits; with 12 kv heads
    (768 programs) -> 1; one decode of 32k keys with 8 kv heads -> 16 (the cap).
    """
    wanted = int(_TARGET_PROGRAMS_PER_SM * num_sms / max(1, num_programs) + 0.5)
    return max(1, min(wanted, max_seq_len // _MIN_KEYS_PER_SPLIT, _MAX_SPLITS))


class Tiles(NamedTuple):
    """Tile sizes and launch shape of the attention kernel (``_kernel_config`` picks them; the
    bandwidth benchmark's ``--sweep`` and the tests pass their own)."""

    block_m: int  # rows per program: query tokens x padded group heads (raised to the group if smaller)
    block_n: int  # keys per tile
    num_warps: int
    num_stages: int


@functools.cache
def _kernel_config(decode_like: bool, group_pad: int, head_dim_pad: int, is_fp32: bool) -> Tiles:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for the launch.

    Decode-like batches (each sequence has at most a few queries) take 16 rows, the smallest ``tl.dot``
    tile, so that a decode wastes little; chunked prefill takes 64 rows (a Hopper warpgroup MMA). Key
    tiles of 64 keep enough bytes in flight per iteration to stream K/V at memory bandwidth. fp32 runs
    its dots as 3xTF32, which needs about twice the registers: smaller tiles. Checked by compiling for
    sm_90 (ptxas): 16-bit inputs 72-190 registers, fp32 123-255, no spills, for head_dim 64-256.
    ``plan_launch`` widens a long GQA decode's key tiles (see ``_wide_key_tiles``).
    """
    if is_fp32:
        block_m = 16 if decode_like else (64 if head_dim_pad <= 64 else 32)
        block_n, num_warps, num_stages = 32, 4, 2
    elif decode_like:
        block_m, num_warps, num_stages = 16, 4, 3
        block_n = 64 if head_dim_pad <= 128 else 32
    else:
        block_m, num_stages = 64, 2
        block_n, num_warps = (64, 4) if head_dim_pad <= 128 else (32, 8)
    return Tiles(block_m, block_n, num_warps, num_stages)


# Triton compiles a kernel per value class of each integer argument (1, a multiple of 16, the rest).
# The integers that change from step to step, or that the warm-up's dummy batch cannot match (the
# query's and block table's strides), are left unspecialized: a step of a new shape must not wait for
# a compile. The cache's strides stay specialized (the K/V loads are vectorized on them), and
# ``warm_up`` runs on the cache itself. What does select a variant is a constexpr, and ``warm_up``
# compiles them all.
@triton.jit(do_not_specialize=["num_seqs", "num_splits", "num_heads", "stride_qt", "stride_qh", "stride_ot",
                               "stride_oh", "stride_bt"])
def _paged_attention_kernel(
    out_ptr,  # [T, H, D] (not SPLIT)
    part_m_ptr,  # [T, H, num_splits] fp32 running max (log2 domain) per split (SPLIT)
    part_l_ptr,  # [T, H, num_splits] fp32 running sum
    part_acc_ptr,  # [T, H, num_splits, HEAD_DIM_PAD] fp32 unnormalized output
    q_ptr,  # [T, H, D]
    kv_ptr,  # [2, num_blocks, block_size, Hkv, D]
    block_tables_ptr,  # [S, max_blocks] int32
    query_start_loc_ptr,  # [S+1] int32
    seq_lens_ptr,  # [S] int32
    qk_scale,  # softmax scale * log2(e)
    num_seqs,
    num_splits,  # key partitions (1 unless SPLIT)
    num_heads,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kv,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_bt,
    GROUP: tl.constexpr,  # query heads per kv head
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,  # query tokens per program; BLOCK_M = BLOCK_Q * GROUP_PAD
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,  # keys per tile
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # cache block size
    SPLIT: tl.constexpr,  # num_splits > 1: write partials for the merge kernel
    ONE_BLOCK_PER_SEQ: tl.constexpr,  # max_query_len <= BLOCK_Q: query block i is sequence i, no search
    DOT_PRECISION: tl.constexpr,  # "tf32x3" for fp32 inputs (fp32-grade accuracy on tensor cores)
    DOT_UPCAST: tl.constexpr,  # feed tl.dot fp32 (only for bf16 under the interpreter, whose bf16 dot is broken)
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    if ONE_BLOCK_PER_SEQ:
        seq = q_block
        q_start = tl.load(query_start_loc_ptr + seq)
        q_block_local = 0
    else:
        # Sequence of this query block: the last s with query_start_loc[s] // BLOCK_Q + s <= q_block.
        lo = 0
        hi = num_seqs
        while lo < hi:
            mid = (lo + hi) // 2
            if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= q_block:
                lo = mid + 1
            else:
                hi = mid
        seq = lo - 1
        q_start = tl.load(query_start_loc_ptr + seq)
        q_block_local = q_block - (q_start // BLOCK_Q + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_block_local * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len  # keys before this step's first query

    rows = tl.arange(0, BLOCK_M)
    q_idx = q_block_local * BLOCK_Q + rows // GROUP_PAD  # query index inside the chunk
    head_in_group = rows % GROUP_PAD
    head = kv_head * GROUP + head_in_group
    row_valid = (q_idx < q_len) & (head_in_group < GROUP)
    q_pos = ctx_len + q_idx  # absolute position: sees keys 0 .. q_pos
    token = (q_start + q_idx).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM

    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
        mask=row_valid[:, None] & dim_valid[None, :],
        other=0.0,
    )  # [BLOCK_M, HEAD_DIM_PAD]
    if DOT_UPCAST:
        q = q.to(tl.float32)

    # Keys visible to the block's last query, split evenly (in whole tiles) across num_splits programs.
    kv_end = tl.minimum(ctx_len + (q_block_local + 1) * BLOCK_Q, seq_len)
    num_tiles = tl.cdiv(kv_end, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    kv_head_ptr = kv_ptr + kv_head.to(tl.int64) * stride_kh
    cols = tl.arange(0, BLOCK_N)
    for tile in range(tile_lo, tile_hi):
        k_pos = tile * BLOCK_N + cols
        k_valid = k_pos < kv_end
        block_ids = tl.load(block_table + k_pos // BLOCK_SIZE, mask=k_valid, other=0).to(tl.int64)
        slot_off = block_ids * stride_kb + (k_pos % BLOCK_SIZE) * stride_ks  # [BLOCK_N]
        kv_mask = k_valid[:, None] & dim_valid[None, :]
        k = tl.load(kv_head_ptr + slot_off[:, None] + dims[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, D]
        v = tl.load(kv_head_ptr + stride_kv + slot_off[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        if DOT_UPCAST:
            k = k.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        visible = (k_pos[None, :] <= q_pos[:, None]) & k_valid[None, :]
        qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet stays finite
        p = tl.exp2(qk - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        p = p.to(v.dtype)
        if DOT_UPCAST:
            p = p.to(tl.float32)
            v = v.to(tl.float32)
        acc = tl.dot(p, v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new

    if not SPLIT:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None] & dim_valid[None, :],
        )
    else:
        part = (token * num_heads + head) * num_splits + split  # [BLOCK_M]
        tl.store(part_m_ptr + part, m_i, mask=row_valid)
        tl.store(part_l_ptr + part, l_i, mask=row_valid)
        tl.store(
            part_acc_ptr + part[:, None] * HEAD_DIM_PAD + dims[None, :],
            acc,
            mask=row_valid[:, None],
        )


@triton.jit(do_not_specialize=["num_splits", "num_heads", "stride_ot", "stride_oh"])
def _merge_splits_kernel(
    out_ptr,  # [T, H, D]
    part_m_ptr,  # [T, H, num_splits]
    part_l_ptr,
    part_acc_ptr,  # [T, H, num_splits, HEAD_DIM_PAD]
    num_splits,
    num_heads,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,  # >= num_splits: the most splits there can be
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    split_valid = splits < num_splits
    dims = tl.arange(0, HEAD_DIM_PAD)
    part = (token * num_heads + head) * num_splits + splits  # [SPLITS_PAD]
    m = tl.load(part_m_ptr + part, mask=split_valid, other=float("-inf"))
    l = tl.load(part_l_ptr + part, mask=split_valid, other=0.0)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM_PAD + dims[None, :], mask=split_valid[:, None], other=0.0)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_max)  # a split that saw no key has m = -inf: weight 0
    total = tl.sum(w * l, 0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )


# A 16-bit decode program whose padded group holds >= 4 query heads and walks >= this many keys
# reads 128-key tiles. Measured on an H200 (bf16, head_dim 64, 64 decodes x 2,048 keys, CUDA graphs):
# Llama-3.2-1B's 32/8 heads unsplit 73.2 us with 64-key tiles, 66.9 us with 128 (84% of peak);
# shorter walks (SmolLM2's 9/3 in 3 splits of 683 keys: 32.4 vs 33.3 us) and one head per group
# (GPT-2's 12/12: 96.8 vs 126.5 us) are better with 64.
_WIDE_TILE_MIN_KEYS = 1024


def _wide_key_tiles(tiles: Tiles, decode_like: bool, group_pad: int, head_dim_pad: int, is_fp32: bool,
                    keys_per_split: int) -> Tiles:
    if decode_like and not is_fp32 and group_pad >= 4 and head_dim_pad <= 64 and keys_per_split >= _WIDE_TILE_MIN_KEYS:
        return tiles._replace(block_n=128)
    return tiles


class LaunchPlan(NamedTuple):
    """Tile sizes and grid of one attention launch."""

    group: int  # query heads per kv head
    group_pad: int
    head_dim_pad: int
    block_m: int  # rows per program: block_q query tokens x group_pad heads
    block_q: int
    block_n: int  # keys per tile
    num_warps: int
    num_stages: int
    one_block_per_seq: bool  # every sequence fits one query block: program i is sequence i
    grid_blocks: int  # query-block programs in the grid (an upper bound unless one_block_per_seq)
    num_splits: int  # key partitions per query block


def plan_launch(
    query: torch.Tensor, num_kv_heads: int, meta: AttentionMetadata, num_splits: int | None = None,
    tiles: Tiles | None = None,
) -> LaunchPlan:
    """Choose tiles, grid and key splits from the batch shape (host integers only, no device sync);
    ``num_splits`` and ``tiles`` override the choice."""
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = meta.seq_lens.shape[0]
    group = num_heads // num_kv_heads
    group_pad = _next_pow2(group)
    head_dim_pad = _next_pow2(max(head_dim, 16))
    decode_like = meta.max_query_len * group_pad <= 16
    is_fp32 = query.dtype == torch.float32
    chosen_tiles = tiles is None
    if chosen_tiles:
        tiles = _kernel_config(decode_like, group_pad, head_dim_pad, is_fp32)
    block_m, block_n, num_warps, num_stages = tiles
    block_m = max(block_m, group_pad)
    block_q = block_m // group_pad
    one_block_per_seq = meta.max_query_len <= block_q
    if one_block_per_seq:
        grid_blocks = busy_blocks = num_seqs
    else:
        # Upper bound on query blocks (see the module docstring); busy ones: at most S * ceil(max_q / BLOCK_Q).
        grid_blocks = num_tokens // block_q + num_seqs
        busy_blocks = min(grid_blocks, num_seqs * -(-meta.max_query_len // block_q))
    if num_splits is None:
        num_splits = choose_num_splits(busy_blocks * num_kv_heads, meta.max_seq_len, _num_sms(query.device))
    num_splits = max(1, min(num_splits, -(-meta.max_seq_len // block_n), _MAX_SPLITS))  # the merge reads up to 16
    if chosen_tiles:
        block_n = _wide_key_tiles(tiles, decode_like, group_pad, head_dim_pad, is_fp32,
                                  meta.max_seq_len // num_splits).block_n
    return LaunchPlan(
        group, group_pad, head_dim_pad, block_m, block_q, block_n, num_warps, num_stages,
        one_block_per_seq, grid_blocks, num_splits,
    )


def paged_attention_triton(
    query: torch.Tensor,  # [T, H, D]
    kv_layer: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    meta: AttentionMetadata,
    scale: float,
    *,
    num_splits: int | None = None,
    tiles: Tiles | None = None,
) -> torch.Tensor:
    """Paged attention in one launch (two when the key range is split). ``num_splits`` overrides
    ``choose_num_splits`` (tests force both paths with it), ``tiles`` overrides ``_kernel_config``."""
    num_tokens, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, kv_head_dim = kv_layer.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if kv_head_dim != head_dim or kv_layer.dtype != query.dtype:
        raise ValueError(
            f"query {tuple(query.shape)} {query.dtype} does not match kv_layer {tuple(kv_layer.shape)} {kv_layer.dtype}"
        )
    if query.stride(-1) != 1 or kv_layer.stride(-1) != 1:
        raise ValueError("query and kv_layer must be contiguous in the head dimension")
    check_device(query.device)
    out = torch.empty_like(query)
    num_seqs = meta.seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out

    plan = plan_launch(query, num_kv_heads, meta, num_splits, tiles)
    num_splits, head_dim_pad = plan.num_splits, plan.head_dim_pad
    if num_splits > 1:
        part_m = torch.empty((num_tokens, num_heads, num_splits), dtype=torch.float32, device=query.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty((num_tokens, num_heads, num_splits, head_dim_pad), dtype=torch.float32, device=query.device)
    else:
        part_m = part_l = part_acc = out  # unused

    # The interpreter's tl.dot mishandles bf16 (it multiplies the raw bits): feed it fp32 there instead.
    interpreted = query.device.type == "cpu"
    _paged_attention_kernel[(plan.grid_blocks, num_kv_heads, num_splits)](
        out,
        part_m,
        part_l,
        part_acc,
        query,
        kv_layer,
        meta.block_tables,
        meta.query_start_loc,
        meta.seq_lens,
        scale * _LOG2E,
        num_seqs,
        num_splits,
        num_heads,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        kv_layer.stride(0),
        kv_layer.stride(1),
        kv_layer.stride(2),
        kv_layer.stride(3),
        meta.block_tables.stride(0),
        GROUP=plan.group,
        GROUP_PAD=plan.group_pad,
        BLOCK_Q=plan.block_q,
        BLOCK_M=plan.block_m,
        BLOCK_N=plan.block_n,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size,
        SPLIT=num_splits > 1,
        ONE_BLOCK_PER_SEQ=plan.one_block_per_seq,
        DOT_PRECISION="tf32x3" if query.dtype == torch.float32 else "tf32",
        DOT_UPCAST=interpreted and query.dtype == torch.bfloat16,
        num_warps=plan.num_warps,
        num_stages=plan.num_stages,
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            out,
            part_m,
            part_l,
            part_acc,
            num_splits,
            num_heads,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            SPLITS_PAD=_next_pow2(_MAX_SPLITS),
            num_warps=1 if head_dim_pad <= 64 else 2,
        )
    return out


def warm_up(num_heads: int, kv_layer: torch.Tensor) -> int:
    """Compile every kernel variant that attention over ``kv_layer`` (one layer of the cache,
    [2, num_blocks, block_size, Hkv, D]) with ``num_heads`` query heads can launch, so that no step
    waits for Triton's compiler (hundreds of milliseconds each on a fresh machine): decodes, prefill
    chunks of one query block and of several, each unsplit and split, and the wide key tiles of long
    GQA decodes. One sequence per variant reads blocks of the cache itself (its strides are what the
    kernels specialize on) and the output is dropped. Returns the number of launches."""
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_layer.shape
    dtype, device = kv_layer.dtype, kv_layer.device
    check_device(device)
    group_pad = _next_pow2(num_heads // num_kv_heads)
    head_dim_pad = _next_pow2(max(head_dim, 16))
    is_fp32 = dtype == torch.float32
    prefill = _kernel_config(False, group_pad, head_dim_pad, is_fp32)
    prefill_block_q = max(prefill.block_m, group_pad) // group_pad
    decode = _kernel_config(True, group_pad, head_dim_pad, is_fp32)
    wide = _wide_key_tiles(decode, True, group_pad, head_dim_pad, is_fp32, _WIDE_TILE_MIN_KEYS)
    seq_len = prefill_block_q + 1 + 2 * max(decode.block_n, wide.block_n)  # room for 2 splits of whole tiles
    blocks = -(-seq_len // block_size)
    # any blocks of the cache (block 0 pads table rows, so from 1 on; repeated when the cache is small)
    block_table = (torch.arange(blocks, dtype=torch.int32, device=device) % max(num_blocks - 1, 1) + 1)[None, :]
    variants = [(1, decode)] + ([(1, wide)] if wide != decode else []) + [(prefill_block_q, None), (prefill_block_q + 1, None)]
    launches = 0
    for q_len, tiles in variants:
        meta = AttentionMetadata(
            slot_mapping=torch.zeros(q_len, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor([0, q_len], dtype=torch.int32, device=device),
            seq_lens=torch.tensor([seq_len], dtype=torch.int32, device=device),
            block_tables=block_table, max_query_len=q_len, max_seq_len=seq_len,
            query_lens_cpu=[q_len], seq_lens_cpu=[seq_len],
            logits_indices=torch.tensor([q_len - 1], dtype=torch.int64, device=device),
        )
        query = torch.zeros((q_len, num_heads, head_dim), dtype=dtype, device=device)
        for num_splits in (1, 2):
            paged_attention_triton(query, kv_layer, meta, head_dim**-0.5, num_splits=num_splits, tiles=tiles)
            launches += 1
    return launches


__all__ = ["LaunchPlan", "Tiles", "check_device", "choose_num_splits", "paged_attention_triton", "plan_launch", "warm_up"]
