"""GPT-2 over the paged KV cache. Module names mirror transformers' ``GPT2LMHeadModel``.

Sharded over the tensor-parallel ranks by heads (c_attn column-parallel, attn.c_proj
row-parallel), by MLP columns (c_fc / mlp.c_proj) and by vocabulary (wte, tied head); the learned
position table (wpe) and the norms are replicated.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from kvcache.paged import AttentionMetadata, PagedKVCache
from worker_svc.config import ModelConfig
from worker_svc.layers import (
    ColumnParallelLinear,
    LayerNorm,
    PagedAttention,
    RowParallelLinear,
    TransposedSource,
    VocabParallelEmbedding,
    as_source,
    get_activation,
    load_weights_by_name,
    split_parts,
)
from worker_svc.layers.linear import Part
from worker_svc.models.base import CausalLM
from worker_svc.parallel.group import SINGLE, TensorParallel

# Conv1D modules: the checkpoint stores their weight as [in, out], nn.Linear wants [out, in].
_CONV1D = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


class GPT2Attention(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel):
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = tp.split(config.num_heads, "the number of attention heads")  # this rank's
        self.head_dim = config.head_dim
        size = self.num_heads * self.head_dim
        # one checkpoint tensor [3 * hidden] holds q, k, v: this rank's heads of each
        self.c_attn = ColumnParallelLinear(hidden, [Part(0, size, i * hidden + tp.rank * size, 3 * hidden) for i in range(3)], bias=True)
        self.c_proj = RowParallelLinear(hidden, hidden, bias=True, tp=tp)
        self.attn = PagedAttention(self.num_heads, self.num_heads, config.head_dim, scale=config.head_dim**-0.5)

    def forward(self, hidden: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = self.c_attn(hidden).view(num_tokens, 3, self.num_heads, self.head_dim).unbind(1)  # [T, H, D] each
        return self.c_proj(self.attn(q, k, v, kv_layer, meta))


class GPT2MLP(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel):
        super().__init__()
        self.c_fc = ColumnParallelLinear(config.hidden_size, split_parts([config.intermediate_size], tp), bias=True)
        self.c_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=True, tp=tp)
        self.act = get_activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel):
        super().__init__()
        self.ln_1 = LayerNorm(config.hidden_size, eps=config.norm_eps)
        self.attn = GPT2Attention(config, tp)
        self.ln_2 = LayerNorm(config.hidden_size, eps=config.norm_eps)
        self.mlp = GPT2MLP(config, tp)

    def forward(self, hidden, kv_layer, meta):
        hidden = hidden + self.attn(self.ln_1(hidden), kv_layer, meta)
        return hidden + self.mlp(self.ln_2(hidden))


class GPT2Model(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel):
        super().__init__()
        self.wte = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.wpe = nn.Embedding(config.max_model_len, config.hidden_size)
        self.h = nn.ModuleList(GPT2Block(config, tp) for _ in range(config.num_layers))
        self.ln_f = LayerNorm(config.hidden_size, eps=config.norm_eps)


class GPT2LMHeadModel(CausalLM):
    def __init__(self, config: ModelConfig, tp: TensorParallel = SINGLE):
        super().__init__(config, tp)
        self.transformer = GPT2Model(config, tp)

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
        """Load Hugging Face-named tensors or sources (with or without the ``transformer.`` prefix)."""

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
                    tensor = TransposedSource(as_source(tensor))
                yield name, tensor

        load_weights_by_name(self, normalized())
