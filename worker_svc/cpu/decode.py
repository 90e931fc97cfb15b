"""A lean pass through a Llama-family model with quantized linears on CPU for small steps.

At one row a decoder layer's kernels take ~60 µs on two Zen 5 cores (SmolLM2-135M from its GGUF
blocks), and the modules around them took ~120 µs more: each linear, norm, activation, rotary
and attention call went through ``nn.Module``, shape checks, ``torch.empty`` and views, and the K/V
append and the attention through ``kvcache.paged``'s torch scatter and dispatch. This pass makes
the same C calls in the same order with the same inputs, over buffers it keeps per step size and
pointers it works out once per step: the tokens are bit for bit the modules' (held so by
``tests/test_cpu_decode.py``). The layer loop itself is C (``csrc/decode.c``, handed the kernels'
addresses, the step's pointers and each layer's weights as a row of int64), one ctypes call a step:
a loop in Python makes about thirteen a layer plus two torch adds, up to half a millisecond a token
of SmolLM2 (docs/benchmarks.md, section 7).

It serves a step when the model qualifies (:meth:`QuantDecode.of`: one rank, every layer's
linears quantized (:class:`~worker_svc.cpu.quantized.QuantLinear`) in one compute dtype, the
fused C norms, SiLU and rotary on, Llama's attention without per-head norms, the C attention
kernel registered, the KV cache in the compute dtype) and the step is small
(:meth:`QuantDecode.accepts`: up to ``MAX_TOKENS`` tokens, no chunk longer than the C attention
kernel takes); other steps run the modules.
"""

from __future__ import annotations

import ctypes
import functools
import pathlib
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from kvcache.paged import AttentionMetadata, PagedKVCache
from worker_svc.cpu import attention as cpu_attention
from worker_svc.cpu import build
from worker_svc.cpu.fused import FusedKernels
from worker_svc.cpu.quantized import QuantEmbedding, QuantLinear

_SOURCE = pathlib.Path(__file__).parent / "csrc" / "decode.c"
_ABI = 2

# steps of up to this many tokens take the lean pass; larger ones amortize the modules' overhead
MAX_TOKENS = 32
# the longest chunk kvcache.paged sends to the C kernel (its _CPU_KERNEL_MAX_QUERY_LEN)
MAX_QUERY_LEN = 32


class _Call(NamedTuple):
    """One quantized kernel call: packed part ``packed`` of block type ``type_id`` for output
    columns [start, start + n), with its slice of the bias (a pointer, or None)."""

    type_id: int
    packed: int
    bias: int | None
    start: int
    n: int


def _calls(linear: QuantLinear) -> list[_Call]:
    calls, start = [], 0
    bias = linear.bias
    for part in linear.parts():
        part_bias = None if bias is None else bias.data_ptr() + 4 * start
        calls.append(_Call(part.btype.id, part.packed.data_ptr(), part_bias, start, part.out_features))
        start += part.out_features
    return calls


class _Fns(ctypes.Structure):
    """csrc/decode.c's ``struct decode_fns``: the kernels' addresses."""

    _fields_ = [(name, ctypes.c_void_p) for name in ("linear", "rms_norm", "silu_mul", "rotary", "attention",
                                                      "kv_write")]


class _Step(ctypes.Structure):
    """csrc/decode.c's ``struct decode_step``: one step's sizes and pointers."""

    _fields_ = [
        *[(name, ctypes.c_int64) for name in ("tokens", "hidden_size", "q_size", "kv_size", "intermediate",
                                              "num_heads", "num_kv_heads", "head_dim", "element")],
        ("eps", ctypes.c_float), ("scale", ctypes.c_float),
        *[(name, ctypes.c_void_p) for name in ("hidden", "normed", "qkv", "query", "attn", "proj", "gate_up", "act",
                                               "cos", "sin", "slots", "query_start_loc", "seq_lens",
                                               "block_tables")],
        *[(name, ctypes.c_int64) for name in ("table_stride", "num_seqs", "num_blocks", "block_size")],
        ("kv", ctypes.c_void_p), ("layer_bytes", ctypes.c_int64),
    ]


class _Driver:
    """The loaded csrc/decode.c."""

    def __init__(self, lib: ctypes.CDLL):
        self.decode_layers = lib.decode_layers
        self.decode_layers.restype = ctypes.c_int
        self.decode_layers.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
        for name in ("decode_layer_words", "decode_max_parts", "decode_kv_slot_error"):
            getattr(lib, name).restype = ctypes.c_int64
        self.layer_words, self.max_parts = int(lib.decode_layer_words()), int(lib.decode_max_parts())
        self.kv_slot_error = int(lib.decode_kv_slot_error())  # decode_layers' code for a slot outside the cache


