"""The ``interpreter`` fixture: Triton's CPU interpreter for the kernel tests of this folder."""

from __future__ import annotations

import importlib
import importlib.util

import pytest
import torch


@pytest.fixture
def interpreter(request, monkeypatch):
    """The kernel module a test module names in ``INTERPRETED`` (default the HSTU kernels), imported under
    Triton's interpreter (``TRITON_INTERPRET=1``); skipped without triton, on GPU machines (they run the
    gpu-marked tests) and where the kernels were already built for a GPU in this process."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("needs the triton package (pip install triton) for its interpreter")
    if torch.cuda.is_available():
        pytest.skip("interpreter tests run on CPU-only machines; GPU machines run the gpu-marked tests")
    pytest.importorskip("numpy")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    module = importlib.import_module(getattr(request.module, "INTERPRETED", "recforge.ops.triton.hstu"))
    if not hasattr(module._fwd, "fn") or type(module._fwd).__name__ == "Autotuner":
        pytest.skip("Triton kernels were already built for a GPU in this process")
    return module
