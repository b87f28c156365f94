"""The HSTU block's combine chain, ``dropout(layer_norm(a) * u)``, fused into one Triton kernel per direction.

    y = dropout(LayerNorm(a; weight, bias, eps) * u, p)      a, u: (T, N), N = H * Dv

Unfused, PyTorch runs it as about four forward and six backward elementwise/norm kernels over (T, N),
each a full read and write. The Triton path reads ``a`` and ``u`` once forward and once backward, in
float32 math whatever the inputs' dtype; its output takes the inputs' dtype (under bf16 autocast,
bf16: the next Linear would round PyTorch's float32 output to it anyway). Dropout keeps an element
with probability 1 - p and scales it by 1 / (1 - p), like ``F.dropout``, with masks drawn by the
kernels from a seed that ``torch.randint`` makes on the device per call: no host sync, fresh masks
in every CUDA-graph replay, the same mask when activation checkpointing recomputes the block (it
restores the RNG state), and no random draw at all without dropout. The masks are not
``F.dropout``'s (another random stream), so dropout runs agree in distribution, not element by element.

On by default on CUDA (H200: ML-1M's bf16 + CUDA-graph step 11.1 -> 9.4 ms, fp32 eager 17.2 -> 15.9 ms; the
test metrics over 3 seeds as the PyTorch chain's; BENCHMARKS.md, RESULTS.md). ``RECFORGE_FUSED_NORM_GATE=0``
(read at import; or set ``fused = False``) runs the PyTorch chain on every device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from recforge.env import fused_norm_gate
from recforge.ops.custom_ops import norm_gate_op
from recforge.ops.dispatch import TRITON_DTYPES, resolve_kernel

MAX_TRITON_WIDTH = 8192  # widest row (H * Dv) one Triton program holds in registers
fused = fused_norm_gate()  # True: the Triton path on CUDA (False: the PyTorch chain, for A/B); read at each call
_SEED_HIGH = 2**62


def dropout_seed(p: float, device: torch.device) -> Tensor | None:
    """The fused kernels' dropout seed: one int64 drawn on the device by torch's generator (graph-safe Philox offsets,
    replayed by activation checkpointing); None without dropout."""
    return torch.randint(0, _SEED_HIGH, (1,), device=device) if p > 0.0 else None


def fused_kernels() -> bool:
    """Whether the fused Triton kernels are on (``fused``: ``$RECFORGE_FUSED_NORM_GATE``, or set by a caller)."""
    return fused


def norm_gate_reference(a: Tensor, u: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, p: float,
                        training: bool) -> Tensor:  # fmt: skip
    """PyTorch: ``F.dropout(F.layer_norm(a) * u, p, training)``, the calls ``nn.LayerNorm`` and ``nn.Dropout`` make."""
    return F.dropout(F.layer_norm(a, (a.shape[-1],), weight, bias, eps) * u, p, training)


def unsupported(a: Tensor, u: Tensor, weight: Tensor | None, bias: Tensor | None) -> str | None:
    """Why the Triton kernel cannot take these inputs, or None when it can."""
    if weight is None or bias is None:
        return "a LayerNorm without weight and bias"
    if a.dim() != 2 or u.shape != a.shape:
        return f"inputs of shapes {tuple(a.shape)} and {tuple(u.shape)} (expected two equal (T, N))"
    bad = [str(t.dtype) for t in (a, u, weight, bias) if t.dtype not in TRITON_DTYPES]
    if bad:
        return f"dtype {bad[0]} (supported: float16, bfloat16, float32)"
    if a.shape[-1] > MAX_TRITON_WIDTH:
        return f"row width {a.shape[-1]} > {MAX_TRITON_WIDTH}"
    return None


def norm_gate(
    a: Tensor,
    u: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    *,
    eps: float = 1e-5,
    p: float = 0.0,
    training: bool = False,
    kernel: str = "auto",
) -> Tensor:
    """``dropout(layer_norm(a) * u)``: HSTU's normalised attention output gated by ``u``.

    Args:
        a: (T, N) attention output, heads flattened (N = H * Dv).
        u: (T, N) gate (any row stride: a slice of the uvqk projection).
        weight: (N,) LayerNorm scale.
        bias: (N,) LayerNorm shift.
        eps: LayerNorm epsilon.
        p: dropout probability, applied when ``training``.
        training: apply dropout (``nn.Module.training``).
        kernel: "auto" | "pytorch" | "triton"; "auto" runs the Triton kernel on CUDA inputs it supports
            (float16/bfloat16/float32, N <= 8192, an affine LayerNorm), else the PyTorch chain, and logs
            which once (``recforge.ops.dispatch``).

    Returns:
        (T, N), in the promoted dtype of ``a`` and ``u`` on the Triton path, PyTorch's dtypes on the other.

    Example:
        >>> y = norm_gate(attn, u, ln.weight, ln.bias, eps=ln.eps, p=0.2, training=True)
    """
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"norm_gate: dropout probability p={p} is not in [0, 1]")
    kernel = kernel if fused else "pytorch"
    if resolve_kernel("norm_gate", kernel, a.device, unsupported(a, u, weight, bias)) == "pytorch":
        return norm_gate_reference(a, u, weight, bias, eps, p, training)
    p = p if training else 0.0
    seed = dropout_seed(p, a.device)
    if torch.compiler.is_compiling():  # one opaque custom op, not a trace of the launch code
        return norm_gate_op(a, u, weight, bias, seed, eps, p)
    from recforge.ops.triton.norm_gate import NormGate  # defined on first use: see recforge.ops.triton

    return NormGate.apply(a, u, weight, bias, seed, eps, p)


__all__ = ["MAX_TRITON_WIDTH", "dropout_seed", "fused_kernels", "norm_gate", "norm_gate_reference", "unsupported"]
