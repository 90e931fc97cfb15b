"""Activation functions by Hugging Face name."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def get_activation(name: str):
    """The function for a Hugging Face ``hidden_act`` / ``activation_function`` name."""
    if name == "silu":
        return F.silu
    if name in ("gelu_new", "gelu_pytorch_tanh"):
        return _gelu_tanh
    if name == "gelu":
        return F.gelu
    raise ValueError(f"unsupported activation {name!r}; supported: silu, gelu_new, gelu_pytorch_tanh, gelu")


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


class ActAndMul(nn.Module):
    """act(gate) * up for a fused [T, 2 * I] gate/up projection. ``cpu_kernels`` (set by
    ``worker_svc.cpu.fused.use_fused_cpu_kernels`` for SiLU) computes it in one C pass."""

    cpu_kernels = None

    def __init__(self, name: str):
        super().__init__()
        self.act = get_activation(name)

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.cpu_kernels is not None and gate_up.dtype in (torch.float32, torch.bfloat16):
            return self.cpu_kernels.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act(gate) * up
