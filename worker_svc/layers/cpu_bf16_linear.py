"""A bfloat16 model on a CPU without native bf16: bf16 weights and KV cache, fp32 arithmetic.

Without ``avx512_bf16`` or AMX, torch multiplies bf16 matrices by emulation (about 7x slower
than fp32 at 32 rows on AVX2), and oneDNN refuses to pack bf16 weights. So the weights stay
bf16 in memory, half the bytes to stream each step, and the C kernel ``csrc/cpu_bf16_linear.c``
widens them to fp32 in registers: ``y = x W^T + b`` with x, y and b in fp32. Activations stay
fp32 between layers (norms, rotary, activation functions, residuals); the embedding table, the
output head and the paged KV cache stay bf16, and attention reads the bf16 cache under fp32
queries (``kvcache/csrc/cpu_paged_attention.c``).

:func:`bf16_linear_ref` is the plain-torch reference the kernel is held to. Without a C
compiler, the linears' weights are widened to fp32 once at load and packed for oneDNN (fast,
at fp32's memory for the weights; the cache stays bf16).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import pathlib

import torch
import torch.nn.functional as F
from torch import nn

from kvcache import cbuild
from worker_svc.layers.cpu_linear import PackedLinear, mkldnn_linear_available
from worker_svc.layers.rotary import RotaryEmbedding
from worker_svc.layers.vocab import VocabParallelEmbedding

log = logging.getLogger("pagewire.worker")

_SOURCE = pathlib.Path(__file__).parent / "csrc" / "cpu_bf16_linear.c"
_ABI = 1
_PANEL = 16  # output columns per packed panel (csrc/cpu_bf16_linear.c)


def bf16_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: x [M, K] fp32, weight [N, K] bf16, bias [N] fp32 or None -> [M, N] fp32,
    every product and sum in fp32."""
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float())


class Bf16LinearKernel:
    """The loaded C library, with torch-facing calls."""

    def __init__(self, lib: ctypes.CDLL):
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        self._linear = lib.bf16_linear
        self._linear.restype = None
        self._linear.argtypes = [p, i64, p, p, p, i64, i64, i64, i64]
        self._pack = lib.bf16_linear_pack
        self._pack.restype = None
        self._pack.argtypes = [p, p, i64, i64]
        self.simd = bool(lib.bf16_linear_simd())

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """weight [N, K] (cast to bf16) -> the kernel's layout: [ceil(N / 16), K, 16] bf16."""
        n, k = weight.shape
        weight = weight.detach().to(torch.bfloat16).contiguous()
        packed = torch.empty((-(-n // _PANEL), k, _PANEL), dtype=torch.bfloat16)
        self._pack(weight.data_ptr(), packed.data_ptr(), n, k)
        return packed

    def linear(self, x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
        """x [M, K] fp32 -> [M, N] fp32 with ``packed`` from :meth:`pack` and ``bias`` [N] fp32 or None."""
        m, k = x.shape
        if x.dtype != torch.float32 or x.device.type != "cpu":
            raise ValueError(f"the bf16-weight linear takes float32 CPU inputs, got {x.dtype} on {x.device}")
        if packed.shape[1] != k or packed.shape[0] * _PANEL < out_features:
            raise ValueError(f"input [{m}, {k}] does not fit a packed weight {tuple(packed.shape)} of {out_features} outputs")
        if x.stride(1) != 1:
            x = x.contiguous()
        out = torch.empty((m, out_features), dtype=torch.float32)
        if m:
            self._linear(
                x.data_ptr(), x.stride(0), packed.data_ptr(), None if bias is None else bias.data_ptr(),
                out.data_ptr(), out_features, m, out_features, k,
            )  # fmt: skip
        return out


@functools.cache
def kernel() -> Bf16LinearKernel | None:
    """The kernel, built on first call; None (after one warning) when it cannot be built."""
    lib = cbuild.load(_SOURCE, "pagewire_bf16_linear_abi", _ABI,
                      "bf16 linears widen their weights to fp32 once, at load")
    return None if lib is None else Bf16LinearKernel(lib)


class Bf16Linear(nn.Module):
    """``y = x W^T + b`` with W kept bf16 in the kernel's packed layout, x, y and b fp32.
    Input [..., in] -> [..., out]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, lib: Bf16LinearKernel):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.lib = lib
        self.register_buffer("packed_weight", lib.pack(weight), persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            shape = x.shape
            return self.forward(x.reshape(-1, shape[-1])).reshape(*shape[:-1], self.out_features)
        return self.lib.linear(x.float(), self.packed_weight, self.out_features, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                "weight=bf16, compute=fp32")


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


def compute_bf16_model_in_fp32(model: nn.Module) -> str:
    """Turn a bf16 ``model`` on CPU into one that keeps bf16 weights and computes in fp32: every
    ``nn.Linear`` and the output head (``packed_lm_head``) become :class:`Bf16Linear`; the
    embedding tables stay bf16 and return fp32; every other parameter and buffer (norm weights,
    small embeddings) becomes fp32, and rotary tables are recomputed in fp32. Returns what the
    linears run on, for the log."""
    lib = kernel()

    def make(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
        return Bf16Linear(weight, bias, lib) if lib is not None else Fp32Linear(weight, bias)

    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                # a row-parallel layer keeps its all-reduce around the product
                setattr(module, child_name, child.packed(make) if hasattr(child, "packed") else make(child.weight, child.bias))
    if hasattr(model, "packed_lm_head"):
        model.packed_lm_head = make(model.lm_head_weight(), None)
        if getattr(model, "lm_head", None) is not None:  # its own weight: keep the packed copy only
            model.lm_head.weight.data = model.lm_head.weight.data.new_empty(0)
    for module in model.modules():
        if isinstance(module, VocabParallelEmbedding):
            module.output_dtype = torch.float32
            continue
        if isinstance(module, (Bf16Linear, PackedLinear)):
            continue
        for name, param in module.named_parameters(recurse=False):
            param.data = param.data.float()
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is not None and buffer.is_floating_point():
                setattr(module, name, buffer.float())
        if isinstance(module, RotaryEmbedding):
            module.reset_parameters()  # the tables in full fp32, not rounded through bf16
    if lib is None:
        return "weights widened to fp32 (no C compiler)"
    return "C kernel" + ("" if lib.simd else " (portable build, no AVX2)")
