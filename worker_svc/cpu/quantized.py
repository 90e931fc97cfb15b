"""Linears whose weights stay quantized on CPU: GGUF Q4_0, Q4_1 and Q8_0 blocks, and weight-only
int8 (``--quantization int8``, Q8_0's format: 32 int8 and one fp16 scale per block) made at load.

A decode step of one stream reads every weight once, so its time is the bytes read: 4.5 to 8.5
bits a weight here against 16 (bf16) or 32 (fp32). The C kernel (``csrc/quant.c``) keeps the
blocks, repacked at load into tiles of 32 output columns x 32 inputs of the same size, and
dequantizes each weight to fp32 in registers (bit for bit the dequantized model's weight,
``dequantize_ref``). It then computes in the model's dtype where it can:

- fp32 activations: an fp32 FMA per weight; the model computes what its dequantized fp32 copy
  computes, up to the order of the sums;
- bf16 activations, on CPUs with AVX-512 BF16: each fp32 weight rounded to bf16 (torch's cast of
  the dequantized weight) and multiplied by ``vdpbf16ps`` dot products, fp32 sums in the order of
  ``csrc/linear.c``'s bf16 kernel, output bf16: where that kernel serves the dense bf16 model made
  from the same file (AVX-512 BF16 without AMX), the quantized model computes its bits exactly.
  On CPUs with AMX every call multiplies the same bf16 weights on the tiles (tdpbf16ps), about one
  output in 10^4 rounded otherwise than the dot products would, and the same bits as the dense
  model's pairs on the tiles.
  Elsewhere a bf16 model computes in fp32 (:func:`compute_quantized_model`).

:class:`QuantLinear` replaces an ``nn.Linear`` (one or several packed parts, their outputs side by
side, as q/k/v fused from tensors of different types); :class:`QuantEmbedding` looks up rows of a
packed table (a tied table is also the output head, one copy). :func:`quantize_model_int8` turns
a loaded model's linears and head into int8 ones. :func:`resident_weight_bytes` counts what the
weights hold in memory, for the start-up log line.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import pathlib
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from worker_svc.cpu import build
from worker_svc.cpu.linear import TilesFrom

log = logging.getLogger("pagewire.worker")

_SOURCE = pathlib.Path(__file__).parent / "csrc" / "quant.c"
_ABI = 5
GROUP = 32  # output columns of a packed group (csrc/quant.c)
QK = 32  # weights of a block


class BlockType(NamedTuple):
    """A GGUF block format: its ggml type id, name, bytes per 32-weight block."""

    id: int
    name: str
    block_bytes: int


Q4_0 = BlockType(2, "Q4_0", 18)
Q4_1 = BlockType(3, "Q4_1", 20)
Q8_0 = BlockType(8, "Q8_0", 34)
BLOCK_TYPES = {t.id: t for t in (Q4_0, Q4_1, Q8_0)}
SUPPORTED = ", ".join(t.name for t in BLOCK_TYPES.values())


def block_type(type_id: int, what: str = "a weight") -> BlockType:
    """The block format of ggml type ``type_id``; ValueError naming it and what is supported."""
    found = BLOCK_TYPES.get(int(type_id))
    if found is None:
        try:
            import gguf

            name = gguf.GGMLQuantizationType(int(type_id)).name
        except (ImportError, ValueError):
            name = f"type {type_id}"
        raise ValueError(f"{what} is {name}, which is not served quantized; supported block types: {SUPPORTED} "
                         "(and F32, F16, BF16 tensors), or serve the file dequantized (--gguf-weights dequantize)")
    return found


def padded_columns(n: int) -> int:
    return -(-n // GROUP) * GROUP


def pack_blocks(blocks: torch.Tensor, btype: BlockType, n: int, k: int) -> torch.Tensor:
    """:func:`pack_blocks_ref` in C where the kernel is built."""
    lib = kernel()
    if lib is None:
        return pack_blocks_ref(blocks, btype, n, k)
    if k % QK:
        raise ValueError(f"a {btype.name} weight needs a multiple of {QK} inputs, got {k}")
    blocks = blocks.contiguous()
    if blocks.numel() != n * k // QK * btype.block_bytes:
        raise ValueError(f"{blocks.numel()} bytes of blocks do not hold a {btype.name} weight [{n}, {k}]")
    out = torch.empty(padded_columns(n) * k // QK * btype.block_bytes, dtype=torch.uint8)
    lib.pack(btype.id, blocks.data_ptr(), n, k, out.data_ptr())
    return out


def pack_blocks_ref(blocks: torch.Tensor, btype: BlockType, n: int, k: int) -> torch.Tensor:
    """GGUF blocks of a weight [n, k] (uint8 [n, k / 32 * block_bytes], row-major as in the file)
    -> the kernel's layout: uint8 [ceil(n / 32) * (k / 32) * 32 * block_bytes], tiles of 32
    columns x 32 inputs (``csrc/quant.c``); columns past n are zero."""
    if k % QK:
        raise ValueError(f"a {btype.name} weight needs a multiple of {QK} inputs, got {k}")
    nb, bb = k // QK, btype.block_bytes
    blocks = blocks.reshape(n, nb, bb)
    if padded_columns(n) != n:
        blocks = torch.cat([blocks, blocks.new_zeros(padded_columns(n) - n, nb, bb)])
    groups = padded_columns(n) // GROUP
    tiles = blocks.view(groups, GROUP, nb, bb).transpose(1, 2)  # [G, nb, 32 columns, bb]
    scales = tiles[..., :2].reshape(groups, nb, 2 * GROUP)  # d of each column, fp16
    parts = [scales]
    if btype is Q8_0:
        parts.append(tiles[..., 2:].transpose(2, 3).reshape(groups, nb, QK * GROUP))  # [i][column]
    else:
        if btype is Q4_1:
            parts.append(tiles[..., 2:4].reshape(groups, nb, 2 * GROUP))  # m of each column
        qs = tiles[..., -16:]  # byte i: weight i (low nibble), weight i + 16 (high nibble)
        q = torch.cat([qs & 15, qs >> 4], dim=-1)  # [G, nb, 32 columns, 32 weights]
        pairs = q[..., 0::2] | (q[..., 1::2] << 4)  # [G, nb, 32 columns, 16 pairs]
        parts.append(pairs.transpose(2, 3).reshape(groups, nb, QK // 2 * GROUP))
    return torch.cat(parts, dim=-1).reshape(-1).contiguous()


def dequantize_ref(packed: torch.Tensor, btype: BlockType, n: int, k: int) -> torch.Tensor:
    """The reference: the packed weight as fp32 [n, k], in plain torch."""
    nb, groups = k // QK, padded_columns(n) // GROUP
    tiles = packed.view(groups, nb, GROUP * btype.block_bytes)
    d = tiles[..., : 2 * GROUP].contiguous().view(torch.float16).float().unsqueeze(-1)  # [G, nb, 32, 1]
    if btype is Q8_0:
        q = tiles[..., 2 * GROUP :].contiguous().view(torch.int8).view(groups, nb, QK, GROUP).transpose(2, 3).float()
        w = q * d
    else:
        pairs = tiles[..., -QK // 2 * GROUP :].reshape(groups, nb, QK // 2, GROUP).transpose(2, 3)
        q = torch.stack([pairs & 15, pairs >> 4], dim=-1).reshape(groups, nb, GROUP, QK).float()
        if btype is Q4_0:
            w = (q - 8) * d
        else:
            m = tiles[..., 2 * GROUP : 4 * GROUP].contiguous().view(torch.float16).float().unsqueeze(-1)
            w = d * q + m
    return w.permute(0, 2, 1, 3).reshape(padded_columns(n), k)[:n].contiguous()  # [G, 32, nb, 32] -> [n, k]


def quantize_q8_0(weight: torch.Tensor) -> torch.Tensor:
    """weight [n, k] (k a multiple of 32) -> Q8_0 blocks uint8 [n, k / 32 * 34]: d = max |w| / 127
    per block, rounded to fp16 (as stored), q = round(w / d): each weight within d / 2."""
    n, k = weight.shape
    blocks = weight.detach().float().reshape(n, k // QK, QK)
    d = (blocks.abs().amax(-1, keepdim=True) / 127).half().float()
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = torch.round(blocks * inv).clamp_(-128, 127).to(torch.int8)
    return torch.cat([d.half().view(torch.uint8), q.view(torch.uint8)], dim=-1).reshape(n, -1)


class QuantKernel(TilesFrom):
    """The loaded C library, with torch-facing calls."""

    def __init__(self, lib: ctypes.CDLL):
        p, i64, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self._linear = lib.quant_linear
        self._linear.restype = None
        self._linear.argtypes = [c_int, p, i64, p, p, p, i64, i64, i64, i64]
        self._rows = lib.quant_rows
        self._rows.restype = None
        self._rows.argtypes = [c_int, p, p, i64, i64, i64, p]
        self.pack = lib.quant_pack
        self.pack.restype = None
        self.pack.argtypes = [c_int, p, i64, i64, p]
        self.simd = int(lib.quant_simd())
        self._linear_bf16 = lib.quant_linear_bf16
        self._linear_bf16.restype = None
        self._linear_bf16.argtypes = [c_int, p, i64, p, p, p, i64, i64, i64, i64]
        # bf16 activations on AVX-512 BF16 dot products (else a portable loop, for tests)
        self.bf16_simd = bool(lib.quant_bf16_simd())
        # bf16 activations on AMX tiles, for calls of `tiles_from` rows or more (csrc/quant.c)
        self.bf16_amx = bool(lib.quant_bf16_amx())
        self._bind_tiles_from(lib.quant_bf16_tiles_from)
        self._exact_rows = lib.quant_bf16_exact_rows
        self._exact_rows.restype = i64
        self._exact_rows.argtypes = [i64]
        self._linear_i8 = lib.quant_linear_i8
        self._linear_i8.restype = None
        self._linear_i8.argtypes = [c_int, p, i64, p, p, p, i64, i64, i64, i64]
        # int8 activations: 2 on AVX-512 VNNI dot products, 1 on AVX2 integer products, 0 for a
        # portable loop (all three compute the same bits)
        self.i8_simd = int(lib.quant_i8_simd())

    def linear(self, x: torch.Tensor, packed: torch.Tensor, btype: BlockType, out_features: int,
               bias: torch.Tensor | None, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] fp32 -> [M, N] fp32 (into ``out``, a view with contiguous rows, when given)."""
        return self._fp32_call(self._linear, x, packed, btype, out_features, bias, out)

    def linear_i8(self, x: torch.Tensor, packed: torch.Tensor, btype: BlockType, out_features: int,
                  bias: torch.Tensor | None, out: torch.Tensor | None = None) -> torch.Tensor:
        """As :meth:`linear`, with each row of x rounded to int8 per block of 32 inputs and multiplied
        in integers (``--int8-activations``; csrc/quant.c says how)."""
        return self._fp32_call(self._linear_i8, x, packed, btype, out_features, bias, out)

    @staticmethod
    def _fp32_call(fn, x: torch.Tensor, packed: torch.Tensor, btype: BlockType, out_features: int,
                   bias: torch.Tensor | None, out: torch.Tensor | None) -> torch.Tensor:
        m, k = x.shape
        if x.dtype != torch.float32 or x.device.type != "cpu":
            raise ValueError(f"the quantized CPU linear takes float32 CPU inputs, got {x.dtype} on {x.device}")
        if k % QK or packed.numel() != padded_columns(out_features) * k // QK * btype.block_bytes:
            raise ValueError(f"input [{m}, {k}] does not fit a packed {btype.name} weight of {out_features} outputs")
        if x.stride(1) != 1:
            x = x.contiguous()
        if out is None:
            out = torch.empty((m, out_features), dtype=torch.float32)
        if m:
            fn(btype.id, x.data_ptr(), x.stride(0), packed.data_ptr(), None if bias is None else bias.data_ptr(),
               out.data_ptr(), out.stride(0), m, out_features, k)
        return out

    def linear_bf16(self, x: torch.Tensor, packed: torch.Tensor, btype: BlockType, out_features: int,
                    bias: torch.Tensor | None, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] bf16 -> [M, N] bf16 (``bias`` fp32), into ``out`` (bf16, contiguous rows) when
        given: up to :attr:`exact_rows` rows in exact integer products, more with the weights rounded
        to bf16 and sums in fp32."""
        m, k = x.shape
        if x.dtype != torch.bfloat16 or x.device.type != "cpu":
            raise ValueError(f"the quantized bf16 CPU linear takes bfloat16 CPU inputs, got {x.dtype} on {x.device}")
        if k % QK or packed.numel() != padded_columns(out_features) * k // QK * btype.block_bytes:
            raise ValueError(f"input [{m}, {k}] does not fit a packed {btype.name} weight of {out_features} outputs")
        if x.stride(1) != 1 or x.stride(0) % 2 or x.data_ptr() % 4:  # the kernel reads x in aligned pairs
            x = x.clone(memory_format=torch.contiguous_format)
        if out is None:
            out = torch.empty((m, out_features), dtype=torch.bfloat16)
        if m:
            self._linear_bf16(btype.id, x.data_ptr(), x.stride(0), packed.data_ptr(),
                              None if bias is None else bias.data_ptr(), out.data_ptr(), out.stride(0), m,
                              out_features, k)
        return out

    @property
    def exact_rows(self) -> int:
        """Calls of :meth:`linear_bf16` of up to this many rows multiply in exact integer products
        (x split into three int8 digits per block; csrc/quant.c says how); 0 where this build or CPU
        has no such path, or where it is turned off (``--deterministic``)."""
        return int(self._exact_rows(-2))

    @exact_rows.setter
    def exact_rows(self, rows: int | None) -> None:
        """``rows`` (0: none), or None for the kernel's default (4 where the AMX tiles are granted, else
        0). Where the build has no such path it stays 0."""
        if rows is not None and rows < 0:
            raise ValueError(f"exact_rows must be at least 0, got {rows}")
        self._exact_rows(-1 if rows is None else rows)

    def rows(self, packed: torch.Tensor, btype: BlockType, ids: torch.Tensor, n: int, k: int) -> torch.Tensor:
        """Rows ``ids`` [T] of a packed table [n, k], dequantized: [T, k] fp32."""
        ids = ids.to(torch.int64).contiguous()
        out = torch.empty((ids.numel(), k), dtype=torch.float32)
        self._rows(btype.id, packed.data_ptr(), ids.data_ptr(), ids.numel(), n, k, out.data_ptr())
        return out


@functools.cache
def kernel() -> QuantKernel | None:
    """The kernel, built on first call; None (after one warning) when it cannot be built."""
    lib = build.load(_SOURCE, "pagewire_cpu_quant_abi", _ABI, "quantized weights are dequantized in torch per call")
    return None if lib is None else QuantKernel(lib)


class QuantPart(NamedTuple):
    """One packed weight: ``out_features`` x ``in_features`` in ``btype``'s blocks."""

    btype: BlockType
    packed: torch.Tensor  # uint8, csrc/quant.c's layout
    out_features: int


