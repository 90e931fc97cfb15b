"""What this machine's CPU computes natively, from ``/proc/cpuinfo`` (torch-free).

The worker asks it whether bfloat16 is native (``--dtype auto``, and how a bf16 model computes on
CPU) and which kernels fit the CPU; the build keys its cache on it; the bench records the model and
instruction set in its JSON (``pagewire.bench.report``). It imports nothing but the standard
library, so the bench may import it without torch.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

from pagewire_common import envs

# The instruction-set levels a figure or a dtype choice depends on, best first.
ISA_LEVELS = ("amx_bf16", "avx512_bf16", "avx512f", "avx2", "avx", "sve", "asimd")
# Flags under which the CPU multiplies bfloat16 itself (AVX-512 BF16 dot products, AMX tiles);
# without one, torch and oneDNN emulate bf16 matmuls, several times slower than fp32 ones.
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")


@dataclass(frozen=True, slots=True)
class IsaCap:
    """What one level of ``PAGEWIRE_CPU_ISA`` tells each party: the C kernels' ``-march`` flags
    (``march``), torch's own kernels (``ATEN_CPU_CAPABILITY``, ``aten``) and oneDNN's
    (``ONEDNN_MAX_CPU_ISA``, ``onednn``); None leaves that one to pick for itself."""

    march: tuple[str, ...]
    aten: str | None
    onednn: str | None


# The levels PAGEWIRE_CPU_ISA may cap an x86 CPU at, best first. A cap makes the CPU look like a
# lesser one of that level to everything here: its flags above the level are hidden (``--dtype
# auto``, the kernels' choices, the bench's reports), the C kernels are built for the level, and
# torch and oneDNN are told the same before torch is imported. avx2 and avx512f are the x86-64-v3
# and -v4 levels (Haswell, Skylake-SP), so AVX-VNNI and AVX-512's later extensions go with them.
ISA_CAPS = {
    "amx_bf16": IsaCap(("-march=native",), None, None),
    "avx512_bf16": IsaCap(("-march=native", "-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16"), "avx512",
                          "AVX512_CORE_BF16"),
    "avx512f": IsaCap(("-march=x86-64-v4", "-mtune=native"), "avx512", "AVX512_CORE"),
    "avx2": IsaCap(("-march=x86-64-v3", "-mtune=native"), "avx2", "AVX2"),
}
_X86_64_V4_AVX512 = frozenset({"avx512f", "avx512dq", "avx512cd", "avx512bw", "avx512vl"})
# VEX-encoded extensions newer than AVX2 (Alder Lake, Zen 5), and AVX10: absent on a v3 or v4 CPU
_NEWER_VEX = ("avx_vnni", "avx_ifma", "avx_ne_convert", "avx10")


def _kept(flag: str, cap: str) -> bool:
    """Whether a CPU capped at ``cap`` keeps ``flag``."""
    if cap == "amx_bf16":
        return True
    if flag.startswith("amx"):
        return False
    if cap == "avx512_bf16":
        return True
    if flag.startswith(_NEWER_VEX):
        return False
    if flag.startswith("avx512"):
        return cap == "avx512f" and flag in _X86_64_V4_AVX512
    return True


def describe_isa(isa: str | None, capped_from: str | None) -> str:
    """An ISA as reports name it: ``avx2``, or ``avx2 (PAGEWIRE_CPU_ISA on an avx512_bf16 CPU)``
    where a cap lowered it from ``capped_from``."""
    text = isa or "unknown"
    return f"{text} ({envs.CPU_ISA_ENV} on an {capped_from} CPU)" if capped_from else text


@dataclass(frozen=True, slots=True)
class CpuInfo:
    """``model``: the "model name" line (None where there is none, as on Arm); ``flags``: the
    feature flags of the first CPU listed; ``vendor`` and ``family``: its ``vendor_id`` and
    ``cpu family`` lines (x86; None elsewhere)."""

    model: str | None
    flags: frozenset[str]
    vendor: str | None = None
    family: int | None = None
    capped_from: str | None = None  # the CPU's own best ISA, where PAGEWIRE_CPU_ISA lowered it

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

    @property
    def isa_description(self) -> str:
        return describe_isa(self.isa, self.capped_from)

    def capped(self, cap: str) -> CpuInfo:
        """This CPU as one of level ``cap`` sees itself (``ISA_CAPS``); ValueError for a level that
        is not one of them or that this CPU does not have."""
        if cap not in ISA_CAPS:
            raise ValueError(f"{envs.CPU_ISA_ENV}={cap}: expected one of {', '.join(ISA_CAPS)}")
        if cap not in self.flags:
            raise ValueError(f"{envs.CPU_ISA_ENV}={cap}: this CPU does not have it (its best: {self.isa or 'unknown'}); "
                             f"a cap can only lower the instruction set")
        flags = frozenset(flag for flag in self.flags if _kept(flag, cap))
        own = self.isa
        return CpuInfo(self.model, flags, self.vendor, self.family, own if own != cap else None)


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
def host_cpu_info() -> CpuInfo:
    """This machine's CPU as it is, read once (no model and no flags where ``/proc/cpuinfo`` is
    missing)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    return parse_cpuinfo(text)


def isa_cap() -> IsaCap | None:
    """The level ``PAGEWIRE_CPU_ISA`` caps this CPU at (checked as :func:`cpu_info` checks it), or None."""
    cap = envs.cpu_isa()
    if cap is None:
        return None
    host_cpu_info().capped(cap)
    return ISA_CAPS[cap]


@functools.cache
def cpu_info() -> CpuInfo:
    """This machine's CPU as pagewire uses it: :func:`host_cpu_info`, capped by
    ``PAGEWIRE_CPU_ISA`` where that is set (ValueError for a level it cannot take)."""
    cap = envs.cpu_isa()
    host = host_cpu_info()
    return host if cap is None else host.capped(cap)


def march_flags() -> list[str]:
    """The C kernels' -march flags: the CPU's own, or those of its ``PAGEWIRE_CPU_ISA`` level."""
    cap = isa_cap()
    return list(cap.march) if cap is not None else ["-march=native"]


def cap_torch_isa() -> None:
    """Tell torch's and oneDNN's kernels the ``PAGEWIRE_CPU_ISA`` level (``ATEN_CPU_CAPABILITY``,
    ``ONEDNN_MAX_CPU_ISA``, unless set already), so they too run as on a CPU of that level. Both
    read these once, so this must run before torch is imported: each pagewire command calls it
    first. ValueError for a level the CPU cannot take."""
    cap = isa_cap()
    if cap is None:
        return
    if cap.aten is not None:
        os.environ.setdefault("ATEN_CPU_CAPABILITY", cap.aten)
    if cap.onednn is not None:
        os.environ.setdefault("ONEDNN_MAX_CPU_ISA", cap.onednn)
