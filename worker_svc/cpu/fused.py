"""Fused RMSNorm, SiLU-and-multiply and rotary embedding for float32 or bfloat16 activations on
CPU (``csrc/fused.c``).

At decode sizes each is a handful of torch operators, each a pass over memory and, past torch's
grain size, an OpenMP region whose barrier waits on any thread another process preempted (the
scheduler and API servers share the cores). The C versions make one pass, on one thread unless the
step is large. :func:`use_fused_cpu_kernels` switches a loaded model's :class:`RMSNorm`, SiLU
:class:`ActAndMul` and rotary attention layers to them; :func:`rms_norm_ref`, :func:`silu_mul_ref`
and ``layers.rotary.apply_rotary`` are the torch computations they are held to (the rotary one
to the bit: the same products and sums, rounded alike). In bf16 they round where torch's bf16
operators round (``RMSNorm.forward`` is the norm's reference there).
"""

from __future__ import annotations

import ctypes
import functools
import pathlib

import torch
import torch.nn.functional as F
from torch import nn

from worker_svc.cpu import build
from worker_svc.layers.activation import ActAndMul
from worker_svc.layers.norms import RMSNorm

_SOURCE = pathlib.Path(__file__).parent / "csrc" / "fused.c"
_ABI = 5
_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` [..., n] as 2-D rows whose elements are contiguous (copied only where they are not),
    for the C passes of ``csrc/fused.c``; float32 or bfloat16 CPU tensors only."""
    if x.dtype not in _DTYPES or x.device.type != "cpu":
        raise ValueError(f"the fused CPU kernels take float32 or bfloat16 CPU tensors, got {x.dtype} on {x.device}")
    x = x.reshape(-1, x.shape[-1])
    return x if x.stride(1) == 1 else x.contiguous()


class FusedKernels:
    """The loaded C library, with torch-facing calls on 2-D float32 or bfloat16 CPU tensors whose
    rows are contiguous (others are copied first)."""

    def __init__(self, lib: ctypes.CDLL):
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        self._rms_norm, self._silu_mul, self._rotary = {}, {}, {}
        for dtype, suffix in _DTYPES.items():
            self._rms_norm[dtype] = rms_norm = getattr(lib, f"rms_norm_{suffix}")
            rms_norm.restype = None
            rms_norm.argtypes = [p, i64, p, ctypes.c_float, p, i64, i64]
            self._silu_mul[dtype] = silu_mul = getattr(lib, f"silu_mul_{suffix}")
            silu_mul.restype = None
            silu_mul.argtypes = [p, i64, p, i64, i64]
            self._rotary[dtype] = rotary = getattr(lib, f"rotary_{suffix}")
            rotary.restype = None
            rotary.argtypes = [p, i64, i64, p, i64, i64, i64, p, p, i64]
        # vectorized: float32 with AVX2/FMA, bfloat16 with AVX-512 BF16 (else portable loops)
        self.simd = bool(lib.fused_simd())
        self.bf16_simd = bool(lib.fused_bf16_simd())

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """[..., n] -> [..., n]: ``weight * (x * rsqrt(mean(x^2) + eps))``, the weight in x's dtype."""
        rows = as_rows(x)
        if weight.dtype != x.dtype or weight.shape != (rows.shape[1],):
            raise ValueError(f"RMSNorm weight {tuple(weight.shape)} {weight.dtype} does not fit rows of {rows.shape[1]} "
                             f"{x.dtype}")
        out = torch.empty(rows.shape, dtype=x.dtype)
        self._rms_norm[x.dtype](rows.data_ptr(), rows.stride(0), weight.data_ptr(), eps, out.data_ptr(), rows.shape[0],
                                rows.shape[1])
        return out.view(x.shape)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[..., 2n] (gate, then up) -> [..., n]: ``silu(gate) * up``."""
        rows = as_rows(gate_up)
        if rows.shape[1] % 2:
            raise ValueError(f"gate/up rows have an odd width {rows.shape[1]}")
        n = rows.shape[1] // 2
        out = torch.empty((rows.shape[0], n), dtype=gate_up.dtype)
        self._silu_mul[gate_up.dtype](rows.data_ptr(), rows.stride(0), out.data_ptr(), rows.shape[0], n)
        return out.view(*gate_up.shape[:-1], n)

    def rotary(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
        """Rotate q [T, Hq, D] and k [T, Hk, D] in place by cos, sin [T, 1, D / 2] (from
        ``RotaryEmbedding``), as ``apply_rotary`` does. Returns False, with nothing done, for a
        layout it does not take (not all float32 or all bfloat16 on CPU, heads not contiguous in a
        row): then call ``apply_rotary``."""
        num_tokens, _, head_dim = q.shape
        if q.dtype not in _DTYPES or not all(t.dtype == q.dtype and t.device.type == "cpu" for t in (q, k, cos, sin)):
            return False
        if any(t.stride(2) != 1 or t.stride(1) != head_dim for t in (q, k)) or head_dim % 2:
            return False
        if cos.shape != (num_tokens, 1, head_dim // 2) or not (cos.is_contiguous() and sin.is_contiguous()):
            return False
        self._rotary[q.dtype](q.data_ptr(), q.stride(0), q.shape[1], k.data_ptr(), k.stride(0), k.shape[1], head_dim,
                     cos.data_ptr(), sin.data_ptr(), num_tokens)
        return True


@functools.cache
def library() -> ctypes.CDLL | None:
    """``csrc/fused.c`` built on first call and loaded; None (after one warning) when it cannot be
    built. Its norm, activation and rotary passes are :class:`FusedKernels`'; its argmax and draw,
    the sampler's (``worker_svc.cpu.sampler``)."""
    return build.load(_SOURCE, "pagewire_cpu_fused_abi", _ABI, "norms and activations use torch operators")


@functools.cache
def kernel() -> FusedKernels | None:
    """The kernels, built on first call; None (after one warning) when they cannot be built."""
    lib = library()
    return None if lib is None else FusedKernels(lib)


def use_fused_cpu_kernels(model: nn.Module, dtype: torch.dtype = torch.float32) -> int:
    """Point the RMSNorm, SiLU ActAndMul and rotary attention layers of a model that computes in
    ``dtype`` on CPU at the fused kernels. Returns how many layers now use them: 0 for other
    dtypes and where the kernels for ``dtype`` are not vectorized (float32 needs an AVX2 build,
    bfloat16 an AVX-512 BF16 one), since torch's vectorized operators are the faster choice there."""
    lib = kernel()
    if lib is None or not {torch.float32: lib.simd, torch.bfloat16: lib.bf16_simd}.get(dtype, False):
        return 0
    switched = 0
    for module in model.modules():
        if isinstance(module, RMSNorm) and module.weight.dtype == dtype:
            module.cpu_kernels = lib
            switched += 1
        elif isinstance(module, ActAndMul) and module.act is F.silu:
            module.cpu_kernels = lib
            switched += 1
        elif hasattr(module, "rotary_kernels"):  # an attention layer that applies the rotary embedding
            module.rotary_kernels = lib
            switched += 1
    return switched
