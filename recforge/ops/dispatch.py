"""Backend choice for ops: one place that decides and logs it once."""

from __future__ import annotations

import logging

KERNELS = ("auto", "pytorch", "triton")
_logged: set[tuple[str, str]] = set()
log = logging.getLogger("recforge.ops")


def resolve_kernel(op: str, kernel: str) -> str:
    """Return the backend that will run ``op`` for the requested ``kernel`` and log it once.

    This build ships only the PyTorch reference; ``kernel="triton"`` is rejected with an
    explanation instead of silently running something else.
    """
    if kernel not in KERNELS:
        raise ValueError(f"{op}: kernel={kernel!r} is not one of {KERNELS}")
    if kernel == "triton":
        raise ValueError(
            f"{op}: no Triton kernel is available in this build of recforge; "
            "use kernel='pytorch' (or 'auto', which picks the fastest available backend)"
        )
    key = (op, kernel)
    if key not in _logged:
        _logged.add(key)
        why = "requested" if kernel == "pytorch" else "auto: the only backend in this build"
        log.info("%s: using the PyTorch reference implementation (%s)", op, why)
    return "pytorch"
