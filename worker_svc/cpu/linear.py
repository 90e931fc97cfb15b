"""Linear layers for the CPU path, with weights packed once after loading.

Decode steps multiply a few dozen rows by weights far larger than the caches, so a step's linears
are bound by streaming every weight from memory and keeping the FMA units fed while it arrives.
The C kernel ``csrc/linear.c`` packs each weight into panels of 16 output columns and
prefetches the next panel while it multiplies the current one by every row; it takes fp32
weights, and bf16 weights widened to fp32 in registers (for CPUs without native bf16). Every
product and sum is an fp32 FMA, summed in order along k. On an AVX2 CPU it runs a 32-row step
through SmolLM2-135M's 30 layers and head about 1.6 times as fast as torch's oneDNN linear with
prepacked weights, at about 90% of the cores' FMA peak (``benchmarks/cpu_linear.py``); oneDNN in
turn is about twice as fast as the default CPU matmul at these sizes.

:func:`pack_linears_for_cpu` puts one or the other in place of every ``nn.Linear`` and of the
output head: the kernel for fp32 weights on AVX2 CPUs and on AMD Zen 4 (whose AVX-512 is half
width; 1.1-1.3x oneDNN at 32 rows), and for a bf16 model (:class:`PairLinear`, bf16 in and out,
fp32 sums) on AMX tiles where the CPU has them (1.28x oneDNN's bf16 at 32 rows) and on
``vdpbf16ps`` dot products on CPUs with AVX-512 BF16 and no AMX (1.25x oneDNN's bf16 at 32 rows
on Zen 4); oneDNN (:class:`PackedLinear`) for fp32 on other AVX-512 CPUs, and where no C
compiler is found.
:func:`linear_ref` is the plain-torch reference the kernel is held to. Applied on CPU only; CUDA
keeps plain ``nn.Linear``.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import pathlib

import torch
import torch.nn.functional as F
from torch import nn

from worker_svc.cpu import build, features

log = logging.getLogger("pagewire.worker")

_SOURCE = pathlib.Path(__file__).parent / "csrc" / "linear.c"
_ABI = 5
_PANEL = 16  # output columns per packed panel (csrc/linear.c)
_PAIR_STEP = 16  # a bf16-pair panel holds a multiple of this many pairs (an AMX tile's worth)
KERNEL_WEIGHT_DTYPES = (torch.float32, torch.bfloat16)


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: x [M, K] fp32, weight [N, K] fp32 or bf16, bias [N] or None -> [M, N] fp32,
    every product and sum in fp32."""
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float())


