"""The worker's dtype: parsing ``--dtype`` and resolving ``auto``.

``auto`` is resolved here, in the worker, where the device and the checkpoint are known:

- CUDA: the checkpoint's dtype when it is bfloat16 or float16. A float32 checkpoint (or one whose
  config does not say) runs in bfloat16, as vLLM does: serving users on a GPU expect half
  precision, whose weights and KV cache take half the memory and bandwidth. GPUs without bf16
  (before Ampere) get float16 instead of bfloat16.
- CPU: bfloat16 where the CPU multiplies it natively (``avx512_bf16`` or ``amx_bf16``), else
  float32, whatever the checkpoint; float32 with ``--int8-activations``, whose model computes in
  fp32 around its int8 products.

An explicit dtype always wins. The info the worker reports (``Info``, ``GetModelInfo``) carries
the resolved dtype, never ``auto``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from worker_svc.cpu import features
from worker_svc.cpu.features import CpuInfo

AUTO = "auto"
_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """A concrete dtype by name (``auto`` is not one: see :func:`resolve_dtype`)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[str(dtype).lower()]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype!r}; choose one of {sorted(set(_DTYPES))}") from None


def check_dtype_setting(dtype: str | torch.dtype) -> None:
    """Raises ValueError unless ``dtype`` is ``auto`` or a concrete dtype."""
    if dtype != AUTO:
        parse_dtype(dtype)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True, slots=True)
class DtypeChoice:
    dtype: torch.dtype
    reason: str  # for the worker's log: "explicit", or why auto picked it

    def describe(self, setting: str | torch.dtype) -> str:
        """``dtype auto -> float32: this CPU has no native bf16 (avx2)``"""
        if self.reason == "explicit":
            return f"dtype {dtype_name(self.dtype)} (explicit)"
        return f"dtype {setting} -> {dtype_name(self.dtype)}: {self.reason}"


def resolve_dtype(
    setting: str | torch.dtype,
    device: torch.device,
    checkpoint_dtype: str | None,
    *,
    cpu: CpuInfo | None = None,
    cuda_supports_bf16: Callable[[], bool] | None = None,
    int8_activations: bool = False,
) -> DtypeChoice:
    """The dtype the worker runs in for the ``--dtype`` ``setting`` (see the module docstring).
    ``cpu`` (default: this machine's, from /proc/cpuinfo) and ``cuda_supports_bf16`` (default:
    torch's answer for the current GPU, asked only when needed) are what the choice depends on;
    ``int8_activations`` (CPU): the model computes in fp32 around its int8 products, so ``auto``
    keeps the KV cache in fp32 too."""
    if setting != AUTO:
        return DtypeChoice(parse_dtype(setting), "explicit")
    if int8_activations and device.type == "cpu":
        return DtypeChoice(torch.float32, "--int8-activations computes in fp32 around its int8 products")
    if device.type == "cuda":
        saved = _DTYPES.get(str(checkpoint_dtype).removeprefix("torch.").lower()) if checkpoint_dtype else None
        if saved == torch.float16:
            return DtypeChoice(torch.float16, "the checkpoint's dtype")
        bf16 = (cuda_supports_bf16 or torch.cuda.is_bf16_supported)()
        what = "the checkpoint's dtype" if saved == torch.bfloat16 else f"a {checkpoint_dtype or 'float32'} checkpoint on CUDA"
        if bf16:
            return DtypeChoice(torch.bfloat16, what)
        return DtypeChoice(torch.float16, f"{what}, and this GPU has no bf16")
    if device.type == "cpu":
        cpu = cpu or features.cpu_info()
        if cpu.native_bf16:
            return DtypeChoice(torch.bfloat16, f"this CPU computes bf16 natively ({cpu.isa})")
        return DtypeChoice(torch.float32, f"this CPU has no native bf16 ({cpu.isa or 'unknown ISA'})")
    return DtypeChoice(torch.float32, f"the default on {device.type}")
