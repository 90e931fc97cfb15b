"""Every environment variable pagewire reads, in one place (torch-free).

| variable | meaning | default |
| --- | --- | --- |
| PAGEWIRE_CACHE_DIR | where converted GGUF models are cached | ~/.cache/pagewire |
| PAGEWIRE_ATTENTION_BACKEND | auto, torch, triton or cpu (see kvcache.paged.attention_backend) | auto |
| PAGEWIRE_NVTX | 1: NVTX ranges around the worker step's phases (for Nsight) | off |
| PAGEWIRE_LOG_LEVEL | default of --log-level | info |
| PAGEWIRE_EVENT_LOOP | the services' asyncio loop: auto (uvloop when installed), uvloop or asyncio | auto |
"""

from __future__ import annotations

import os


def cache_dir() -> str | None:
    return os.environ.get("PAGEWIRE_CACHE_DIR") or None


def attention_backend() -> str:
    return os.environ.get("PAGEWIRE_ATTENTION_BACKEND", "auto").strip().lower() or "auto"


def nvtx_enabled() -> bool:
    return os.environ.get("PAGEWIRE_NVTX", "").strip().lower() in ("1", "true", "yes", "on")


def log_level() -> str:
    return os.environ.get("PAGEWIRE_LOG_LEVEL", "info")


def event_loop() -> str:
    return os.environ.get("PAGEWIRE_EVENT_LOOP", "auto").strip().lower() or "auto"
