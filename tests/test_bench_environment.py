"""The machine a bench JSON was measured on: CPU model, ISA and cores, from /proc/cpuinfo."""

from __future__ import annotations

import os

from pagewire.bench.report import cpu_info, environment
from pagewire_common import envs
from worker_svc.cpu import features
from worker_svc.cpu.features import ISA_LEVELS

AVX512_BF16_HOST = """\
processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9R14
flags\t\t: fpu vme sse sse2 ssse3 sse4_1 sse4_2 avx f16c avx2 bmi2 avx512f avx512dq avx512bw avx512vl avx512_bf16 vaes

processor\t: 1
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9R14
flags\t\t: fpu vme sse sse2 ssse3 sse4_1 sse4_2 avx f16c avx2 bmi2 avx512f avx512dq avx512bw avx512vl avx512_bf16 vaes
"""

AVX2_HOST = """\
processor\t: 0
model name\t: AMD EPYC
flags\t\t: fpu sse sse2 ssse3 sse4_1 sse4_2 avx f16c avx2 bmi1 bmi2
"""

ARM_HOST = """\
processor\t: 0
BogoMIPS\t: 243.75
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics sve
CPU implementer\t: 0x41
"""


def test_avx512_bf16_host():
    info = cpu_info(AVX512_BF16_HOST)
    assert info["cpu_model"] == "AMD EPYC 9R14"
    assert info["cpu_isa"] == "avx512_bf16"
    assert info["cpu_isa_flags"] == ["avx512_bf16", "avx512f", "avx2", "avx"]


def test_avx2_only_host():
    info = cpu_info(AVX2_HOST)
    assert (info["cpu_model"], info["cpu_isa"], info["cpu_isa_flags"]) == ("AMD EPYC", "avx2", ["avx2", "avx"])


def test_arm_host_has_features_and_no_model_name():
    info = cpu_info(ARM_HOST)
    assert (info["cpu_model"], info["cpu_isa"], info["cpu_isa_flags"]) == (None, "sve", ["sve", "asimd"])


def test_unknown_cpu():
    info = cpu_info("")
    assert (info["cpu_model"], info["cpu_isa"], info["cpu_isa_flags"]) == (None, None, [])


def test_usable_cores_follow_the_affinity_mask():
    assert cpu_info("")["cpu_cores_usable"] == len(os.sched_getaffinity(0))


def test_environment_carries_this_machines_cpu():
    env = environment()
    mine = cpu_info()
    for key in ("cpu_model", "cpu_isa", "cpu_isa_flags", "cpu_cores_usable"):
        assert env[key] == mine[key], key
    assert env["cpu_count"] == os.cpu_count()
    with open("/proc/cpuinfo") as f:
        flags = next(line for line in f if line.startswith(("flags", "Features"))).split(":", 1)[1].split()
    cap = envs.cpu_isa()  # PAGEWIRE_CPU_ISA: the suite run as on a lesser CPU reports that CPU
    if cap is not None:
        capped = features.CpuInfo(None, frozenset(flags)).capped(cap)
        flags = capped.flags
        assert env["cpu_isa_capped_from"] == capped.capped_from
    else:
        assert env["cpu_isa_capped_from"] is None
    assert env["cpu_isa_flags"] == [isa for isa in ISA_LEVELS if isa in flags]
