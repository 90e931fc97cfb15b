"""Preparing a loaded model to run on the CPU: the one entry point the runner calls.

What runs where depends on the model's dtype and on the CPU (``features``):

- a model with quantized linears (GGUF blocks, ``--quantization int8``: ``quantized``) computes in
  bf16 for a bf16 model on a CPU with AVX-512 BF16 (the kernel's bf16 dot products, or AMX tiles
  where the CPU has them), else in fp32;
  its KV cache in the model's dtype; with ``int8_activations`` in fp32, its linears multiplying
  activations rounded to int8 (only quantized linears have that path);
- a bf16 model on a CPU without native bf16 keeps bf16 weights and cache and computes in fp32
  (``bf16_linear``); otherwise the linear weights are packed for the C kernel or oneDNN
  (``linear``);
- either arithmetic takes the fused norm, SiLU and rotary passes where they are vectorized for it
  (``fused``: fp32 with AVX2, bf16 with AVX-512 BF16);
- ``kvcache.paged`` is handed the C attention kernel (``attention``), built now rather than during
  the first request; with ``deterministic`` for every chunk, not only those of up to 32 queries.

One log line says what runs where.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from kvcache import paged
from worker_svc.cpu import attention, features
from worker_svc.cpu.bf16_linear import compute_bf16_model_in_fp32
from worker_svc.cpu.decode import MAX_TOKENS, QuantDecode
from worker_svc.cpu.fused import use_fused_cpu_kernels
from worker_svc.cpu.linear import pack_linears_for_cpu
from worker_svc.cpu.quantized import compute_quantized_model, is_quantized

log = logging.getLogger("pagewire.worker")


def prepare_model(model: nn.Module, dtype: torch.dtype, *, deterministic: bool = False,
                  int8_activations: bool = False) -> None:
    """Switch ``model``, loaded on CPU in ``dtype`` (also its KV cache's), to the CPU kernels that
    fit this CPU, and register the C attention kernel with ``kvcache.paged`` (for every chunk with
    ``deterministic``). ``int8_activations``: a ValueError unless the model has quantized linears."""
    compute_dtype = dtype
    cpu = features.cpu_info()
    if int8_activations and not is_quantized(model):
        raise ValueError("--int8-activations multiplies quantized weights: serve a GGUF file's Q4_0, Q4_1 or Q8_0 "
                         "blocks or add --quantization int8 (this model's linears are dense)")
    if is_quantized(model):
        compute_dtype, linears = compute_quantized_model(model, dtype, int8_activations=int8_activations,
                                                         deterministic=deterministic)
    elif dtype == torch.bfloat16 and not cpu.native_bf16:
        compute_dtype = torch.float32
        linears = "bf16 weights, fp32 arithmetic (no native bf16): " + compute_bf16_model_in_fp32(model)
    else:
        linears = pack_linears_for_cpu(model) or "plain torch matmuls"
    fused = use_fused_cpu_kernels(model, compute_dtype) > 0
    paged.use_cpu_attention(attention.kernel, every_chunk=deterministic)
    attention_path = paged.prepare_cpu_attention(compute_dtype, dtype)
    lean = ""
    if attention_path == "C kernel" and hasattr(model, "cpu_decode"):
        model.cpu_decode = QuantDecode.of(model)
        if model.cpu_decode is not None:
            lean = f"; steps of up to {MAX_TOKENS} tokens in one lean pass of C calls"
    log.info("CPU kernels: linears %s; norms, SiLU and rotary %s; attention %s%s%s", linears,
             "fused C" if fused else "torch operators", attention_path,
             " for every chunk (--deterministic)" if deterministic and attention_path == "C kernel" else "", lean)
    if deterministic and attention_path != "C kernel":
        log.warning("--deterministic: attention is not available in C here (%s), so a request's tokens may still "
                    "depend on its batch and on prefix-cache hits", attention_path)
