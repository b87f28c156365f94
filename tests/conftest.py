"""Shared test helpers."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton's CPU interpreter must be on before anything imports triton (torch.export does): its
    # own @triton.jit helpers are built once at import. Only kernel="triton" calls ever use it.
    os.environ.setdefault("TRITON_INTERPRET", "1")

CUDA_REQUIREMENT = "a CUDA GPU (torch.cuda.is_available() is False here)"


@pytest.fixture
def cuda_device() -> torch.device:
    """The CUDA device; skips the test, saying what it needs, when there is none."""
    if not torch.cuda.is_available():
        pytest.skip(f"needs {CUDA_REQUIREMENT}")
    return torch.device("cuda")


@pytest.fixture(autouse=True)
def single_thread():
    """Unit tests use tiny tensors: one intra-op thread is fastest and keeps a busy 2-core machine usable."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def restore_matmul_precision():
    """Training runs switch TF32 matmuls on process-wide (``prepare_runtime``); put the flags back so a
    later float32 parity test does not compare against TF32 products."""
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.get_float32_matmul_precision())
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before[:2]
    torch.set_float32_matmul_precision(before[2])
