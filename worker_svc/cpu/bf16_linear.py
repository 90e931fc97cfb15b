"""A bfloat16 model on a CPU without native bf16: bf16 weights and KV cache, fp32 arithmetic.

Without ``avx512_bf16`` or AMX, torch multiplies bf16 matrices by emulation (about 7x slower
than fp32 at 32 rows on AVX2), and oneDNN refuses to pack bf16 weights. So the weights stay
bf16 in memory, half the bytes to stream each step, and the C linear kernel
(``worker_svc/cpu/linear.py``) widens them to fp32 in registers: ``y = x W^T + b`` with x, y and b in
fp32. Activations stay fp32 between layers (norms, rotary, activation functions, residuals); the
embedding table, the output head and the paged KV cache stay bf16, and attention reads the bf16
cache under fp32 queries (``worker_svc/cpu/csrc/attention.c``).

Without a C compiler, the linears' weights are widened to fp32 once at load and packed for oneDNN
(fast, at fp32's memory for the weights; the cache stays bf16).
"""

from __future__ import annotations

import torch
from torch import nn

from worker_svc.cpu import linear as cpu_linear
from worker_svc.cpu.linear import KernelLinear, PackedLinear, mkldnn_linear_available, replace_linears
from worker_svc.layers.rotary import RotaryEmbedding
from worker_svc.layers.vocab import VocabParallelEmbedding


class Fp32Linear(nn.Module):
    """The fallback without a compiler: the weight widened to fp32 once (packed for oneDNN when it
    is available)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        weight, bias = weight.detach().float(), None if bias is None else bias.detach().float()
        self.out_features = weight.shape[0]
        if mkldnn_linear_available():
            self.linear = PackedLinear(weight, bias)
        else:
            self.linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
            self.linear.weight.data = weight
            if bias is not None:
                self.linear.bias.data = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.float())


def rest_in_fp32(model: nn.Module, keep: tuple[type, ...]) -> None:
    """Every parameter and floating buffer of ``model``'s modules other than ``keep`` (the weights
    that stay as they are) becomes fp32, and rotary tables are recomputed in fp32 (not rounded
    through bf16)."""
    for module in model.modules():
        if isinstance(module, keep):
            continue
        for param in module.parameters(recurse=False):
            param.data = param.data.float()
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is not None and buffer.is_floating_point():
                setattr(module, name, buffer.float())
        if isinstance(module, RotaryEmbedding):
            module.reset_parameters()


def compute_bf16_model_in_fp32(model: nn.Module) -> str:
    """Turn a bf16 ``model`` on CPU into one that keeps bf16 weights and computes in fp32: every
    ``nn.Linear`` and the output head (``packed_lm_head``) become a :class:`KernelLinear` of bf16
    weights; the embedding tables stay bf16 and return fp32; every other parameter and buffer (norm
    weights, small embeddings) becomes fp32, and rotary tables are recomputed in fp32. Returns what
    the linears run on, for the log."""
    lib = cpu_linear.kernel()

    def make(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
        return KernelLinear(weight, bias, lib, torch.bfloat16) if lib is not None else Fp32Linear(weight, bias)

    replace_linears(model, make)
    for module in model.modules():
        if isinstance(module, VocabParallelEmbedding):
            module.output_dtype = torch.float32
    rest_in_fp32(model, keep=(KernelLinear, PackedLinear, VocabParallelEmbedding))
    if lib is None:
        return "weights widened to fp32 (no C compiler)"
    return "C kernel" + ("" if lib.simd else " (portable build, no AVX2)")
