"""Building blocks shared by the model implementations."""

from worker_svc.layers.activation import ActAndMul, get_activation
from worker_svc.layers.attention import PagedAttention
from worker_svc.layers.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    kv_heads_per_rank,
    load_weights_by_name,
    qkv_parts,
    split_parts,
)
from worker_svc.layers.norms import LayerNorm, RMSNorm
from worker_svc.layers.rotary import RotaryEmbedding, apply_rotary, rope_inv_freq
from worker_svc.layers.sources import TransposedSource, as_source
from worker_svc.layers.vocab import VocabParallelEmbedding

__all__ = [
    "ActAndMul",
    "ColumnParallelLinear",
    "LayerNorm",
    "PagedAttention",
    "RMSNorm",
    "RotaryEmbedding",
    "RowParallelLinear",
    "TransposedSource",
    "VocabParallelEmbedding",
    "apply_rotary",
    "as_source",
    "get_activation",
    "kv_heads_per_rank",
    "load_weights_by_name",
    "qkv_parts",
    "rope_inv_freq",
    "split_parts",
]
