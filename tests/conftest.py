"""Shared test helpers."""

from __future__ import annotations

import pytest
import torch

CUDA_REQUIREMENT = "a CUDA GPU (torch.cuda.is_available() is False here)"


@pytest.fixture
def cuda_device() -> torch.device:
    """The CUDA device; skips the test, saying what it needs, when there is none."""
    if not torch.cuda.is_available():
        pytest.skip(f"needs {CUDA_REQUIREMENT}")
    return torch.device("cuda")
