"""Attention over the paged KV cache, shared by all models."""

from __future__ import annotations

import torch
from torch import nn

from kvcache.paged import AttentionMetadata, paged_attention, write_kv


class PagedAttention(nn.Module):
    """Writes this step's K/V into the cache (one scatter), then attends through the block tables.

    The write comes first so that a chunk attends to itself through the cache.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    def forward(
        self,
        query: torch.Tensor,  # [T, H, D]
        key: torch.Tensor,  # [T, Hkv, D]
        value: torch.Tensor,  # [T, Hkv, D]
        kv_layer: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        write_kv(kv_layer, key, value, meta.slot_mapping)
        out = paged_attention(query, kv_layer, meta, self.scale)  # [T, H, D]
        return out.reshape(out.shape[0], self.num_heads * self.head_dim)
