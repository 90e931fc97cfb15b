"""The sampler's C pass on CPU: each row's argmax, and a draw per row from softmax(logits / T).

``torch.argmax`` keeps an index beside every comparison, ~2 ms for 32 rows of a 49k vocabulary on
two cores, the C one ~0.2 ms; softmax, cumsum and searchsorted make three passes and write two
rows' worth, the C draw reads the row twice (``benchmarks/sampler_speed.py``). ``worker_svc.sampler``
takes them for float32 logits on CPU where they are vectorized (:func:`kernel`).

The entry points (``argmax_f32``, ``sample_f32``) are compiled into the fused library
(``csrc/fused.c``, :func:`worker_svc.cpu.fused.library`) rather than a library of their own: the
draw's numerators use the same vectorized exp as SiLU, and one source keeps one copy of it (the
build's cache key covers a source file, not the headers it would include).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from worker_svc.cpu import fused


class SamplerKernels:
    """The argmax and draw of the loaded fused library, with torch-facing calls on [N, V] float32
    CPU logits whose rows are contiguous (others are copied first)."""

    def __init__(self, lib: ctypes.CDLL):
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        self._argmax = lib.argmax_f32
        self._argmax.restype = None
        self._argmax.argtypes = [p, i64, i64, i64, p]
        self._sample = lib.sample_f32
        self._sample.restype = None
        self._sample.argtypes = [p, i64, i64, i64, p, p, p]
        self.simd = bool(lib.fused_simd())  # float32 with AVX2/FMA (else portable loops)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """[N, V] float32 -> [N] int64: each row's ``torch.argmax`` (the first of equal maxima, or
        the first NaN)."""
        if logits.dim() != 2 or logits.dtype != torch.float32 or not logits.shape[1]:
            raise ValueError(f"argmax takes [N, V] float32 logits with V > 0, got {tuple(logits.shape)} {logits.dtype}")
        rows = fused.as_rows(logits)
        out = torch.empty(rows.shape[0], dtype=torch.int64)
        self._argmax(rows.data_ptr(), rows.stride(0), rows.shape[0], rows.shape[1], out.data_ptr())
        return out

    def draw(self, logits: torch.Tensor, u: torch.Tensor, temperatures: torch.Tensor | None = None) -> torch.Tensor:
        """[N, V] float32 logits, [N] or [N, 1] uniforms in [0, 1) and temperatures (> 0; None for
        logits already scaled) -> [N] int64: each row's draw from softmax(logits / temperature) at u,
        the first token whose cumulative probability exceeds u times the total (masked -inf tokens
        never); -1 for a row with a NaN or no finite logit, for the caller to draw."""
        if logits.dim() != 2 or logits.dtype != torch.float32 or not logits.shape[1]:
            raise ValueError(f"draw takes [N, V] float32 logits with V > 0, got {tuple(logits.shape)} {logits.dtype}")
        rows = fused.as_rows(logits)
        u = u.reshape(-1).to(torch.float32).contiguous()
        inv_t = torch.ones_like(u) if temperatures is None else (1.0 / temperatures.reshape(-1).to(torch.float32))
        if u.shape[0] != rows.shape[0] or inv_t.shape[0] != rows.shape[0]:
            raise ValueError(f"{u.shape[0]} uniforms and {inv_t.shape[0]} temperatures for {rows.shape[0]} rows")
        inv_t = inv_t.contiguous()
        out = torch.empty(rows.shape[0], dtype=torch.int64)
        self._sample(rows.data_ptr(), rows.stride(0), rows.shape[0], rows.shape[1], inv_t.data_ptr(), u.data_ptr(),
                     out.data_ptr())
        return out


@functools.cache
def kernel() -> SamplerKernels | None:
    """The argmax and draw the sampler takes for float32 logits on CPU, or None where they are not
    built with AVX2 (torch's operators are the faster choice there)."""
    lib = fused.library()
    if lib is None:
        return None
    kernels = SamplerKernels(lib)
    return kernels if kernels.simd else None
