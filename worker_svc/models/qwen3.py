"""Qwen3 over the paged KV cache. Module names mirror transformers' ``Qwen3ForCausalLM``.

Qwen3 is a Llama-shaped decoder with two differences, both in attention: every query and key
head is RMS-normalized over its ``head_dim`` (``q_norm``, ``k_norm``, one weight per model
layer shared by all heads) before the rotary embedding, and ``head_dim`` is stated by the
config rather than ``hidden_size // num_heads``. The rest (fused q/k/v and gate/up, tensor-
parallel sharding, weight loading) is the Llama family's.
"""

from __future__ import annotations

import torch

from worker_svc.config import ModelConfig
from worker_svc.layers import RMSNorm
from worker_svc.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from worker_svc.parallel.group import SINGLE, TensorParallel


class Qwen3Attention(LlamaAttention):
    def __init__(self, config: ModelConfig, tp: TensorParallel = SINGLE):
        super().__init__(config, tp)
        # per head, so replicated on every rank whatever heads it holds
        self.q_norm = RMSNorm(config.head_dim, config.norm_eps)
        self.k_norm = RMSNorm(config.head_dim, config.norm_eps)

    def heads(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(q), self.k_norm(k)


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_class = Qwen3Attention


class Qwen3Model(LlamaModel):
    layer_class = Qwen3DecoderLayer


class Qwen3ForCausalLM(LlamaForCausalLM):
    model_class = Qwen3Model
