"""GPT-2 over the paged KV cache. Module names mirror transformers' ``GPT2LMHeadModel``."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from kvcache.paged import AttentionMetadata, PagedKVCache
from worker_svc.config import ModelConfig
from worker_svc.models.base import CausalLM
from worker_svc.layers import LayerNorm, PagedAttention, get_activation, load_weights_by_name

# Conv1D modules: the checkpoint stores their weight as [in, out], nn.Linear wants [out, in].
_CONV1D = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


class GPT2Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
        self.c_attn = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.c_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.attn = PagedAttention(config.num_heads, config.num_heads, config.head_dim, scale=config.head_dim**-0.5)

    def forward(self, hidden: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = self.c_attn(hidden).view(num_tokens, 3, self.num_heads, self.head_dim).unbind(1)  # [T, H, D] each
        return self.c_proj(self.attn(q, k, v, kv_layer, meta))


class GPT2MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.hidden_size, config.intermediate_size)
        self.c_proj = nn.Linear(config.intermediate_size, config.hidden_size)
        self.act = get_activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.ln_1 = LayerNorm(config.hidden_size, eps=config.norm_eps)
        self.attn = GPT2Attention(config)
        self.ln_2 = LayerNorm(config.hidden_size, eps=config.norm_eps)
        self.mlp = GPT2MLP(config)

    def forward(self, hidden, kv_layer, meta):
        hidden = hidden + self.attn(self.ln_1(hidden), kv_layer, meta)
        return hidden + self.mlp(self.ln_2(hidden))


class GPT2Model(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.wpe = nn.Embedding(config.max_model_len, config.hidden_size)
        self.h = nn.ModuleList(GPT2Block(config) for _ in range(config.num_layers))
        self.ln_f = LayerNorm(config.hidden_size, eps=config.norm_eps)


class GPT2LMHeadModel(CausalLM):
    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.transformer = GPT2Model(config)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_cache: PagedKVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Final-normed hidden states at ``meta.logits_indices``: [num_sampled, hidden]."""
        hidden = self.transformer.wte(input_ids) + self.transformer.wpe(positions)  # [T, hidden]
        for i, block in enumerate(self.transformer.h):
            hidden = block(hidden, kv_cache.layer(i), meta)
        return self.transformer.ln_f(hidden[meta.logits_indices])

    def tied_lm_head_weight(self) -> torch.Tensor:
        return self.transformer.wte.weight

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load Hugging Face-named tensors (with or without the ``transformer.`` prefix)."""

        def normalized():
            for name, tensor in weights:
                if name.endswith((".attn.bias", ".attn.masked_bias")):
                    continue  # causal-mask buffers of old checkpoints
                if name == "lm_head.weight":
                    if self.lm_head is None:
                        continue  # tied: equal to wte.weight
                elif not name.startswith("transformer."):
                    name = f"transformer.{name}"
                if name.endswith(".weight") and name.removesuffix(".weight").endswith(_CONV1D):
                    tensor = tensor.t()
                yield name, tensor

        load_weights_by_name(self, normalized())
