"""A lean pass through a Llama-family model with quantized linears on CPU for small steps.

At one row a decoder layer's kernels take ~60 µs on two Zen 5 cores (SmolLM2-135M from its GGUF
blocks), and the modules around them took ~120 µs more: each linear, norm, activation, rotary
and attention call went through ``nn.Module``, shape checks, ``torch.empty`` and views, and the K/V
append and the attention through ``kvcache.paged``'s torch scatter and dispatch. This pass makes
the same C calls in the same order with the same inputs, over buffers it keeps per step size and
pointers it works out once per step: the tokens are bit for bit the modules' (held so by
``tests/test_cpu_decode.py``).

It serves a step when the model qualifies (:meth:`QuantDecode.of`: one rank, every layer's
linears quantized (:class:`~worker_svc.cpu.quantized.QuantLinear`) in one compute dtype, the
fused C norms, SiLU and rotary on, Llama's attention without per-head norms, the C attention
kernel registered, the KV cache in the compute dtype) and the step is small
(:meth:`QuantDecode.accepts`: up to ``MAX_TOKENS`` tokens, no chunk longer than the C attention
kernel takes); other steps run the modules.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from kvcache.paged import AttentionMetadata, PagedKVCache
from worker_svc.cpu import attention as cpu_attention
from worker_svc.cpu.fused import FusedKernels
from worker_svc.cpu.quantized import QuantEmbedding, QuantLinear

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


class _Layer(NamedTuple):
    input_norm: int  # weight pointers
    post_norm: int
    qkv: list[_Call]
    o: list[_Call]
    gate_up: list[_Call]
    down: list[_Call]


def _calls(linear: QuantLinear) -> list[_Call]:
    calls, start = [], 0
    bias = linear.bias
    for part in linear.parts():
        part_bias = None if bias is None else bias.data_ptr() + 4 * start
        calls.append(_Call(part.btype.id, part.packed.data_ptr(), part_bias, start, part.out_features))
        start += part.out_features
    return calls


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
                 dtype: torch.dtype):
        self.model = model
        self.dtype = dtype
        self.element = torch.empty((), dtype=dtype).element_size()
        first = model.model.layers[0]
        lib = first.self_attn.qkv_proj.lib
        self.linear = lib._linear_bf16 if dtype == torch.bfloat16 else lib._linear
        self.rms_norm = fused._rms_norm[dtype]
        self.silu_mul = fused._silu_mul[dtype]
        self.rotary = fused._rotary[dtype]
        self.attention = attention.function(dtype, dtype)
        self.kv_write = attention.kv_write
        attn = first.self_attn
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.q_size, self.kv_size, self.scale = attn.q_size, attn.kv_size, attn.attn.scale
        self.hidden_size = first.input_layernorm.weight.shape[0]
        self.eps = first.input_layernorm.eps
        self.intermediate = first.mlp.down_proj.in_features
        self.layers = [
            _Layer(layer.input_layernorm.weight.data_ptr(), layer.post_attention_layernorm.weight.data_ptr(),
                   _calls(layer.self_attn.qkv_proj), _calls(layer.self_attn.o_proj), _calls(layer.mlp.gate_up_proj),
                   _calls(layer.mlp.down_proj))
            for layer in model.model.layers
        ]
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
            if not all(type(m) is QuantLinear and m.lib is not None and m.compute_dtype == dtype for m in linears):
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
        return cls(model, fused, attention, dtype)

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

    def _linear(self, calls: list[_Call], x: int, x_stride: int, y: int, y_stride: int, m: int, k: int) -> None:
        for call in calls:
            self.linear(call.type_id, x, x_stride, call.packed, call.bias, y + call.start * self.element, y_stride, m,
                        call.n, k)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: PagedKVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        """What ``LlamaForCausalLM.forward`` returns for the step: [num_sampled, hidden]."""
        model, T, es = self.model, input_ids.shape[0], self.element
        buffers = self._buffers_for(T)
        hidden_t = buffers.hidden
        hidden_t.copy_(model.model.embed_tokens(input_ids))
        cos, sin = model.model.rotary_emb(positions, self.dtype)  # [T, 1, D / 2]
        cos, sin = cos.contiguous(), sin.contiguous()
        slots = meta.slot_mapping.to(torch.int64).contiguous()
        query_start_loc = meta.query_start_loc.to(torch.int32).contiguous()
        seq_lens = meta.seq_lens.to(torch.int32).contiguous()
        block_tables = meta.block_tables.to(torch.int32).contiguous()
        num_seqs = seq_lens.shape[0]
        kv = kv_cache.kv  # [L, 2, N, B, Hkv, D]
        num_blocks, block_size = kv_cache.num_blocks, kv_cache.block_size
        num_slots, row_bytes = num_blocks * block_size, self.kv_size * es
        layer_bytes = kv[0].numel() * es
        H, Nq, qkv_width, inter = self.hidden_size, self.q_size, self.q_size + 2 * self.kv_size, self.intermediate
        hidden, normed, qkv = hidden_t.data_ptr(), buffers.normed.data_ptr(), buffers.qkv.data_ptr()
        attn_out, proj = buffers.attn.data_ptr(), buffers.proj.data_ptr()
        gate_up, act = buffers.gate_up.data_ptr(), buffers.act.data_ptr()
        k_ptr, v_ptr = qkv + Nq * es, qkv + (Nq + self.kv_size) * es
        # the C attention kernel reads the queries as contiguous [T, H, D]: a lone token's are, in qkv
        query = qkv if T == 1 else buffers.query.data_ptr()
        query_view = buffers.qkv[:, :Nq]
        cos_ptr, sin_ptr, slots_ptr = cos.data_ptr(), sin.data_ptr(), slots.data_ptr()
        qsl_ptr, lens_ptr, tables_ptr = query_start_loc.data_ptr(), seq_lens.data_ptr(), block_tables.data_ptr()
        table_stride = block_tables.shape[1]
        proj_t = buffers.proj
        linear, rms_norm, eps = self._linear, self.rms_norm, self.eps
        kv_base = kv.data_ptr()
        for i, layer in enumerate(self.layers):
            rms_norm(hidden, H, layer.input_norm, eps, normed, T, H)
            linear(layer.qkv, normed, H, qkv, qkv_width, T, H)
            self.rotary(qkv, qkv_width, self.num_heads, k_ptr, qkv_width, self.num_kv_heads, self.head_dim, cos_ptr,
                        sin_ptr, T)
            kv_layer = kv_base + i * layer_bytes
            rc = self.kv_write(kv_layer, num_slots, row_bytes, k_ptr, qkv_width * es, v_ptr, qkv_width * es,
                               slots_ptr, T)
            if rc:
                raise ValueError("CPU K/V append: a slot is outside the cache")
            if T > 1:
                buffers.query.copy_(query_view)
            rc = self.attention(query, kv_layer, attn_out, qsl_ptr, lens_ptr, tables_ptr, table_stride, num_seqs, T,
                                self.num_heads, self.num_kv_heads, self.head_dim, num_blocks, block_size, self.scale, T)
            if rc:
                raise ValueError(f"CPU paged attention: {cpu_attention._ERRORS.get(rc, f'error {rc}')}")
            linear(layer.o, attn_out, Nq, proj, H, T, Nq)
            hidden_t.add_(proj_t)
            rms_norm(hidden, H, layer.post_norm, eps, normed, T, H)
            linear(layer.gate_up, normed, H, gate_up, 2 * inter, T, H)
            self.silu_mul(gate_up, 2 * inter, act, T, inter)
            linear(layer.down, act, inter, proj, H, T, inter)
            hidden_t.add_(proj_t)
        return model.model.norm(hidden_t[meta.logits_indices])
