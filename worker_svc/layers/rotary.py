"""Rotary position embeddings, Hugging Face Llama "rotate_half" convention."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def rope_inv_freq(head_dim: int, rope_theta: float, rope_scaling: dict[str, Any] | None) -> torch.Tensor:
    """[head_dim // 2] fp32 inverse frequencies, as transformers computes them (default or llama3)."""
    inv_freq = 1.0 / (rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope_scaling is None:
        return inv_freq
    if rope_scaling["rope_type"] != "llama3":
        raise ValueError(f"unsupported rope type {rope_scaling['rope_type']!r}; supported: default, llama3")
    # transformers.modeling_rope_utils._compute_llama3_parameters
    factor = rope_scaling["factor"]
    low_freq_factor = rope_scaling["low_freq_factor"]
    high_freq_factor = rope_scaling["high_freq_factor"]
    old_context_len = rope_scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to query and key by absolute position.

    cos/sin are computed once in fp32 up to ``max_position`` (half head_dim wide: the two halves of
    HF's duplicated table are equal) and cast with the module, which is what transformers does per call.
    """

    def __init__(self, head_dim: int, max_position: int, rope_theta: float, rope_scaling: dict[str, Any] | None):
        super().__init__()
        self.head_dim = head_dim
        self.max_position = max_position
        self.rope_theta = rope_theta
        self.rope_scaling = rope_scaling
        table = (max_position, head_dim // 2)
        self.register_buffer("cos_cache", torch.empty(table, dtype=torch.float32), persistent=False)
        self.register_buffer("sin_cache", torch.empty(table, dtype=torch.float32), persistent=False)
        if not self.cos_cache.is_meta:  # built on the meta device, the model computes them after to_empty
            self.reset_parameters()

    def _tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = rope_inv_freq(self.head_dim, self.rope_theta, self.rope_scaling)
        freqs = torch.outer(torch.arange(self.max_position, dtype=torch.float32), inv_freq)
        return freqs.cos(), freqs.sin()

    def reset_parameters(self) -> None:
        """Recompute the tables in place (after building the module on the meta device)."""
        cos, sin = self._tables()
        self.cos_cache.copy_(cos)
        self.sin_cache.copy_(sin)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> (cos, sin), each [T, 1, head_dim // 2] in ``dtype``; computed once per step
        and shared by all layers through :func:`apply_rotary`."""
        cos = self.cos_cache[positions].to(dtype).unsqueeze(1)
        sin = self.sin_cache[positions].to(dtype).unsqueeze(1)
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] rotated by position. Equal to HF's ``x * cat(cos, cos) + rotate_half(x) * cat(sin, sin)``,
    rounding included (negation is exact)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
