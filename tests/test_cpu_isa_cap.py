"""PAGEWIRE_CPU_ISA: a CPU capped at a lesser x86 level looks like one of that level to everything
that chooses by instruction set, and the C kernels' narrower paths run and pass their suites."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagewire.bench import llamacpp
from pagewire_common import envs
from worker_svc.cpu import features

REPO = Path(__file__).resolve().parent.parent

# a Sapphire Rapids' flags (AMX), less what does not matter here
SPR_FLAGS = ("fpu sse sse2 avx avx2 fma f16c bmi2 avx_vnni avx512f avx512dq avx512cd avx512bw avx512vl avx512_vnni "
             "avx512_bf16 avx512vbmi avx512_fp16 amx_tile amx_bf16 amx_int8")
SPR = features.parse_cpuinfo(f"vendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel name\t: Xeon\nflags\t\t: {SPR_FLAGS}\n")


@pytest.fixture
def cap(monkeypatch):
    """Set PAGEWIRE_CPU_ISA (None: unset) with the cached CPU reading cleared around it."""

    def set_cap(level: str | None) -> None:
        if level is None:
            monkeypatch.delenv(envs.CPU_ISA_ENV, raising=False)
        else:
            monkeypatch.setenv(envs.CPU_ISA_ENV, level)
        features.cpu_info.cache_clear()

    yield set_cap
    monkeypatch.delenv(envs.CPU_ISA_ENV, raising=False)
    features.cpu_info.cache_clear()


def test_each_level_hides_the_flags_above_it():
    assert SPR.isa == "amx_bf16" and SPR.native_bf16
    assert SPR.capped("amx_bf16") == SPR  # its own level: nothing hidden, not marked capped
    bf16 = SPR.capped("avx512_bf16")
    assert bf16.isa == "avx512_bf16" and bf16.native_bf16 and bf16.capped_from == "amx_bf16"
    assert not any(f.startswith("amx") for f in bf16.flags) and {"avx512_vnni", "avx_vnni"} <= bf16.flags
    v4 = SPR.capped("avx512f")
    assert v4.isa == "avx512f" and not v4.native_bf16 and v4.capped_from == "amx_bf16"
    assert {f for f in v4.flags if "avx512" in f} == {"avx512f", "avx512dq", "avx512cd", "avx512bw", "avx512vl"}
    assert "avx_vnni" not in v4.flags
    v3 = SPR.capped("avx2")
    assert v3.isa == "avx2" and v3.isa_flags == ["avx2", "avx"] and not v3.native_bf16
    assert {"avx2", "fma", "f16c", "bmi2", "sse2"} <= v3.flags and not any("512" in f or "amx" in f for f in v3.flags)
    assert v3.isa_description == "avx2 (PAGEWIRE_CPU_ISA on an amx_bf16 CPU)"
    assert SPR.isa_description == "amx_bf16"


def test_a_level_the_cpu_lacks_or_that_is_none_is_refused():
    v3 = SPR.capped("avx2")
    with pytest.raises(ValueError, match=r"PAGEWIRE_CPU_ISA=avx512f: this CPU does not have it \(its best: avx2\)"):
        v3.capped("avx512f")
    with pytest.raises(ValueError, match="expected one of amx_bf16, avx512_bf16, avx512f, avx2"):
        SPR.capped("sse4")


def test_the_cap_reaches_the_kernels_build_torch_and_dtype_auto(cap, monkeypatch):
    import torch

    from worker_svc import dtypes
    from worker_svc.cpu import build

    host = features.host_cpu_info()
    cap(None)
    assert features.cpu_info() == host and features.march_flags() == ["-march=native"]
    assert build.flag_sets()[0][:2] == ["-O3", "-march=native"]
    if "avx2" not in host.flags:
        pytest.skip("this CPU has no AVX2 to cap at")
    cap("avx2")
    assert features.cpu_info().isa == "avx2" and features.cpu_info().capped_from == (host.isa if host.isa != "avx2"
                                                                                    else None)
    assert features.march_flags() == ["-march=x86-64-v3", "-mtune=native"]
    assert build.flag_sets()[0][:3] == ["-O3", "-march=x86-64-v3", "-mtune=native"]
    choice = dtypes.resolve_dtype("auto", torch.device("cpu"), None)
    assert choice.dtype == torch.float32 and "avx2" in choice.reason  # as on an AVX2 CPU: no native bf16
    # cap_torch_isa writes into an environment of its own here, not this process's (whose later
    # children would otherwise run torch at AVX2)
    env = {envs.CPU_ISA_ENV: "avx2"}
    monkeypatch.setattr(os, "environ", env)
    features.cap_torch_isa()
    assert (env["ATEN_CPU_CAPABILITY"], env["ONEDNN_MAX_CPU_ISA"]) == ("avx2", "AVX2")
    env["ONEDNN_MAX_CPU_ISA"] = "AVX"  # a value the user set stays
    features.cap_torch_isa()
    assert env["ONEDNN_MAX_CPU_ISA"] == "AVX"


def test_the_offline_llm_runs_torch_at_the_capped_level():
    """``from pagewire import LLM`` under ``PAGEWIRE_CPU_ISA`` caps torch's and oneDNN's kernels too,
    as every pagewire command does, where torch is not imported yet: offline figures taken under
    the cap are that level's throughout, not only the C kernels'."""
    if "avx2" not in features.host_cpu_info().flags:
        pytest.skip("this CPU has no AVX2 to cap at")
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")}
    env[envs.CPU_ISA_ENV] = "avx2"
    code = "from pagewire import LLM; import torch; print(torch.backends.cpu.get_cpu_capability())"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
                         check=True)
    assert out.stdout.split()[-1] == "AVX2"


def test_llama_server_is_built_for_the_same_level():
    assert llamacpp.cmake_options(SPR) == llamacpp.CMAKE_OPTIONS  # not capped: -march=native
    options = llamacpp.cmake_options(SPR.capped("avx2"))
    assert "-DGGML_NATIVE=OFF" in options and "-DGGML_NATIVE=ON" not in options
    assert {"-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DGGML_AVX512=OFF", "-DGGML_AVX_VNNI=OFF",
            "-DGGML_AMX_TILE=OFF", "-DGGML_AVX512_BF16=OFF"} <= set(options)
    options = llamacpp.cmake_options(SPR.capped("avx512_bf16"))
    assert {"-DGGML_AVX512=ON", "-DGGML_AVX512_BF16=ON", "-DGGML_AVX512_VNNI=ON", "-DGGML_AMX_TILE=OFF"} <= set(options)
    for option in llamacpp.CMAKE_OPTIONS:  # everything else as in the native build
        assert option in options or option == "-DGGML_NATIVE=ON"


def test_a_command_refuses_a_level_it_cannot_take():
    env = {**os.environ, envs.CPU_ISA_ENV: "avx9"}
    out = subprocess.run([sys.executable, "-m", "pagewire.cli", "worker", "--model", "none"], env=env,
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 2
    assert "pagewire: error: PAGEWIRE_CPU_ISA=avx9: expected one of amx_bf16, avx512_bf16, avx512f, avx2" in out.stderr


def test_onednn_is_asked_per_dtype_whether_it_packs_weights():
    """Capped at AVX2, torch's oneDNN packs fp32 weights and refuses bf16 ones: the probe says so,
    so a bf16 model there does not try (and warn)."""
    if "avx2" not in features.host_cpu_info().flags:
        pytest.skip("this CPU has no AVX2 to cap at")
    code = ("import torch; from worker_svc.cpu.linear import mkldnn_linear_available as m; "
            "print(m(torch.float32), m(torch.bfloat16))")
    cap = features.ISA_CAPS["avx2"]
    env = {**os.environ, envs.CPU_ISA_ENV: "avx2", "ATEN_CPU_CAPABILITY": cap.aten, "ONEDNN_MAX_CPU_ISA": cap.onednn}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
                         check=True)
    assert out.stdout.split() == ["True", "False"]


def _lower_levels() -> list[str]:
    host = features.host_cpu_info()
    return [level for level in ("avx512f", "avx2") if level in host.flags and level != host.isa]


KERNEL_SUITES = ["tests/test_cpu_kernels.py", "tests/test_cpu_linear.py", "tests/test_cpu_linear_pairs.py",
                 "tests/test_cpu_fused.py", "tests/test_cpu_bf16_linear.py", "tests/test_cpu_quantized.py",
                 "tests/test_cpu_decode.py"]


@pytest.mark.slow
@pytest.mark.parametrize("level", _lower_levels() or [pytest.param("avx2", marks=pytest.mark.skip(
    reason="this CPU has no level above AVX2 to cap"))])
def test_kernel_suites_pass_on_the_narrower_paths(level):
    """The CPU kernels' suites, every kernel built for ``level`` (its AVX2 or AVX-512 path, not the
    host's best), torch and oneDNN capped the same; the quantized kernel reports the width it was
    built with."""
    cap = features.ISA_CAPS[level]
    env = {**os.environ, envs.CPU_ISA_ENV: level, "ATEN_CPU_CAPABILITY": cap.aten, "ONEDNN_MAX_CPU_ISA": cap.onednn}
    width = subprocess.run([sys.executable, "-c", "from worker_svc.cpu import quantized; print(quantized.kernel().simd)"],
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=True).stdout.split()
    assert width[-1] == ("256" if level == "avx2" else "512")
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *KERNEL_SUITES],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert " passed" in out.stdout and "failed" not in out.stdout