@functools.cache
def _driver() -> _Driver | None:
    """The layer loop, built on first call; None (after one warning) when it cannot be built."""
    lib = build.load(_SOURCE, "pagewire_cpu_decode_abi", _ABI, "small quantized steps run the modules")
    return None if lib is None else _Driver(lib)


def _address(fn) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value


def _layer_words(layers: nn.ModuleList, driver: _Driver) -> np.ndarray | None:
    """Each layer as csrc/decode.c reads it: its norm weights, then per linear (qkv, o, gate_up,
    down) its number of parts and the parts (block type, packed weight, bias or 0, first column,
    columns). None when a linear has more parts than the driver takes."""
    words = np.zeros((len(layers), driver.layer_words), dtype=np.int64)
    per_linear = 1 + driver.max_parts * len(_Call._fields)
    for i, layer in enumerate(layers):
        row = words[i]
        row[0], row[1] = layer.input_layernorm.weight.data_ptr(), layer.post_attention_layernorm.weight.data_ptr()
        linears = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
        for j, linear in enumerate(linears):
            calls = _calls(linear)
            if len(calls) > driver.max_parts:
                return None
            at = 2 + j * per_linear
            row[at] = len(calls)
            for c, call in enumerate(calls):
                start = at + 1 + c * len(_Call._fields)
                row[start : start + len(_Call._fields)] = [call.type_id, call.packed, call.bias or 0, call.start, call.n]
    return words


class _Buffers:
    """A step size's activations [T, width] in the compute dtype, and their pointers."""

    def __init__(self, num_tokens: int, dtype: torch.dtype, hidden: int, qkv: int, q: int, gate_up: int, inter: int):
        def make(width: int) -> torch.Tensor:
            return torch.empty((num_tokens, width), dtype=dtype)

        self.hidden, self.normed, self.qkv, self.query, self.attn = make(hidden), make(hidden), make(qkv), make(q), make(q)
        self.proj, self.gate_up, self.act = make(hidden), make(gate_up), make(inter)


