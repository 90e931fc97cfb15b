"""NVTX ranges around the worker step's phases, for Nsight Systems timelines.

Off by default; PAGEWIRE_NVTX=1 turns them on (read once). Without CUDA they are no-ops."""

from __future__ import annotations

import contextlib

import torch

from pagewire_common import envs

_ENABLED = envs.nvtx_enabled() and torch.cuda.is_available()


@contextlib.contextmanager
def _range(name: str):
    torch.cuda.nvtx.range_push(name)
    try:
        yield
    finally:
        torch.cuda.nvtx.range_pop()


def nvtx_range(name: str):
    """``with nvtx_range("forward"): ...`` marks a phase when NVTX is enabled."""
    return _range(name) if _ENABLED else contextlib.nullcontext()
