"""Shared fixtures: tiny trained models (built once, cached under .cache/) and the embedded
SmolLM2 (converted once from its GGUF)."""

from __future__ import annotations

import os

from worker_svc.cpu import features

# PAGEWIRE_CPU_ISA=avx2 (say) runs the suite as on a CPU of that level: torch and oneDNN in this
# process too, told before anything imports torch (the pagewire commands tests start tell theirs)
features.cap_torch_isa()

import pytest  # noqa: E402

from tests.tiny_models import get_tiny_model  # noqa: E402

# The tests compare with transformers in float32 on every host; ``--dtype auto`` would pick
# bfloat16 on a CPU with native bf16. This is the default of every command and of LLM() in this
# process and its children; tests of ``auto`` itself resolve it explicitly.
os.environ.setdefault("PAGEWIRE_DTYPE", "float32")


@pytest.fixture(scope="session")
def tiny_model_dir():
    """kind -> model directory (built on first use)."""
    return get_tiny_model


@pytest.fixture(scope="session")
def smollm2_dir():
    from worker_svc.weights import resolve_model_path

    return resolve_model_path(None)


@pytest.fixture(scope="session")
def quant_lib():
    """The quantized-linear C kernels (``worker_svc.cpu.quantized``); skips where none is built."""
    from worker_svc.cpu import quantized

    built = quantized.kernel()
    if built is None:
        pytest.skip("no C compiler")
    return built


@pytest.fixture(scope="session")
def bf16_lib(quant_lib):
    """The quantized kernels where they multiply bf16 natively (AVX-512 BF16); skips elsewhere."""
    from worker_svc.cpu import quantized
    from worker_svc.cpu.features import cpu_info

    if not quantized.bf16_kernel_available():
        pytest.skip(f"the quantized bf16 kernel needs AVX-512 BF16 dot products; this CPU has {cpu_info().isa} "
                    "(a bf16 model computes in fp32 here, as the fp32 tests check)")
    return quant_lib
