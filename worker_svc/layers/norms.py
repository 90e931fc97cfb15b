"""Normalization layers."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """Llama RMSNorm: normalize in fp32, scale in the input dtype (as transformers does).
    ``cpu_kernels`` (set by ``worker_svc.cpu.fused.use_fused_cpu_kernels``) computes it in one C pass."""

    cpu_kernels = None

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpu_kernels is not None and x.dtype == self.weight.dtype:
            return self.cpu_kernels.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


LayerNorm = nn.LayerNorm
