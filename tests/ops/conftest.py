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


@pytest.fixture
def hopper(cuda_device) -> torch.device:
    """The CUDA device if it is a Hopper GPU (sm_90) and Triton has Gluon (the Gluon HSTU kernels' tests), else skip."""
    if torch.cuda.get_device_capability(cuda_device) != (9, 0):
        pytest.skip("needs a Hopper GPU (sm_90)")
    from recforge.ops.triton import hstu_gluon

    if not hstu_gluon.AVAILABLE:
        pytest.skip("this Triton has no Gluon")
    return cuda_device
