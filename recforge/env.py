"""Every environment variable recforge reads, in one place.

    RECFORGE_DATA                   where real datasets live (default: ``shared/data`` beside the recforge checkout,
                                    i.e. ``<checkout>/../shared/data`` whatever the working directory)
    RECFORGE_TRUSTED_SLICE_MODULES  comma-separated modules whose classes saved models may name
                                    (``recforge.models.slices``)
    RECFORGE_TRITON_LAUNCH_PLANS    0 (or false/off/no): launch every Triton kernel through Triton's own launch path
                                    (``recforge.ops.triton.tuning``; default 1)
    RECFORGE_FUSED_NORM_GATE        0 (or false/off/no): the HSTU block's LayerNorm * gate * dropout as PyTorch ops
                                    on CUDA too (``recforge.ops.norm_gate``); default 1, one fused Triton kernel
                                    each way on CUDA
    RECFORGE_FUSED_GATHER_DOT       sampled softmax's per-position gather-dot (``recforge.ops.gather_dot``): unset, the
                                    Triton kernels for float32 CUDA inputs and PyTorch's gather + bmm for bf16/fp16;
                                    1 (or true/on/yes) the kernels for every supported dtype; 0 (or false/off/no)
                                    PyTorch's always
    RECFORGE_HSTU_FUSED_DQ          the Triton HSTU attention backward computes dQ inside its dK/dV kernel (float32
                                    atomics, one launch; ``recforge.ops.triton.hstu.fused_dq``; autotuned bf16/fp16
                                    launches only, never in deterministic mode): unset, for sequences of more than 2,048
                                    tokens at head dims over 64; 1 (or true/on/yes) for every such launch; 0 never (the
                                    Gluon backward, below, has a dQ kernel of its own and no atomics)
    RECFORGE_GLUON_HSTU             0 (or false/off/no): the HSTU attention in Triton everywhere; default on, the
                                    Gluon forward and backward (``recforge.ops.triton.hstu_gluon``) for the calls they
                                    support (Hopper, bf16/fp16, head dim 128, causal, no relative bias), and there the
                                    block's SiLU, attention and gate as one op (``recforge.ops.triton.hstu_silu``;
                                    a compiled step keeps the choice it was traced with)
    TRITON_INTERPRET                1: Triton kernels run in Triton's CPU interpreter (tests)

The five RECFORGE_ switches (launch plans, norm gate, gather-dot, fused dQ, Gluon HSTU) take 1/true/on/yes or 0/false/off/no (any case); any other value is refused with
``ValueError``. Each is read when its function is called, so a test can set it with ``monkeypatch.setenv``;
``RECFORGE_TRITON_LAUNCH_PLANS`` is read once, when the Triton kernels are first imported, and
``RECFORGE_FUSED_NORM_GATE`` once, when ``recforge.ops.norm_gate`` is imported, ``RECFORGE_FUSED_GATHER_DOT``
once, when ``recforge.ops.gather_dot`` is imported, and ``RECFORGE_HSTU_FUSED_DQ`` once, when the HSTU Triton kernels
are; ``RECFORGE_GLUON_HSTU`` on every attention call.
"""

from __future__ import annotations

import os

TRUSTED_SLICE_MODULES = "RECFORGE_TRUSTED_SLICE_MODULES"


def data_dir() -> str | None:
    """``$RECFORGE_DATA``, or None when unset or empty."""
    return os.environ.get("RECFORGE_DATA") or None


def trusted_slice_modules() -> set[str]:
    """Module names listed in ``$RECFORGE_TRUSTED_SLICE_MODULES`` (comma-separated, spaces ignored)."""
    return {m.strip() for m in os.environ.get(TRUSTED_SLICE_MODULES, "").split(",") if m.strip()}


_ON, _OFF = ("1", "true", "on", "yes"), ("0", "false", "off", "no")


def _switch(name: str) -> bool | None:
    """``$name`` as a switch: True for 1, true, on or yes, False for 0, false, off or no (any case, spaces ignored),
    None when unset or empty. Any other value raises ``ValueError``: a typo must not silently pick a code path."""
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return None
    if value in _ON or value in _OFF:
        return value in _ON
    raise ValueError(f"{name}={value!r}: use 1/true/on/yes or 0/false/off/no, or leave it unset for the default")


def triton_launch_plans() -> bool:
    """``$RECFORGE_TRITON_LAUNCH_PLANS`` (``_switch``): on unless switched off."""
    return _switch("RECFORGE_TRITON_LAUNCH_PLANS") is not False


def fused_norm_gate() -> bool:
    """``$RECFORGE_FUSED_NORM_GATE`` (``_switch``): on unless switched off."""
    return _switch("RECFORGE_FUSED_NORM_GATE") is not False


def fused_gather_dot() -> bool | None:
    """``$RECFORGE_FUSED_GATHER_DOT`` (``_switch``): True, False, or None when unset (the default: the fused kernels
    for float32 inputs only, where the H200 measured them faster)."""
    return _switch("RECFORGE_FUSED_GATHER_DOT")


def hstu_fused_dq() -> bool | None:
    """``$RECFORGE_HSTU_FUSED_DQ`` (``_switch``): True, False, or None when unset (the default: fused for sequences
    longer than ``recforge.ops.triton.hstu.FUSED_DQ_AUTO_LEN`` at head dims over 64, where the H200 measured it
    faster; ``recforge.ops.triton.hstu._fused_dq``)."""
    return _switch("RECFORGE_HSTU_FUSED_DQ")


def gluon_hstu() -> bool | None:
    """``$RECFORGE_GLUON_HSTU`` (``_switch``): False turns the Gluon HSTU attention (forward and backward) off; unset
    or True, it computes the calls it supports (``recforge.ops.triton.hstu_gluon.supported``)."""
    return _switch("RECFORGE_GLUON_HSTU")


def triton_interpret() -> bool:
    """``$TRITON_INTERPRET`` is set to something other than 0 (Triton reads it when kernels are defined)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


__all__ = ["TRUSTED_SLICE_MODULES", "data_dir", "fused_gather_dot", "fused_norm_gate", "gluon_hstu", "hstu_fused_dq", "triton_interpret", "triton_launch_plans", "trusted_slice_modules"]
