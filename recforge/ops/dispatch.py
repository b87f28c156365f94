"""Backend choice for ops: one place that decides, and logs each decision once.

``kernel="auto"`` runs the Triton kernel on CUDA tensors when Triton is installed and the
kernel supports the inputs, and the PyTorch reference otherwise, logging which and why.
``kernel="triton"`` never falls back: it raises, saying what is missing. On CPU tensors
``kernel="triton"`` runs Triton's interpreter when ``TRITON_INTERPRET=1`` (tests).
"""

from __future__ import annotations

import importlib.util
import logging

import torch

from recforge.env import triton_interpret

KERNELS = ("auto", "pytorch", "triton")
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_TRITON_HEAD_DIM = 256
_logged: set[tuple[str, str, str]] = set()
log = logging.getLogger("recforge.ops")


# found once, at import (finding the package imports nothing): a constant for torch.compile, which traces this
# check; a lazily filled global changed under the first trace and made every compiled step recompile once
_HAS_TRITON = importlib.util.find_spec("triton") is not None


def triton_available() -> bool:
    """Triton can be imported (the one capability check for the Triton kernels)."""
    return _HAS_TRITON


def resolve_device(name: str, setting: str = "device") -> torch.device:
    """``auto`` -> the GPU when CUDA is available, else the CPU; any other name as given, refused (naming
    ``setting``) when it asks for CUDA on a machine without it. Training, serving and retrieval all use it."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{setting}={name!r} but CUDA is not available here; use {setting}=cpu (or auto)")
    return device


def triton_interpreting() -> bool:
    """TRITON_INTERPRET=1: Triton kernels run on CPU tensors in Triton's interpreter."""
    return triton_interpret()


def unsupported_by_triton(*tensors: torch.Tensor, head_dims: tuple[int, ...]) -> str | None:
    """Why the Triton attention kernels cannot take these inputs, or None when they can."""
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1:
        return f"mixed input dtypes {sorted(map(str, dtypes))}"
    dtype = dtypes.pop()
    if dtype not in TRITON_DTYPES:
        return f"dtype {dtype} (supported: float16, bfloat16, float32)"
    if max(head_dims) > MAX_TRITON_HEAD_DIM:
        return f"head dim {max(head_dims)} > {MAX_TRITON_HEAD_DIM}"
    return None


def _log_once(op: str, backend: str, why: str) -> None:
    if torch.compiler.is_compiling():  # logged by the eager calls; a log call would break a compiled graph
        return
    key = (op, backend, why)
    if key not in _logged:
        _logged.add(key)
        name = "the Triton kernel" if backend == "triton" else "the PyTorch reference implementation"
        log.info("%s: using %s (%s)", op, name, why)


def resolve_kernel(op: str, kernel: str, device: torch.device | None = None, unsupported: str | None = None) -> str:
    """Return the backend ("pytorch" or "triton") that runs ``op`` and log the choice once.

    Args:
        op: op name, for messages.
        kernel: "auto" | "pytorch" | "triton".
        device: the inputs' device (None: treated as CPU).
        unsupported: why the Triton kernel cannot take these inputs (None when it can).
    """
    if kernel not in KERNELS:
        raise ValueError(f"{op}: kernel={kernel!r} is not one of {KERNELS}")
    if kernel == "pytorch":
        _log_once(op, "pytorch", "requested")
        return "pytorch"
    on_cuda = device is not None and device.type == "cuda"
    if kernel == "triton":
        if not triton_available():
            raise ValueError(f"{op}: kernel='triton' needs the triton package (pip install triton); use kernel='pytorch'")
        if not on_cuda and not triton_interpreting():
            raise ValueError(
                f"{op}: kernel='triton' needs CUDA tensors (got device {device}); set TRITON_INTERPRET=1 to run "
                "Triton's interpreter on CPU, or use kernel='pytorch'"
            )
        if unsupported is not None:
            raise ValueError(f"{op}: the Triton kernel does not support {unsupported}; use kernel='pytorch'")
        _log_once(op, "triton", "requested")
        return "triton"
    if not on_cuda:
        why = f"auto: inputs on {device or 'cpu'}, Triton kernels run on CUDA"
    elif not triton_available():
        why = "auto: triton is not installed"
    elif unsupported is not None:
        why = f"auto: the Triton kernel does not support {unsupported}"
    else:
        _log_once(op, "triton", "auto: CUDA inputs")
        return "triton"
    _log_once(op, "pytorch", why)
    return "pytorch"
