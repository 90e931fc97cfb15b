"""What this machine's CPU computes natively, from ``/proc/cpuinfo`` (torch-free).

The worker asks it whether bfloat16 is native (``--dtype auto``, and how a bf16 model computes on
CPU) and which kernels fit the CPU; the build keys its cache on it; the bench records the model and
instruction set in its JSON (``pagewire.bench.report``). It imports nothing but the standard
library, so the bench may import it without torch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

# The instruction-set levels a figure or a dtype choice depends on, best first.
ISA_LEVELS = ("amx_bf16", "avx512_bf16", "avx512f", "avx2", "avx", "sve", "asimd")
# Flags under which the CPU multiplies bfloat16 itself (AVX-512 BF16 dot products, AMX tiles);
# without one, torch and oneDNN emulate bf16 matmuls, several times slower than fp32 ones.
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")


@dataclass(frozen=True, slots=True)
class CpuInfo:
    """``model``: the "model name" line (None where there is none, as on Arm); ``flags``: the
    feature flags of the first CPU listed; ``vendor`` and ``family``: its ``vendor_id`` and
    ``cpu family`` lines (x86; None elsewhere)."""

    model: str | None
    flags: frozenset[str]
    vendor: str | None = None
    family: int | None = None

    @property
    def isa_flags(self) -> list[str]:
        """Every one of ``ISA_LEVELS`` this CPU has, best first."""
        return [isa for isa in ISA_LEVELS if isa in self.flags]

    @property
    def isa(self) -> str | None:
        """The best of ``ISA_LEVELS`` this CPU has, or None."""
        have = self.isa_flags
        return have[0] if have else None

    @property
    def native_bf16(self) -> bool:
        return any(flag in self.flags for flag in NATIVE_BF16_FLAGS)


def parse_cpuinfo(text: str) -> CpuInfo:
    """The model and flags in the text of ``/proc/cpuinfo`` (x86 ``flags`` or Arm ``Features``)."""
    model = vendor = None
    family: int | None = None
    flags: frozenset[str] = frozenset()
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key = key.strip()
        if key == "model name" and model is None:
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = frozenset(value.split())
        elif key == "vendor_id" and vendor is None:
            vendor = value.strip()
        elif key == "cpu family" and family is None and value.strip().isdigit():
            family = int(value)
    return CpuInfo(model, flags, vendor, family)


@functools.cache
def cpu_info() -> CpuInfo:
    """This machine's CPU, read once (no model and no flags where ``/proc/cpuinfo`` is missing)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    return parse_cpuinfo(text)
