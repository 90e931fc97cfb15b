"""The worker step's phases, marked once for two readers: NVTX ranges for Nsight Systems timelines
and the step-phase profile (``--profile-steps``, ``pagewire_common.step_profile``).

NVTX is off by default; PAGEWIRE_NVTX=1 turns it on (read once); without CUDA it is a no-op. With
both off a phase costs one call that returns a shared no-op context manager."""

from __future__ import annotations

import contextlib

import torch

from pagewire_common import envs, step_profile

_ENABLED = envs.nvtx_enabled() and torch.cuda.is_available()


@contextlib.contextmanager
def _range(name: str, timer):
    torch.cuda.nvtx.range_push(name)
    try:
        with timer:
            yield
    finally:
        torch.cuda.nvtx.range_pop()


def nvtx_range(name: str):
    """``with nvtx_range("forward"): ...`` marks a phase: an NVTX range when NVTX is enabled, and
    its wall time in the step profile when that is on."""
    timer = step_profile.phase(name)
    return _range(name, timer) if _ENABLED else timer
