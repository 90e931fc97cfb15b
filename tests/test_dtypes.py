"""``--dtype auto``: what the worker picks on each kind of host, and that an explicit dtype wins.
The CPU-feature probe and CUDA's bf16 support are mocked; no GPU is needed."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from pagewire_common.settings import Settings, default_of
from worker_svc.config import ModelConfig
from worker_svc.cpu import features
from worker_svc.cpu.features import CpuInfo, parse_cpuinfo
from worker_svc.dtypes import resolve_dtype
from worker_svc.null_runner import NullRunner
from worker_svc.runner import ModelRunner, RunnerConfig

CPU = torch.device("cpu")
CUDA = torch.device("cuda")
AVX512_BF16 = CpuInfo("Intel Xeon Platinum 8488C", frozenset({"avx", "avx2", "avx512f", "avx512_bf16"}), "GenuineIntel", 6)
ZEN4 = CpuInfo("AMD EPYC 9R14", frozenset({"avx", "avx2", "avx512f", "avx512_bf16"}), "AuthenticAMD", 25)
AMX = CpuInfo("Intel Xeon", frozenset({"avx", "avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}))
AVX2 = CpuInfo("AMD EPYC", frozenset({"avx", "avx2", "fma", "f16c"}))


def never_asked() -> bool:
    raise AssertionError("CUDA's bf16 support was asked for where it does not matter")


@pytest.mark.parametrize("cpu, expected, reason", [
    (AVX512_BF16, torch.bfloat16, "this CPU computes bf16 natively (avx512_bf16)"),
    (AMX, torch.bfloat16, "this CPU computes bf16 natively (amx_bf16)"),
    (AVX2, torch.float32, "this CPU has no native bf16 (avx2)"),
    (CpuInfo(None, frozenset()), torch.float32, "this CPU has no native bf16 (unknown ISA)"),
])
def test_auto_on_cpu_follows_native_bf16_whatever_the_checkpoint(cpu, expected, reason):
    for saved in ("bfloat16", "float32", None):
        choice = resolve_dtype("auto", CPU, saved, cpu=cpu, cuda_supports_bf16=never_asked)
        assert (choice.dtype, choice.reason) == (expected, reason)


def test_auto_is_fp32_on_cpu_with_int8_activations():
    """The model computes in fp32 around its int8 products: a bf16 KV cache would keep the lean
    CPU pass from serving its steps."""
    for cpu in (AVX512_BF16, AMX, AVX2):
        choice = resolve_dtype("auto", CPU, "bfloat16", cpu=cpu, int8_activations=True)
        assert choice.dtype == torch.float32 and "--int8-activations" in choice.reason
    assert resolve_dtype("bfloat16", CPU, None, cpu=AMX, int8_activations=True).dtype == torch.bfloat16  # explicit


def test_the_log_line_says_what_and_why():
    choice = resolve_dtype("auto", CPU, "float32", cpu=AVX2)
    assert choice.describe("auto") == "dtype auto -> float32: this CPU has no native bf16 (avx2)"
    assert resolve_dtype("bfloat16", CPU, None, cpu=AVX2).describe("bfloat16") == "dtype bfloat16 (explicit)"


@pytest.mark.parametrize("saved, gpu_bf16, expected", [
    ("bfloat16", True, torch.bfloat16),
    ("float16", True, torch.float16),
    ("float32", True, torch.bfloat16),  # half precision on a GPU, as vLLM serves fp32 checkpoints
    (None, True, torch.bfloat16),  # a config without a dtype is a float32 one
    ("float32", False, torch.float16),  # before Ampere: no bf16
    ("bfloat16", False, torch.float16),
])
def test_auto_on_cuda_follows_the_checkpoint_in_half_precision(saved, gpu_bf16, expected):
    choice = resolve_dtype("auto", CUDA, saved, cpu=AVX2, cuda_supports_bf16=lambda: gpu_bf16)
    assert choice.dtype == expected


def test_auto_on_cuda_with_an_fp16_checkpoint_does_not_ask_for_bf16():
    assert resolve_dtype("auto", CUDA, "float16", cuda_supports_bf16=never_asked).dtype == torch.float16


@pytest.mark.parametrize("setting, expected", [
    ("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float16", torch.float16), ("bf16", torch.bfloat16),
])
@pytest.mark.parametrize("device, cpu", [(CPU, AVX512_BF16), (CPU, AVX2), (CUDA, AVX2)])
def test_an_explicit_dtype_always_wins(setting, expected, device, cpu):
    choice = resolve_dtype(setting, device, "bfloat16", cpu=cpu, cuda_supports_bf16=never_asked)
    assert (choice.dtype, choice.reason) == (expected, "explicit")


def test_auto_is_the_default_setting_and_bad_names_are_refused():
    assert default_of("dtype") == "auto" == Settings().dtype == RunnerConfig().dtype
    with pytest.raises(ValueError, match="dtype"):
        RunnerConfig(dtype="int4")
    with pytest.raises(ValueError, match="--dtype"):
        Settings(dtype="int4")


def test_the_probe_reads_flags_and_native_bf16():
    text = "processor\t: 0\nmodel name\t: X\nflags\t\t: fpu avx avx2 avx512f avx512_bf16\n\nprocessor\t: 1\nflags\t\t: fpu\n"
    info = parse_cpuinfo(text)
    assert info.model == "X" and info.isa == "avx512_bf16" and info.native_bf16
    assert (info.vendor, info.family) == (None, None)
    info = parse_cpuinfo("vendor_id\t: AuthenticAMD\ncpu family\t: 25\nflags\t\t: avx2\n"
                         "vendor_id\t: GenuineIntel\ncpu family\t: 6\n")
    assert (info.vendor, info.family) == ("AuthenticAMD", 25)
    assert not parse_cpuinfo("flags : fpu avx2\n").native_bf16
    assert parse_cpuinfo("").isa is None


def test_model_config_keeps_the_checkpoint_dtype(tiny_model_dir, tmp_path):
    source = tiny_model_dir("llama-gqa")
    cfg = json.loads((source / "config.json").read_text())
    cfg.pop("torch_dtype", None)
    cfg.pop("dtype", None)
    assert ModelConfig.from_hf_config(cfg).checkpoint_dtype is None
    assert ModelConfig.from_hf_config({**cfg, "torch_dtype": "bfloat16"}).checkpoint_dtype == "bfloat16"
    assert ModelConfig.from_hf_config({**cfg, "dtype": "float16"}).checkpoint_dtype == "float16"


@pytest.fixture()
def host(monkeypatch):
    """Makes this machine look like the CpuInfo given to the returned function."""

    def set_host(cpu: CpuInfo) -> None:
        monkeypatch.setattr(features, "cpu_info", lambda: cpu)

    return set_host


def test_runners_report_the_resolved_dtype(tiny_model_dir, host, caplog):
    model_dir = tiny_model_dir("llama-gqa")
    budget = 1 << 20
    host(AVX2)
    with caplog.at_level(logging.INFO, logger="pagewire.worker"):
        real = ModelRunner(model_dir, RunnerConfig(block_size=4, kv_cache_bytes=budget, device="cpu"))
    assert real.dtype == torch.float32 and real.kv_cache.dtype == torch.float32
    assert "dtype auto -> float32: this CPU has no native bf16 (avx2)" in caplog.text
    null = NullRunner(model_dir, RunnerConfig(block_size=4, kv_cache_bytes=budget, device="cpu"))
    assert (null.dtype, null.num_kv_blocks) == ("float32", real.num_kv_blocks)

    host(AVX512_BF16)  # the null runner sizes its pretend cache by the picked dtype's bytes
    null16 = NullRunner(model_dir, RunnerConfig(block_size=4, kv_cache_bytes=budget, device="cpu"))
    assert (null16.dtype, null16.num_kv_blocks) == ("bfloat16", 2 * real.num_kv_blocks)
    explicit = NullRunner(model_dir, RunnerConfig(block_size=4, kv_cache_bytes=budget, dtype="float32"))
    assert explicit.dtype == "float32"


class _TwoRanks:
    """A tensor-parallel group of two whose other rank resolved ``other``: ``min_int`` answers as
    the all-reduce would, for ``code`` and then ``-code``."""

    size = 2

    def __init__(self, other: torch.dtype):
        from worker_svc.runner import _RANK_DTYPES

        self.other_code = _RANK_DTYPES.index(other)
        self.num_calls = 0

    def min_int(self, value: int) -> int:
        other = self.other_code if self.num_calls % 2 == 0 else -self.other_code
        self.num_calls += 1
        return min(value, other)


def test_ranks_that_resolved_auto_differently_refuse_to_start():
    from worker_svc.runner import _check_ranks_agree

    _check_ranks_agree(_TwoRanks(torch.bfloat16), torch.bfloat16)  # the same dtype: fine
    for mine, other in ((torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)):
        with pytest.raises(ValueError, match="resolved --dtype auto to different dtypes"):
            _check_ranks_agree(_TwoRanks(other), mine)