def merge_parts(parts: list[QuantPart]) -> list[QuantPart]:
    """Adjacent parts of one block type as one part, where the earlier ones fill whole groups of
    32 columns: the packed layout is group after group, so their packed bytes side by side are the
    packing of the stacked weight, and one kernel call covers them (q, k and v of one type: one
    call instead of three, the same sums)."""
    merged: list[QuantPart] = []
    for part in parts:
        last = merged[-1] if merged else None
        if last is not None and last.btype is part.btype and last.out_features % GROUP == 0:
            merged[-1] = QuantPart(part.btype, torch.cat([last.packed, part.packed]),
                                   last.out_features + part.out_features)
        else:
            merged.append(part)
    return merged


class QuantLinear(nn.Module):
    """``y = x W^T + b`` with W kept as packed blocks, one or several parts side by side along the
    outputs (``parts``: q, k and v, or gate and up, when their types differ); b fp32, x and y in
    ``compute_dtype``: fp32, or bf16 (set by :func:`compute_quantized_model` where the kernel has
    AVX-512 BF16). Input [..., in] -> [..., out]. ``types`` and ``sizes`` name the source parts;
    the packed ones (:meth:`parts`) are those merged where one call covers several
    (:func:`merge_parts`)."""

    def __init__(self, parts: list[QuantPart], in_features: int, bias: torch.Tensor | None = None):
        super().__init__()
        self.in_features = in_features
        self.out_features = sum(p.out_features for p in parts)
        self.types = [p.btype for p in parts]
        self.sizes = [p.out_features for p in parts]
        packed = merge_parts(parts)
        self.packed_types = [p.btype for p in packed]
        self.packed_sizes = [p.out_features for p in packed]
        for i, part in enumerate(packed):
            self.register_buffer(f"packed_{i}", part.packed, persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous(), persistent=False)
        self.lib = kernel()
        self.compute_dtype = torch.float32
        # fp32 inputs rounded to int8 per block and multiplied in integers (--int8-activations)
        self.int8_activations = False

    def parts(self) -> list[QuantPart]:
        """The packed parts, side by side along the outputs."""
        return [QuantPart(t, getattr(self, f"packed_{i}"), n)
                for i, (t, n) in enumerate(zip(self.packed_types, self.packed_sizes))]

    def dequantized(self) -> torch.Tensor:
        """The weight as fp32 [out, in] (the reference; the fallback without a C compiler)."""
        return torch.cat([dequantize_ref(p.packed, p.btype, p.out_features, self.in_features) for p in self.parts()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            shape = x.shape
            return self.forward(x.reshape(-1, shape[-1])).reshape(*shape[:-1], self.out_features)
        if self.lib is None:
            return F.linear(x.float(), self.dequantized(), self.bias)
        x = x.to(self.compute_dtype)
        linear = (self.lib.linear_bf16 if self.compute_dtype == torch.bfloat16 else
                  self.lib.linear_i8 if self.int8_activations else self.lib.linear)
        parts = self.parts()
        if len(parts) == 1:
            return linear(x, parts[0].packed, parts[0].btype, self.out_features, self.bias)
        out = torch.empty((x.shape[0], self.out_features), dtype=self.compute_dtype)
        start = 0
        for part in parts:
            bias = None if self.bias is None else self.bias[start : start + part.out_features]
            linear(x, part.packed, part.btype, part.out_features, bias, out=out[:, start : start + part.out_features])
            start += part.out_features
        return out

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"weight={'+'.join(t.name for t in self.types)}, "
                f"compute={self._compute_name()}")

    def _compute_name(self) -> str:
        if self.compute_dtype == torch.bfloat16:
            return "bf16 dot products"
        return "int8 activations" if self.int8_activations else "fp32"


class QuantEmbedding(nn.Module):
    """ids [T] -> [T, hidden] in the head's ``compute_dtype``, the rows of a packed table
    dequantized on lookup (fp32, then cast: bf16 rows are the dense bf16 table's). ``head``
    multiplies by the same table (a tied output head)."""

    def __init__(self, head: QuantLinear):
        super().__init__()
        if len(head.types) != 1:
            raise ValueError("a quantized embedding table is one packed part")
        self.head = head
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        part = self.head.parts()[0]
        if self.head.lib is None:
            rows = F.embedding(input_ids, dequantize_ref(part.packed, part.btype, self.num_embeddings, self.embedding_dim))
        else:
            rows = self.head.lib.rows(part.packed, part.btype, input_ids, self.num_embeddings, self.embedding_dim)
        return rows.to(self.head.compute_dtype)


def quantized_linear_of(weight: torch.Tensor, bias: torch.Tensor | None) -> QuantLinear:
    """An int8 (Q8_0 blocks) :class:`QuantLinear` of a dense weight [n, k]; k is padded with zero
    inputs to a multiple of 32 (the input is padded alike in :class:`PaddedInput`)."""
    n, k = weight.shape
    padded = -(-k // QK) * QK
    if padded != k:
        weight = F.pad(weight.detach().float(), (0, padded - k))
    linear = QuantLinear([QuantPart(Q8_0, pack_blocks(quantize_q8_0(weight), Q8_0, n, padded), n)], padded, bias)
    return linear if padded == k else PaddedInput(linear, k)


class PaddedInput(nn.Module):
    """A :class:`QuantLinear` of ``in_features`` padded to a multiple of 32: the input padded with zeros."""

    def __init__(self, linear: QuantLinear, in_features: int):
        super().__init__()
        self.linear, self.in_features, self.out_features = linear, in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(F.pad(x, (0, self.linear.in_features - self.in_features)))


def quantize_model_int8(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` of a loaded one-rank model with an int8 :class:`QuantLinear` and,
    unless it has one, give it an int8 ``packed_lm_head``; a tied input embedding becomes a
    :class:`QuantEmbedding` of the same table (one copy). Returns how many were quantized."""
    count = 0
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, child_name, quantized_linear_of(child.weight, child.bias))
                count += 1
    if hasattr(model, "packed_lm_head") and model.packed_lm_head is None:
        tied = getattr(model, "lm_head", None) is None
        head = quantized_linear_of(model.lm_head_weight(), None)
        model.packed_lm_head = head
        count += 1
        if tied and isinstance(head, QuantLinear) and hasattr(model, "model"):
            for name, module in model.model.named_children():
                if module.__class__.__name__ == "VocabParallelEmbedding":
                    setattr(model.model, name, QuantEmbedding(head))
        elif not tied:
            model.lm_head = None  # the packed head holds its weight
    return count


def resident_weight_bytes(model: nn.Module) -> int:
    """Bytes the model's weights hold in memory: parameters and weight buffers (packed blocks,
    biases), each storage once; rotary tables are not weights."""
    seen: set[int] = set()
    total = 0
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor is None or "rotary" in name or "cos_sin" in name:
            continue
        key = tensor.untyped_storage().data_ptr()
        if key in seen or tensor.device.type == "meta":
            continue
        seen.add(key)
        total += tensor.untyped_storage().nbytes()
    return total


def is_quantized(model: nn.Module) -> bool:
    return any(isinstance(m, QuantLinear) for m in model.modules())


def bf16_kernel_available() -> bool:
    """Whether a quantized linear multiplies bf16 activations natively here: the CPU has AVX-512
    BF16 and the kernel was built with it."""
    from worker_svc.cpu.features import cpu_info

    lib = kernel()
    return lib is not None and lib.bf16_simd and "avx512_bf16" in cpu_info().flags


def compute_quantized_model(model: nn.Module, dtype: torch.dtype, *, int8_activations: bool = False,
                            deterministic: bool = False) -> tuple[torch.dtype, str]:
    """Make a model with quantized linears compute in ``dtype`` where the kernel multiplies it:
    bf16 where :func:`bf16_kernel_available` (every quantized linear, the embedding lookup and the
    head take and return bf16; the other parameters stay as loaded, in bf16, as in the dense bf16
    model), else fp32, as its dequantized fp32 copy does: every other parameter and floating buffer
    becomes fp32 (norms, dense linears and tables), rotary tables are recomputed in fp32. The KV
    cache keeps ``dtype`` either way. ``int8_activations``: fp32, every quantized linear multiplying
    its inputs rounded to int8 (:meth:`QuantKernel.linear_i8`). ``deterministic``: bf16 calls of few
    rows on the tiles too, not in exact integer products (:attr:`QuantKernel.exact_rows`), so a row's
    bits do not depend on its batch. Returns the dtype it computes in and, for the log, what the
    linears run on."""
    from worker_svc.cpu.bf16_linear import rest_in_fp32
    from worker_svc.cpu.features import cpu_info

    types = sorted({t.name for m in model.modules() if isinstance(m, QuantLinear) for t in m.types})
    lib, isa = kernel(), cpu_info().isa
    if int8_activations:
        if lib is None:
            raise ValueError("--int8-activations needs the C kernel, which could not be built here (no C compiler?)")
        rest_in_fp32(model, keep=(QuantLinear, QuantEmbedding))
        for module in model.modules():
            if isinstance(module, QuantLinear):
                module.int8_activations = True
        where = {2: "AVX-512 VNNI dot products", 1: "AVX2 integer products"}.get(lib.i8_simd)
        where = f"{where}, {isa}" if where else "portable build"
        return torch.float32, (f"quantized {'/'.join(types)} weights, activations rounded to int8 per block of 32 "
                               f"(--int8-activations; C kernel, {where})")
    if dtype == torch.bfloat16 and bf16_kernel_available():
        for module in model.modules():
            if isinstance(module, QuantLinear):
                module.compute_dtype = torch.bfloat16
        on = "AMX tiles" if lib.bf16_amx else "AVX-512 BF16 dot products"
        lib.exact_rows = 0 if deterministic else None
        if lib.exact_rows:
            s = "" if lib.exact_rows == 1 else "s"
            on = f"{on}; calls of up to {lib.exact_rows} row{s} in exact integer products"
        return torch.bfloat16, f"quantized {'/'.join(types)} weights, bf16 arithmetic (C kernel, {on}, {isa})"
    rest_in_fp32(model, keep=(QuantLinear, QuantEmbedding))
    where = "no C compiler: dequantized per call" if lib is None else (
        f"C kernel, {lib.simd}-bit vectors, {isa}" if lib.simd else "C kernel, portable build")
    why = ""
    if dtype == torch.bfloat16:
        why = ("; --dtype bfloat16 computes in fp32 here, as this CPU has no AVX-512 BF16" if "avx512_bf16" not in
               cpu_info().flags else "; --dtype bfloat16 computes in fp32 here, as the kernel was built without AVX-512 BF16")
    return torch.float32, f"quantized {'/'.join(types)} weights, fp32 arithmetic ({where}){why}"
