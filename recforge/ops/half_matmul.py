"""The retrieval loss's logit matmuls from float16 inputs, float32 accumulation and float32 outputs.

The sampled-softmax loss is computed in float32 (``recforge.train.losses``): at temperature 0.05 a logit is up to
~20, and bfloat16 *logits* would carry ~0.1 of rounding each. On CUDA its float32 matmuls run as TF32 (the
runtime allows it): the inputs are rounded to a 10-bit mantissa and the products summed in float32. float16
*inputs* have the same 10-bit mantissa, so a float16-input, float32-output matmul (cuBLAS, ``torch.mm(...,
out_dtype=torch.float32)``) gives logits of TF32's precision at twice its tensor-core throughput. Its range is
the only difference, and the loss's vectors are L2-normalised (every entry within [-1, 1]; the user side may be
scaled by 1 / temperature first), far inside float16's.

The backward's matmuls take the logits' gradient ``G`` in bfloat16 (float32's range: ``G`` is ~1 / (positions x
temperature), below float16's normal range) with bfloat16 copies of the inputs, summed in float32: the precision
of a bfloat16 autocast backward, and the cast fuses into the kernel that computes ``G`` under ``torch.compile``.
(Scaling ``G`` into float16's range needs its maximum first: one more reduction over the (T, S) gradient, which
cost more than the matmul saved: H200, BENCHMARKS.md, 2026-11-25 15th session.) The chunked loss
(``recforge.train.chunked_softmax``), which builds its own gradients, casts them to bfloat16 as well: float16 would
keep more bits of the large entries but flush the small ones (a catalogue of 1M items loses ~40% of them to zero).

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
    """``alpha * a @ b (+ bias)`` in float32 from float16 (or bfloat16) ``a`` (m, k) and ``b`` (k, n); ``bias``
    float32, broadcast to (m, n). CUDA: one cuBLAS call with float32 accumulation and output. CPU: the values
    widened to float32 (the same products; the summation order may differ)."""
    if a.is_cuda:
        if bias is not None and not torch.compiler.is_compiling():  # one call, bias and alpha in its epilogue
            return torch.addmm(bias.expand(a.shape[0], b.shape[1]), a, b, out_dtype=torch.float32, alpha=alpha)
        # compiled: addmm's out_dtype overload fails in Dynamo's fake-tensor decomposition (PyTorch 2.11); mm's
        # works, and Inductor fuses the scale and the bias into the next kernel
        out = torch.mm(a, b, out_dtype=torch.float32)
        out = out if alpha == 1.0 else out * alpha
        return out if bias is None else out + bias
    out = torch.mm(a.float(), b.float())
    if alpha != 1.0:
        out = out.mul_(alpha)
    return out if bias is None else out.add_(bias)


def mm_f32_add_(acc: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """``acc += a @ b`` in place: float32 ``acc`` (m, n), float16 / bfloat16 ``a`` (m, k) and ``b`` (k, n). CUDA,
    eager: one cuBLAS call accumulating into ``acc`` (no (m, n) temporary: a whole catalogue's gradient table per
    chunk, say); compiled or CPU: ``mm_f32`` then an add."""
    if a.is_cuda and not torch.compiler.is_compiling():
        return torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    return acc.add_(mm_f32(a, b))


class _HalfInputLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a: Tensor, b: Tensor) -> Tensor:
        ctx.save_for_backward(a, b)
        return mm_f32(a.to(torch.float16), b.to(torch.float16).T)

    @staticmethod
    def backward(ctx, grad: Tensor):
        a, b = ctx.saved_tensors
        g = grad.to(torch.bfloat16)
        grad_a = mm_f32(g, b.to(torch.bfloat16)) if ctx.needs_input_grad[0] else None
        grad_b = mm_f32(g.T, a.to(torch.bfloat16)) if ctx.needs_input_grad[1] else None
        return grad_a, grad_b


def half_input_logits(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b.T`` (float32, (m, n)) from ``a`` (m, k) and ``b`` (n, k) rounded to float16, summed in float32;
    gradients flow to both (float32, as the inputs), through bfloat16 matmuls summed in float32."""
    if a.dtype != torch.float32 or b.dtype != torch.float32:
        raise TypeError(f"half_input_logits: float32 inputs expected (the loss's dtype), got {a.dtype} and {b.dtype}")
    return _HalfInputLogits.apply(a, b)


def use_half(matmul: str, device: torch.device) -> bool:
    """Whether ``loss.matmul`` asks for float16-input logit matmuls here: ``float16`` on a CUDA device."""
    if matmul not in MATMULS:
        raise ValueError(f"loss.matmul={matmul!r}: expected one of {', '.join(MATMULS)}")
    return matmul == "float16" and device.type == "cuda"
