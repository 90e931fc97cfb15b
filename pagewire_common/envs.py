"""Every environment variable pagewire reads, in one place (torch-free).

| variable | meaning | default |
| --- | --- | --- |
| PAGEWIRE_CACHE_DIR | where converted GGUF models are cached | ~/.cache/pagewire |
| PAGEWIRE_ATTENTION_BACKEND | auto, torch, triton or cpu (see kvcache.paged.attention_backend) | auto |
| PAGEWIRE_NVTX | 1: NVTX ranges around the worker step's phases (for Nsight) | off |
| PAGEWIRE_LOG_LEVEL | default of --log-level | info |
| PAGEWIRE_EVENT_LOOP | the services' asyncio loop: auto (uvloop when installed), uvloop or asyncio | auto |
| PAGEWIRE_API_KEY | default of --api-key: clients must send ``authorization: Bearer KEY`` | none |
| PAGEWIRE_DTYPE | default of --dtype | auto |
| PAGEWIRE_LAUNCH_AHEAD | default of --launch-ahead | auto |
| PAGEWIRE_CPU_ISA | the best x86 instruction set the CPU kernels, torch and ``--dtype auto`` may use: avx2, avx512f, avx512_bf16 or amx_bf16, at most the CPU's own; measures what a lesser CPU gets from the same code and tests the kernels' narrower paths (``worker_svc.cpu.features``) | the CPU's own |

The CPU kernels are compiled with ``$CC`` when it is set, else ``cc`` or ``gcc``
(``worker_svc.cpu.build``). gRPC reads ``GRPC_VERBOSITY``: every pagewire command sets it to ERROR
unless it is set or the log level is debug (``pagewire_common.logs``).
``huggingface_hub`` reads its own (``HF_HUB_CACHE``, ``HF_HOME``, ``HF_HUB_OFFLINE``, ``HF_TOKEN``) when a
model is named by Hugging Face id (``worker_svc.hub``).

Set by a supervisor for the children it starts, not by users:

| variable | meaning |
| --- | --- |
| PAGEWIRE_PARENT_PID | the supervisor's pid: the child dies with it |
| PAGEWIRE_PARENT_RUN_DIR | the supervisor's temp folder: the child removes it if it outlives the supervisor |
"""

from __future__ import annotations

import os
import pathlib


def cache_dir() -> str | None:
    return os.environ.get("PAGEWIRE_CACHE_DIR") or None


def cache_root() -> pathlib.Path:
    """Where pagewire caches what it builds or converts: $PAGEWIRE_CACHE_DIR, else ~/.cache/pagewire."""
    env = cache_dir()
    return pathlib.Path(env).expanduser() if env else pathlib.Path.home() / ".cache" / "pagewire"


def attention_backend() -> str:
    return os.environ.get("PAGEWIRE_ATTENTION_BACKEND", "auto").strip().lower() or "auto"


def nvtx_enabled() -> bool:
    return os.environ.get("PAGEWIRE_NVTX", "").strip().lower() in ("1", "true", "yes", "on")


def log_level() -> str:
    return os.environ.get("PAGEWIRE_LOG_LEVEL", "info")


def event_loop() -> str:
    return os.environ.get("PAGEWIRE_EVENT_LOOP", "auto").strip().lower() or "auto"


# prometheus_client's multiprocess folder: the core sets it for its API servers, and
# prometheus_client itself reads it when it is imported
METRICS_MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def metrics_multiprocess_dir() -> str | None:
    return os.environ.get(METRICS_MULTIPROC_ENV) or None


API_KEY_ENV = "PAGEWIRE_API_KEY"
DTYPE_ENV = "PAGEWIRE_DTYPE"  # the default --dtype (tests pin float32 with it)
LAUNCH_AHEAD_ENV = "PAGEWIRE_LAUNCH_AHEAD"  # the default --launch-ahead (tests run feature suites with it on)
CPU_ISA_ENV = "PAGEWIRE_CPU_ISA"  # cap the instruction set the CPU paths use (worker_svc.cpu.features)
PARENT_PID_ENV = "PAGEWIRE_PARENT_PID"
PARENT_RUN_DIR_ENV = "PAGEWIRE_PARENT_RUN_DIR"


def cpu_isa() -> str | None:
    value = (os.environ.get(CPU_ISA_ENV) or "").strip().lower()
    return value or None


def api_key() -> str | None:
    return read(API_KEY_ENV)


def read(name: str) -> str | None:
    """An environment variable that supplies a setting's default (``pagewire_common.settings``);
    None when unset or empty."""
    return os.environ.get(name) or None


def pop_parent() -> tuple[int | None, str | None]:
    """(supervisor pid, its temp folder) for a supervised child, taken out of the environment so
    that the child's own children do not inherit them."""
    pid = os.environ.pop(PARENT_PID_ENV, None)
    run_dir = os.environ.pop(PARENT_RUN_DIR_ENV, None)
    return (int(pid) if pid else None), (run_dir or None)
