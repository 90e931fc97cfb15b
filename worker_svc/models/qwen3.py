"""Qwen3 over the paged KV cache. Module names mirror transformers' ``Qwen3ForCausalLM``.

Qwen3 is a Llama-shaped decoder with two differences, both in attention: every query and key
head is RMS-normalized over its ``head_dim`` (``q_norm``, ``k_norm``, one weight per model
layer shared by all heads) before the rotary embedding, and ``head_dim`` is stated by the
config rather than ``hidden_size // num_heads``. The rest (fused q/k/v and gate/up, tensor-
parallel sharding, weight loading) is the Llama family's.
"""

from __future__ import annotations

import torch

from kvcache.paged import AttentionMetadata
from worker_svc.config import ModelConfig
from worker_svc.layers import RMSNorm, apply_rotary
from worker_svc.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from worker_svc.parallel.group import SINGLE, TensorParallel


class Qwen3Attention(LlamaAttention):
    def __init__(self, config: ModelConfig, tp: TensorParallel = SINGLE):
        super().__init__(config, tp)
        # per head, so replicated on every rank whatever heads it holds
        self.q_norm = RMSNorm(config.head_dim, config.norm_eps)
        self.k_norm = RMSNorm(config.head_dim, config.norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_layer: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.view(num_tokens, self.num_heads, self.head_dim))  # [T, H, D]
        k = self.k_norm(k.view(num_tokens, self.num_kv_heads, self.head_dim))  # [T, Hkv, D]
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        return self.o_proj(self.attn(q, k, v, kv_layer, meta))


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_class = Qwen3Attention


class Qwen3Model(LlamaModel):
    layer_class = Qwen3DecoderLayer


class Qwen3ForCausalLM(LlamaForCausalLM):
    model_class = Qwen3Model