class QuantDecode:
    """The lean pass of one prepared model (see the module's docstring)."""

    def __init__(self, model: nn.Module, fused: FusedKernels, attention: cpu_attention.AttentionKernel,
                 dtype: torch.dtype, driver: _Driver, words: np.ndarray):
        self.model = model
        self.dtype = dtype
        self.element = torch.empty((), dtype=dtype).element_size()
        first = model.model.layers[0]
        lib = first.self_attn.qkv_proj.lib
        linear = (lib._linear_bf16 if dtype == torch.bfloat16 else
                  lib._linear_i8 if first.self_attn.qkv_proj.int8_activations else lib._linear)
        self._fns = _Fns(_address(linear),
                         _address(fused._rms_norm[dtype]), _address(fused._silu_mul[dtype]),
                         _address(fused._rotary[dtype]), _address(attention.function(dtype, dtype)),
                         _address(attention.kv_write))
        self._decode_layers, self._kv_slot_error = driver.decode_layers, driver.kv_slot_error
        self._words = words  # kept: the driver reads it in place
        attn = first.self_attn
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.q_size, self.kv_size, self.scale = attn.q_size, attn.kv_size, attn.attn.scale
        self.hidden_size = first.input_layernorm.weight.shape[0]
        self.eps = first.input_layernorm.eps
        self.intermediate = first.mlp.down_proj.in_features
        self._buffers: dict[int, _Buffers] = {}

    @classmethod
    def of(cls, model: nn.Module) -> QuantDecode | None:
        """The lean pass for ``model`` (prepared by ``worker_svc.cpu.prepare``), or None where it
        does not qualify."""
        from worker_svc.models.llama import LlamaAttention, LlamaDecoderLayer

        inner = getattr(model, "model", None)
        layers = getattr(inner, "layers", None)
        tp = getattr(model, "tp", None)
        if not layers or tp is None or tp.size != 1:
            return None
        attention = cpu_attention.kernel()
        first = layers[0]
        if attention is None or not isinstance(first, LlamaDecoderLayer):
            return None
        dtype = getattr(first.self_attn.qkv_proj, "compute_dtype", None)
        if dtype not in (torch.float32, torch.bfloat16) or not attention.supports(dtype):
            return None
        fused = None
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if type(layer) is not type(first) or type(attn).heads is not LlamaAttention.heads:
                return None  # per-head norms (Qwen3) or another layer
            if not all(type(m) is QuantLinear and m.lib is not None and m.compute_dtype == dtype
                       and m.int8_activations == first.self_attn.qkv_proj.int8_activations for m in linears):
                return None
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            kernels = {id(n.cpu_kernels) for n in norms} | {id(mlp.act_fn.cpu_kernels), id(attn.rotary_kernels)}
            fused = norms[0].cpu_kernels
            if fused is None or len(kernels) != 1 or any(n.weight.dtype != dtype for n in norms):
                return None
            if not (attn.qkv_proj.in_features == attn.o_proj.out_features == mlp.gate_up_proj.in_features):
                return None
        embed = inner.embed_tokens
        embed_dtype = embed.head.compute_dtype if isinstance(embed, QuantEmbedding) else (
            getattr(embed, "output_dtype", None) or getattr(embed, "weight", torch.empty(0)).dtype)
        if embed_dtype != dtype:  # the hidden states would change dtype at the first layer
            return None
        driver = _driver()
        words = None if driver is None else _layer_words(layers, driver)
        if words is None:
            return None
        return cls(model, fused, attention, dtype, driver, words)

    def accepts(self, num_tokens: int, kv_cache: PagedKVCache, meta: AttentionMetadata) -> bool:
        """Whether this pass serves a step of ``num_tokens`` tokens over ``kv_cache``."""
        return (0 < num_tokens <= MAX_TOKENS and meta.max_query_len <= MAX_QUERY_LEN and kv_cache.dtype == self.dtype
                and kv_cache.kv.device.type == "cpu")

    def _buffers_for(self, num_tokens: int) -> _Buffers:
        buffers = self._buffers.get(num_tokens)
        if buffers is None:
            qkv = self.q_size + 2 * self.kv_size
            buffers = self._buffers[num_tokens] = _Buffers(num_tokens, self.dtype, self.hidden_size, qkv, self.q_size,
                                                          2 * self.intermediate, self.intermediate)
        return buffers

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: PagedKVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        """What ``LlamaForCausalLM.forward`` returns for the step: [num_sampled, hidden]."""
        model, T = self.model, input_ids.shape[0]
        buffers = self._buffers_for(T)
        hidden_t = buffers.hidden
        hidden_t.copy_(model.model.embed_tokens(input_ids))
        cos, sin = model.model.rotary_emb(positions, self.dtype)  # [T, 1, D / 2]
        cos, sin = cos.contiguous(), sin.contiguous()
        slots = meta.slot_mapping.to(torch.int64).contiguous()
        query_start_loc = meta.query_start_loc.to(torch.int32).contiguous()
        seq_lens = meta.seq_lens.to(torch.int32).contiguous()
        block_tables = meta.block_tables.to(torch.int32).contiguous()
        kv = kv_cache.kv  # [L, 2, N, B, Hkv, D]
        step = _Step(T, self.hidden_size, self.q_size, self.kv_size, self.intermediate, self.num_heads,
                     self.num_kv_heads, self.head_dim, self.element, self.eps, self.scale,
                     hidden_t.data_ptr(), buffers.normed.data_ptr(), buffers.qkv.data_ptr(), buffers.query.data_ptr(),
                     buffers.attn.data_ptr(), buffers.proj.data_ptr(), buffers.gate_up.data_ptr(),
                     buffers.act.data_ptr(), cos.data_ptr(), sin.data_ptr(), slots.data_ptr(),
                     query_start_loc.data_ptr(), seq_lens.data_ptr(), block_tables.data_ptr(), block_tables.shape[1],
                     seq_lens.shape[0], kv_cache.num_blocks, kv_cache.block_size, kv.data_ptr(),
                     kv[0].numel() * self.element)
        rc = self._decode_layers(ctypes.byref(self._fns), ctypes.byref(step), self._words.ctypes.data,
                                 self._words.shape[0])
        if rc == self._kv_slot_error:
            raise ValueError("CPU K/V append: a slot is outside the cache")
        if rc:
            raise ValueError(f"CPU paged attention: {cpu_attention._ERRORS.get(rc, f'error {rc}')}")
        return model.model.norm(hidden_t[meta.logits_indices])
