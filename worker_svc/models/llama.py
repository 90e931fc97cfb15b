"""Llama-family decoder (Llama, Mistral, Qwen2, SmolLM2) over the paged KV cache.

Module names mirror transformers' ``LlamaForCausalLM`` so checkpoints load by name; q/k/v and
gate/up are fused into one matmul each and loaded shard by shard. Over tensor-parallel ranks,
qkv_proj and gate_up_proj are column-parallel (each rank: its heads, its MLP columns), o_proj and
down_proj row-parallel (one all-reduce each), the embedding and the head split by vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from kvcache.paged import AttentionMetadata, PagedKVCache
from worker_svc.config import ModelConfig
from worker_svc.models.base import CausalLM
from worker_svc.layers import (
    ActAndMul,
    ColumnParallelLinear,
    PagedAttention,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    apply_rotary,
    kv_heads_per_rank,
    load_weights_by_name,
    qkv_parts,
    split_parts,
)
from worker_svc.parallel.group import SINGLE, TensorParallel

_STACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaAttention(nn.Module):
    # fused CPU kernels that rotate q and k in place (set by worker_svc.cpu.fused.use_fused_cpu_kernels)
    rotary_kernels = None

    def __init__(self, config: ModelConfig, tp: TensorParallel = SINGLE):
        super().__init__()
        # this rank's query heads and the KV heads they use
        self.num_heads = tp.split(config.num_heads, "the number of attention heads")
        self.num_kv_heads = kv_heads_per_rank(config.num_kv_heads, tp)
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * config.head_dim
        self.kv_size = self.num_kv_heads * config.head_dim
        self.qkv_proj = ColumnParallelLinear(
            config.hidden_size, qkv_parts(config.num_heads, config.num_kv_heads, config.head_dim, tp),
            bias=config.qkv_bias,
        )
        self.o_proj = RowParallelLinear(config.num_heads * config.head_dim, config.hidden_size, bias=config.o_bias, tp=tp)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, scale=self.head_dim**-0.5)

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
        q, k = self.heads(q.view(num_tokens, self.num_heads, self.head_dim),  # [T, H, D]
                          k.view(num_tokens, self.num_kv_heads, self.head_dim))  # [T, Hkv, D]
        if self.rotary_kernels is None or not self.rotary_kernels.rotary(q, k, cos, sin):  # else rotated in place
            q = apply_rotary(q, cos, sin)
            k = apply_rotary(k, cos, sin)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        return self.o_proj(self.attn(q, k, v, kv_layer, meta))

    def heads(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Query and key heads before the rotary embedding (Qwen3 normalizes them here)."""
        return q, k


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel = SINGLE):
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, split_parts([size, size], tp), bias=config.mlp_bias)
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias=config.mlp_bias, tp=tp)
        self.act_fn = ActAndMul(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    attention_class = LlamaAttention

    def __init__(self, config: ModelConfig, tp: TensorParallel = SINGLE):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        self.self_attn = self.attention_class(config, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        self.mlp = LlamaMLP(config, tp)

    def forward(self, hidden, cos, sin, kv_layer, meta):
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, kv_layer, meta)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaModel(nn.Module):
    layer_class = LlamaDecoderLayer

    def __init__(self, config: ModelConfig, tp: TensorParallel = SINGLE):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(self.layer_class(config, tp) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        # One table for all layers; cos/sin are looked up once per step.
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.max_model_len, config.rope_theta, config.rope_scaling)


class LlamaForCausalLM(CausalLM):
    model_class = LlamaModel
    # the lean CPU pass for small steps of a model with quantized linears (worker_svc.cpu.decode,
    # set by worker_svc.cpu.prepare where the model qualifies); None: the modules serve every step
    cpu_decode = None

    def __init__(self, config: ModelConfig, tp: TensorParallel = SINGLE):
        super().__init__(config, tp)
        self.model = self.model_class(config, tp)
        # Tied embeddings: logits use embed_tokens.weight directly (no second parameter to keep tied).

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_cache: PagedKVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Runs every layer over the step's flattened tokens; returns the final-normed hidden states
        of the tokens at ``meta.logits_indices`` only: [num_sampled, hidden]."""
        fast = self.cpu_decode
        if fast is not None and fast.accepts(input_ids.shape[0], kv_cache, meta):
            return fast.forward(input_ids, positions, kv_cache, meta)
        hidden = self.model.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = self.model.rotary_emb(positions, hidden.dtype)
        for i, layer in enumerate(self.model.layers):
            hidden = layer(hidden, cos, sin, kv_cache.layer(i), meta)
        return self.model.norm(hidden[meta.logits_indices])

    def tied_lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load Hugging Face-named tensors; raises ValueError on missing or unexpected weights."""

        def normalized():
            for name, tensor in weights:
                if name.endswith("rotary_emb.inv_freq"):
                    continue  # a buffer some old checkpoints carry; we compute it
                if name == "lm_head.weight" and self.lm_head is None:
                    continue  # tied: equal to embed_tokens.weight
                yield name, tensor

        load_weights_by_name(self, normalized(), _STACKED)
