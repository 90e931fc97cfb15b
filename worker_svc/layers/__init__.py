"""Building blocks shared by the model implementations."""

from worker_svc.layers.activation import ActAndMul, get_activation
from worker_svc.layers.attention import PagedAttention
from worker_svc.layers.linear import MergedLinear, load_weights_by_name
from worker_svc.layers.norms import LayerNorm, RMSNorm
from worker_svc.layers.rotary import RotaryEmbedding, apply_rotary, rope_inv_freq

__all__ = [
    "ActAndMul",
    "LayerNorm",
    "MergedLinear",
    "PagedAttention",
    "RMSNorm",
    "RotaryEmbedding",
    "apply_rotary",
    "get_activation",
    "load_weights_by_name",
    "rope_inv_freq",
]