def pair_rows(in_features: int) -> int:
    """The pairs of one panel of the bf16-pair layout for ``in_features`` inputs."""
    return -(-in_features // (2 * _PAIR_STEP)) * _PAIR_STEP


class TilesFrom:
    """For a kernel library whose bf16 calls multiply on AMX tiles where the CPU has them:
    ``tiles_from``, the rows from which they do (the kernel's default, 1: every call); fewer go
    through the dot products, whose sums round otherwise."""

    def _bind_tiles_from(self, fn) -> None:
        """``fn``: the library's C setter (rows > 0 sets, < 0 restores the default, 0 reads; it
        returns the rows in force)."""
        fn.restype = ctypes.c_int64
        fn.argtypes = [ctypes.c_int64]
        self._tiles_from = fn

    @property
    def tiles_from(self) -> int:
        return int(self._tiles_from(0))

    @tiles_from.setter
    def tiles_from(self, rows: int | None) -> None:
        """``rows`` (at least 1), or None for the kernel's default (benchmarks compare the paths)."""
        if rows is not None and rows < 1:
            raise ValueError(f"tiles_from must be at least 1 row, got {rows}")
        self._tiles_from(-1 if rows is None else rows)


class LinearKernel(TilesFrom):
    """The loaded C library, with torch-facing calls."""

    def __init__(self, lib: ctypes.CDLL):
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        self._linear = {}
        self._pack = {}
        for dtype, suffix in ((torch.float32, "f32"), (torch.bfloat16, "bf16")):
            linear = getattr(lib, f"linear_{suffix}")
            linear.restype = None
            linear.argtypes = [p, i64, p, p, p, i64, i64, i64, i64]
            pack = getattr(lib, f"linear_pack_{suffix}")
            pack.restype = None
            pack.argtypes = [p, p, i64, i64]
            self._linear[dtype], self._pack[dtype] = linear, pack
        self.simd = bool(lib.linear_simd())
        self._linear_pairs = lib.linear_bf16_pairs
        self._linear_pairs.restype = None
        self._linear_pairs.argtypes = [p, i64, p, p, p, i64, i64, i64, i64]
        self._pack_pairs = lib.linear_pack_bf16_pairs
        self._pack_pairs.restype = None
        self._pack_pairs.argtypes = [p, p, i64, i64]
        self._linear_pairs_amx = lib.linear_bf16_pairs_amx
        self._linear_pairs_amx.restype = None
        self._linear_pairs_amx.argtypes = [p, i64, p, p, p, i64, i64, i64, i64]
        # the bf16-pair layout on AVX-512 BF16 dot products (else a portable loop, for tests)
        self.pairs_simd = bool(lib.linear_pairs_simd())
        # the same layout on AMX tiles: built for a CPU with AMX-BF16 and the tiles granted by Linux;
        # when set, linear_pairs multiplies on the tiles
        self.pairs_amx = bool(lib.linear_pairs_amx())
        self._bind_tiles_from(lib.linear_pairs_tiles_from)

    def pack(self, weight: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """weight [N, K] (cast to ``dtype``, fp32 or bf16) -> the kernel's layout: [ceil(N / 16), K, 16]."""
        if dtype not in self._pack:
            raise ValueError(f"the CPU linear kernel takes float32 or bfloat16 weights, not {dtype}")
        n, k = weight.shape
        weight = weight.detach().to(dtype).contiguous()
        packed = torch.empty((-(-n // _PANEL), k, _PANEL), dtype=dtype)
        self._pack[dtype](weight.data_ptr(), packed.data_ptr(), n, k)
        return packed

    def pack_pairs(self, weight: torch.Tensor) -> torch.Tensor:
        """weight [N, K] (cast to bf16) -> the bf16-pair layout: [ceil(N / 16), P, 16] int32, lane j
        of pair q holding W[16p + j][2q] and W[16p + j][2q + 1], P = ceil(K / 2) rounded up to a
        multiple of 16 (zero pairs after the last)."""
        n, k = weight.shape
        weight = weight.detach().to(torch.bfloat16).contiguous()
        packed = torch.empty((-(-n // _PANEL), pair_rows(k), _PANEL), dtype=torch.int32)
        self._pack_pairs(weight.data_ptr(), packed.data_ptr(), n, k)
        return packed

    def linear_pairs(self, x: torch.Tensor, packed: torch.Tensor, out_features: int,
                     bias: torch.Tensor | None) -> torch.Tensor:
        """x [M, K] bf16 -> [M, N] bf16 with ``packed`` from :meth:`pack_pairs` of a weight with K
        inputs and ``bias`` [N] fp32 or None; sums in fp32, rounded to bf16 once. On AMX tiles
        where :attr:`pairs_amx`, else on vector dot products (or the portable loop)."""
        m, k = x.shape
        if x.dtype != torch.bfloat16 or x.device.type != "cpu":
            raise ValueError(f"the bf16-pair linear takes bfloat16 CPU inputs, got {x.dtype} on {x.device}")
        if packed.shape[1] != pair_rows(k) or packed.shape[0] * _PANEL < out_features:
            raise ValueError(f"input [{m}, {k}] does not fit a packed weight {tuple(packed.shape)} of {out_features} outputs")
        if k % 2 or x.stride(1) != 1 or x.stride(0) % 2 or x.data_ptr() % 4:  # the kernel reads x in aligned pairs
            x = F.pad(x, (0, 1)) if k % 2 else x.clone(memory_format=torch.contiguous_format)
        out = torch.empty((m, out_features), dtype=torch.bfloat16)
        if m:
            (self._linear_pairs_amx if self.pairs_amx else self._linear_pairs)(
                x.data_ptr(), x.stride(0), packed.data_ptr(), None if bias is None else bias.data_ptr(),
                out.data_ptr(), out_features, m, out_features, x.shape[1],
            )  # fmt: skip
        return out

    def linear(self, x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
        """x [M, K] fp32 -> [M, N] fp32 with ``packed`` from :meth:`pack` and ``bias`` [N] fp32 or None."""
        m, k = x.shape
        if x.dtype != torch.float32 or x.device.type != "cpu":
            raise ValueError(f"the CPU linear kernel takes float32 CPU inputs, got {x.dtype} on {x.device}")
        if packed.shape[1] != k or packed.shape[0] * _PANEL < out_features:
            raise ValueError(f"input [{m}, {k}] does not fit a packed weight {tuple(packed.shape)} of {out_features} outputs")
        if x.stride(1) != 1:
            x = x.contiguous()
        out = torch.empty((m, out_features), dtype=torch.float32)
        if m:
            self._linear[packed.dtype](
                x.data_ptr(), x.stride(0), packed.data_ptr(), None if bias is None else bias.data_ptr(),
                out.data_ptr(), out_features, m, out_features, k,
            )  # fmt: skip
        return out


@functools.cache
def kernel() -> LinearKernel | None:
    """The kernel, built on first call; None (after one warning) when it cannot be built."""
    lib = build.load(_SOURCE, "pagewire_cpu_linear_abi", _ABI,
                      "CPU linears use oneDNN with prepacked weights (fp32 weights)")
    return None if lib is None else LinearKernel(lib)


class KernelLinear(nn.Module):
    """``y = x W^T + b`` with W kept only in the kernel's packed layout, as ``weight_dtype`` (fp32,
    or bf16 to stream half the bytes); x, y and b fp32. Input [..., in] -> [..., out]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, lib: LinearKernel,
                 weight_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.lib = lib
        self.register_buffer("packed_weight", lib.pack(weight, weight_dtype), persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            shape = x.shape
            return self.forward(x.reshape(-1, shape[-1])).reshape(*shape[:-1], self.out_features)
        return self.lib.linear(x.float(), self.packed_weight, self.out_features, self.bias)

    def extra_repr(self) -> str:
        weight = "bf16" if self.packed_weight.dtype == torch.bfloat16 else "fp32"
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"weight={weight}, compute=fp32, packed=C kernel")


class PairLinear(nn.Module):
    """``y = x W^T + b`` for a bf16 model on a CPU with AVX-512 BF16 or AMX: W kept only in the
    kernel's bf16-pair layout, x and y bf16, b fp32, the sums fp32 (one ``vdpbf16ps`` per pair of
    inputs, or one ``tdpbf16ps`` per 16 rows x 32 inputs x 16 outputs). Input [..., in] -> [..., out]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, lib: LinearKernel):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.lib = lib
        self.register_buffer("packed_weight", lib.pack_pairs(weight), persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            shape = x.shape
            return self.forward(x.reshape(-1, shape[-1])).reshape(*shape[:-1], self.out_features)
        if x.shape[1] != self.in_features:  # the packing pads the inputs, so the kernel cannot tell
            raise ValueError(f"input {tuple(x.shape)} does not fit a linear of {self.in_features} inputs")
        return self.lib.linear_pairs(x.to(torch.bfloat16), self.packed_weight, self.out_features, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"weight=bf16, compute={'AMX tiles' if self.lib.pairs_amx else 'bf16 dot products'}, packed=C kernel")


@functools.cache
def mkldnn_linear_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether oneDNN packs and multiplies ``dtype`` weights here. torch refuses bf16 weights on a
    CPU without AVX-512 BW/VL/DQ or AVX-NE-CONVERT (an AVX2 one, or one capped at AVX2 by
    ``PAGEWIRE_CPU_ISA``): asked once per dtype, with a small weight."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), None)
    except RuntimeError:
        return False
    return True


class PackedLinear(nn.Module):
    """``y = x W^T + b`` with W kept only in oneDNN's packed layout. Input [N, in] -> [N, out]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None), persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().clone(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            shape = x.shape
            return self.forward(x.reshape(-1, shape[-1])).reshape(*shape[:-1], self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, packed=oneDNN"


class PackedRowParallel(nn.Module):
    """A row-parallel linear (``layers.linear.RowParallelLinear``) with its weight packed: the
    partial product, one all-reduce, then the bias."""

    def __init__(self, packed: nn.Module, bias: torch.Tensor | None, tp):
        super().__init__()
        self.packed = packed
        self.register_buffer("bias", None if bias is None else bias.detach().clone(), persistent=False)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(self.packed(x))
        return y if self.bias is None else y.add_(self.bias)


def replace_linears(model: nn.Module, make_linear) -> int:
    """Replace every ``nn.Linear`` in ``model`` with ``make_linear(weight, bias)`` (row-parallel ones
    keep their all-reduce around it), and give the model's output head (``lm_head_weight()``, tied or
    not) a ``packed_lm_head`` made the same way. Returns how many were made."""
    replaced = 0
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                packed = child.packed(make_linear) if hasattr(child, "packed") else make_linear(child.weight, child.bias)
                setattr(module, child_name, packed)
                replaced += 1
    if hasattr(model, "packed_lm_head"):
        model.packed_lm_head = make_linear(model.lm_head_weight(), None)
        if getattr(model, "lm_head", None) is not None:  # its own weight: keep the packed copy only
            model.lm_head.weight.data = model.lm_head.weight.data.new_empty(0)
        replaced += 1
    return replaced


# (vendor, x86 family) whose AVX-512 is half width. AMD family 25 with AVX-512 is Zen 4 (without
# it, Zen 3): each 512-bit FMA runs as two 256-bit halves, so AVX-512 adds no FMA throughput there
# (117 GFLOP/s per core with either width, measured). Zen 5 (family 26) has full-width units.
_HALF_WIDTH_AVX512 = (("AuthenticAMD", 25),)


def kernel_beats_onednn(cpu: features.CpuInfo) -> bool:
    """Whether fp32 linears go to the C kernel: on AVX2 CPUs without AVX-512, and on AMD Zen 4,
    whose AVX-512 is half width, where it is measured faster (``benchmarks/cpu_linear.py``: 1.6x
    oneDNN at 32 rows on Zen 3, 1.1-1.3x on Zen 4). With full-width AVX-512, oneDNN multiplies 16
    floats per FMA to the kernel's 8, and keeps the linears."""
    if "avx2" not in cpu.flags:
        return False
    return "avx512f" not in cpu.flags or (cpu.vendor, cpu.family) in _HALF_WIDTH_AVX512


def pair_instructions(cpu: features.CpuInfo, lib: LinearKernel) -> str | None:
    """What a bf16 model's linears multiply on in the kernel's bf16-pair layout, or None where
    oneDNN's bf16 is faster (``benchmarks/cpu_linear.py``, a pass through SmolLM2's linears):

    * AMX tiles, on CPUs with AMX-BF16 where Linux grants the process the tiles (Intel Xeon,
      Sapphire Rapids on): 1.26-1.28x oneDNN's bf16, itself on AMX, at 32 rows, 1.08x at 64 and
      0.91x at 512 (a long prefill) on Emerald Rapids;
    * AVX-512 BF16 dot products on CPUs with them and no AMX (AMD Zen 4): 1.25x oneDNN's bf16 at
      32 rows, over 80% of the dot products' peak. On Intel CPUs with AMX a dot product has half
      the throughput of an fp32 FMA, and the tiles or oneDNN win.
    """
    if "amx_bf16" in cpu.flags:
        return "AMX tiles" if lib.pairs_amx else None
    if "avx512_bf16" in cpu.flags and lib.pairs_simd:
        return "AVX-512 BF16 dot products"
    return None


def pack_linears_for_cpu(model: nn.Module) -> str | None:
    """Pack every linear of ``model`` on CPU: fp32 weights for the C kernel where
    :func:`kernel_beats_onednn`, bf16 weights in its pair layout where :func:`pair_instructions`
    names what multiplies them (a C compiler is needed for both), else for oneDNN. Returns what
    the linears run on, for the log; None (nothing changed) off CPU, for other dtypes, or when
    neither is available."""
    first = next(model.parameters(), None)
    if first is None or first.device.type != "cpu" or first.dtype not in (torch.float32, torch.bfloat16):
        return None
    cpu = features.cpu_info()
    if first.dtype == torch.float32 and kernel_beats_onednn(cpu) and (lib := kernel()) is not None:
        replace_linears(model, functools.partial(KernelLinear, lib=lib))
        return f"C kernel, fp32 weights ({cpu.isa})"
    if first.dtype == torch.bfloat16 and (lib := kernel()) is not None and (how := pair_instructions(cpu, lib)):
        replace_linears(model, functools.partial(PairLinear, lib=lib))
        return f"C kernel, bf16 weights, {how} ({cpu.isa})"
    if not mkldnn_linear_available(first.dtype):
        return None
    try:
        replace_linears(model, PackedLinear)
    except RuntimeError as e:  # an unusual oneDNN build: keep the plain path
        log.warning("oneDNN weight packing failed (%s); using plain CPU matmuls", e)
        return None
    return f"oneDNN, prepacked {'bf16' if first.dtype == torch.bfloat16 else 'fp32'} weights ({cpu.isa or 'unknown ISA'})"
