"""Triton batched KV append: every scheduled token's K and V into its cache slot, one launch per layer.

Same semantics as ``kvcache.paged.write_kv`` (slot = block_id * block_size + offset; a token that rolls
over into a new block is just a slot in that block), plus one addition: a **negative slot is skipped**.
Padded batches (CUDA-graph replays run a fixed token count; the padding tokens get slot -1) therefore
write nothing for their padding. The torch reference does not skip negative slots (checking for them
would cost the CPU path a pass over the slots), so padded batches need this kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcache.triton_attention import check_device

_MAX_ELEMENTS_PER_PROGRAM = 4096  # K or V elements one program copies (e.g. 32 heads x 128 dims)


@triton.jit
def _write_kv_kernel(
    kv_ptr,  # [2, num_blocks, block_size, Hkv, D]
    key_ptr,  # [T, Hkv, D]
    value_ptr,  # [T, Hkv, D]
    slot_mapping_ptr,  # [T] int64; < 0: skip the token
    num_kv_heads,
    stride_kv,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_key_t,
    stride_key_h,
    stride_value_t,
    stride_value_h,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    HEADS_PER_PROGRAM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # cache block size
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    heads = tl.program_id(1) * HEADS_PER_PROGRAM + tl.arange(0, HEADS_PER_PROGRAM)
    dims = tl.arange(0, HEAD_DIM_PAD)
    mask = (heads < num_kv_heads)[:, None] & (dims < HEAD_DIM)[None, :]
    dst = kv_ptr + (slot // BLOCK_SIZE) * stride_kb + (slot % BLOCK_SIZE) * stride_ks
    dst = dst + heads[:, None] * stride_kh + dims[None, :]  # [HEADS_PER_PROGRAM, HEAD_DIM_PAD]
    key = tl.load(key_ptr + token * stride_key_t + heads[:, None] * stride_key_h + dims[None, :], mask=mask)
    value = tl.load(value_ptr + token * stride_value_t + heads[:, None] * stride_value_h + dims[None, :], mask=mask)
    tl.store(dst, key.to(kv_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_kv, value.to(kv_ptr.dtype.element_ty), mask=mask)


def write_kv_triton(kv_layer: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """key/value [T, Hkv, D] into ``kv_layer`` [2, num_blocks, block_size, Hkv, D] at ``slot_mapping`` [T];
    tokens with a negative slot are skipped. Slots must be distinct (as in the torch reference)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    _, _, block_size, cache_kv_heads, cache_head_dim = kv_layer.shape
    if (cache_kv_heads, cache_head_dim) != (num_kv_heads, head_dim) or value.shape != key.shape:
        raise ValueError(f"key {tuple(key.shape)} / value {tuple(value.shape)} do not fit kv_layer {tuple(kv_layer.shape)}")
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping has shape {tuple(slot_mapping.shape)}, expected ({num_tokens},)")
    if key.stride(-1) != 1 or value.stride(-1) != 1 or kv_layer.stride(-1) != 1:
        raise ValueError("key, value and kv_layer must be contiguous in the head dimension")
    check_device(kv_layer.device)
    if num_tokens == 0:
        return
    head_dim_pad = triton.next_power_of_2(head_dim)
    heads_per_program = min(triton.next_power_of_2(num_kv_heads), max(1, _MAX_ELEMENTS_PER_PROGRAM // head_dim_pad))
    grid = (num_tokens, triton.cdiv(num_kv_heads, heads_per_program))
    _write_kv_kernel[grid](
        kv_layer,
        key,
        value,
        slot_mapping,
        num_kv_heads,
        kv_layer.stride(0),
        kv_layer.stride(1),
        kv_layer.stride(2),
        kv_layer.stride(3),
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        HEADS_PER_PROGRAM=heads_per_program,
        BLOCK_SIZE=block_size,
        num_warps=4 if heads_per_program * head_dim_pad >= 1024 else 1,
    )


__all__ = ["write_kv_triton"]
