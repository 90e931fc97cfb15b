"""Shared fixtures: tiny trained models (built once, cached under .cache/) and the embedded
SmolLM2 (converted once from its GGUF)."""

from __future__ import annotations

import pytest

from tests.tiny_models import get_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir():
    """kind -> model directory (built on first use)."""
    return get_tiny_model


@pytest.fixture(scope="session")
def smollm2_dir():
    from worker_svc.weights import resolve_model_path

    return resolve_model_path(None)
