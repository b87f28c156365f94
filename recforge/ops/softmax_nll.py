"""The sampled softmax's per-row loss and its logit gradients from the logits, in one pass.

For each row t of a block of logits ``s`` (T, K) beside the row's positive logit ``pos[t]``, with the columns whose
item is the row's target (an accidental hit) or the padding item 0 masked out::

    nll[t]      = logsumexp([pos[t] | s[t] masked]) - pos[t]          -log softmax at the positive
    grad[t]     = softmax(...)[1:] * share[t]                         d nll[t] / d s[t], 0 at masked columns
    grad_pos[t] = (softmax(...)[0] - 1) * share[t]                    d nll[t] / d pos[t]

What the losses that compute their gradients in the forward (``recforge.train.chunked_softmax``) need of a block of
shared (or per-position) negatives. On CUDA one Triton kernel reads the logits once and writes the gradient
(``recforge.ops.triton.softmax_nll``); the PyTorch form reads them for the logsumexp, again for the softmax, and
writes masked copies on the way. ``grad_dtype`` bfloat16 writes the gradient the bf16 gradient matmuls take
(``loss.matmul: float16``), half the bytes of float32.

Example:
    >>> nll, g, g_pos = softmax_nll(user @ shared.T / temp, pos, shared_ids, targets)
"""

from __future__ import annotations

import torch
from torch import Tensor

from recforge.ops.custom_ops import softmax_nll_op
from recforge.ops.dispatch import resolve_kernel

default_kernel = "auto"  # what a call without ``kernel`` runs ("triton" in tests: the interpreter on CPU)


def softmax_nll_reference(logits: Tensor, pos: Tensor, ids: Tensor, targets: Tensor, share: Tensor | None = None,
                          grad_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """``softmax_nll`` in PyTorch ops (any device; float32 sums, float64 for float64 logits)."""
    dtype = torch.promote_types(logits.dtype, torch.float32)
    masked = (ids == targets[:, None]) | (ids == 0)  # (T, K), or (K,) broadcast against (T, 1)
    s = logits.to(dtype).masked_fill(masked, float("-inf"))
    pos = pos.to(dtype)
    lse = torch.logaddexp(pos, s.logsumexp(1)) if s.shape[1] else pos
    scale = torch.ones_like(lse) if share is None else share.to(dtype)
    grad = (s - lse[:, None]).exp_().mul_(scale[:, None])
    grad_pos = ((pos - lse).exp() - 1.0) * scale
    return lse - pos, grad.to(grad_dtype or logits.dtype), grad_pos


def unsupported(logits: Tensor, pos: Tensor, ids: Tensor, targets: Tensor, share: Tensor | None) -> str | None:
    """Why the Triton kernel cannot take these inputs, or None when it can."""
    num = logits.shape[0] if logits.dim() == 2 else -1
    if logits.dim() != 2 or pos.shape != (num,) or targets.shape != (num,):
        return (f"logits {tuple(logits.shape)}, pos {tuple(pos.shape)}, targets {tuple(targets.shape)} "
                "(expected (T, K), (T,), (T,))")  # fmt: skip
    if ids.shape not in ((logits.shape[1],), tuple(logits.shape)):
        return f"ids {tuple(ids.shape)} for logits {tuple(logits.shape)} (expected (K,) shared or (T, K))"
    if share is not None and share.shape != (num,):
        return f"share {tuple(share.shape)} (expected (T,))"
    if logits.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"logits dtype {logits.dtype} (expected float32, float16 or bfloat16)"
    if ids.dtype not in (torch.int32, torch.int64) or targets.dtype not in (torch.int32, torch.int64):
        return f"ids {ids.dtype}, targets {targets.dtype} (expected int32 or int64)"
    return None


def softmax_nll(logits: Tensor, pos: Tensor, ids: Tensor, targets: Tensor, share: Tensor | None = None, *,
                grad_dtype: torch.dtype | None = None, kernel: str | None = None,
                ) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """Each row's ``-log softmax`` at its positive over [positive | unmasked columns], and its gradients.

    Args:
        logits: (T, K) the negatives' logits (already divided by the temperature).
        pos: (T,) the positives' logits.
        ids: (K,) the columns' items, shared by every row, or (T, K) each row's own; a column whose item is the
            row's target or 0 (padding) is masked out.
        targets: (T,) each row's target item.
        share: (T,) each row's weight in the mean (its gradients are scaled by it); None: 1.
        grad_dtype: the gradient's dtype (default ``logits``'); its sums are float32 either way.
        kernel: "auto" (Triton on CUDA) | "pytorch" | "triton" (``recforge.ops.dispatch``); None: the module's
            ``default_kernel`` ("auto").

    Returns:
        (nll (T,), grad (T, K), grad_pos (T,)), nll and grad_pos in float32 (float64 for float64 logits); no
        autograd graph (the gradients are the outputs).
    """
    grad_dtype = grad_dtype or logits.dtype
    why = unsupported(logits, pos, ids, targets, share)
    if resolve_kernel("softmax_nll", kernel or default_kernel, logits.device, why) == "pytorch":
        return softmax_nll_reference(logits, pos, ids, targets, share, grad_dtype)
    if torch.compiler.is_compiling():
        return softmax_nll_op(logits, pos, ids, targets, share, grad_dtype)
    from recforge.ops.triton.softmax_nll import softmax_nll as launch  # defined on first use: see recforge.ops.triton

    return launch(logits, pos, ids, targets, share, grad_dtype)


__all__ = ["softmax_nll", "softmax_nll_reference", "unsupported"]
