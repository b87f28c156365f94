"""The retrieval loss's logit matmuls from float16 inputs, float32 accumulation and float32 outputs.

The sampled-softmax loss is computed in float32 (``recforge.train.losses``): at temperature 0.05 a logit is up to
~20, and bfloat16 *logits* would carry ~0.1 of rounding each. On CUDA its float32 matmuls run as TF32 (the
runtime allows it): the inputs are rounded to a 10-bit mantissa and the products summed in float32. float16
*inputs* have the same 10-bit mantissa, so a float16-input, float32-output matmul (cuBLAS, ``torch.mm(...,
out_dtype=torch.float32)``) gives logits of TF32's precision at twice its tensor-core throughput. Its range is
the only difference, and the loss's vectors are L2-normalised (every entry within [-1, 1]; the user side may be
scaled by 1 / temperature first), far inside float16's.

The backward's matmuls take the logits' gradient ``G`` as their float16 input: ``G`` is divided by its largest
magnitude first (a device scalar: no host sync) and the products multiplied back, so its entries sit in [-1, 1]
where float16 keeps 10 bits; entries below ~6e-5 of the largest become subnormal and keep an absolute error of at
most ~3e-8 of it. A loss that builds its own gradients with entries already in [-1, 1] (softmax minus one-hot:
``recforge.train.chunked_softmax``) calls ``mm_f32`` directly.

``loss.matmul: float16`` turns it on (CUDA only; CPU tensors keep float32 matmuls). On CPU the same numbers are
computed from float16 values widened to float32 (exact: every float16 is a float32), which the tests use.

Example:
    >>> logits = half_input_logits(user, items)       # (T, d) x (S, d) -> (T, S) float32, user @ items.T
"""

from __future__ import annotations

import torch
from torch import Tensor

MATMULS = ("float32", "float16")  # loss.matmul: the logit matmuls' input dtype on CUDA


def mm_f32(a: Tensor, b: Tensor, bias: Tensor | None = None, alpha: float = 1.0) -> Tensor:
    """``alpha * a @ b (+ bias)`` in float32 from float16 ``a`` (m, k) and ``b`` (k, n); ``bias`` float32,
    broadcast to (m, n). CUDA: one cuBLAS call with float32 accumulation and output. CPU: the float16 values
    widened to float32 (the same products; the summation order may differ)."""
    if a.is_cuda:
        if bias is None:
            out = torch.mm(a, b, out_dtype=torch.float32)
            return out if alpha == 1.0 else out.mul_(alpha)
        return torch.addmm(bias.expand(a.shape[0], b.shape[1]), a, b, out_dtype=torch.float32, alpha=alpha)
    out = torch.mm(a.float(), b.float())
    if alpha != 1.0:
        out = out.mul_(alpha)
    return out if bias is None else out.add_(bias)


class _HalfInputLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a: Tensor, b: Tensor) -> Tensor:
        a16, b16 = a.to(torch.float16), b.to(torch.float16)
        ctx.save_for_backward(a16, b16)
        return mm_f32(a16, b16.T)

    @staticmethod
    def backward(ctx, grad: Tensor):
        a16, b16 = ctx.saved_tensors
        # G / max|G| in [-1, 1]; clamp: an all-zero G (every logit masked, or weight 0) gives zeros, not NaN
        scale = grad.abs().amax().clamp_min(torch.finfo(torch.float32).tiny)
        g16 = (grad / scale).to(torch.float16)
        grad_a = mm_f32(g16, b16).mul_(scale) if ctx.needs_input_grad[0] else None
        grad_b = mm_f32(g16.T, a16).mul_(scale) if ctx.needs_input_grad[1] else None
        return grad_a, grad_b


def half_input_logits(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b.T`` (float32, (m, n)) from ``a`` (m, k) and ``b`` (n, k) rounded to float16, summed in float32;
    gradients flow to both (float32, as the inputs), through float16 matmuls of the scaled output gradient."""
    if a.dtype != torch.float32 or b.dtype != torch.float32:
        raise TypeError(f"half_input_logits: float32 inputs expected (the loss's dtype), got {a.dtype} and {b.dtype}")
    return _HalfInputLogits.apply(a, b)


def use_half(matmul: str, device: torch.device) -> bool:
    """Whether ``loss.matmul`` asks for float16-input logit matmuls here: ``float16`` on a CUDA device."""
    if matmul not in MATMULS:
        raise ValueError(f"loss.matmul={matmul!r}: expected one of {', '.join(MATMULS)}")
    return matmul == "float16" and device.type == "cuda"
