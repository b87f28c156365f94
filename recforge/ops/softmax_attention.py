"""Scaled dot-product (softmax) attention on jagged sequences, as SASRec uses it."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from recforge.jagged.index import jagged_to_padded, padded_to_jagged
from recforge.jagged.mask import AttentionMask
from recforge.ops.dispatch import resolve_kernel, unsupported_by_triton


def softmax_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    seq_offsets: Tensor,
    max_seq_len: int,
    mask: AttentionMask,
    *,
    dropout: float = 0.0,
    kernel: str = "auto",
) -> Tensor:
    """Softmax attention over jagged (T, H, D) q/k/v with the visibility of ``mask``.

    The reference pads to (B, H, N, D) and calls ``F.scaled_dot_product_attention`` with the
    materialised boolean mask. ``kernel="auto"`` runs the Triton kernel on CUDA inputs it
    supports (no dropout; float16/bfloat16/float32; head dims <= 256). Returns (T, H, D).
    """
    unsupported = unsupported_by_triton(q, k, v, head_dims=(q.shape[-1], v.shape[-1]))
    if dropout > 0.0:
        unsupported = f"attention dropout ({dropout})"
    if resolve_kernel("softmax_attention", kernel, q.device, unsupported) == "triton":
        from recforge.ops.triton.softmax import (
            softmax_attention_triton,  # defined on first use: see recforge.ops.triton
        )

        return softmax_attention_triton(q, k, v, seq_offsets, max_seq_len, mask)
    qp = jagged_to_padded(q, seq_offsets, max_seq_len).transpose(1, 2)  # (B, H, N, D)
    kp = jagged_to_padded(k, seq_offsets, max_seq_len).transpose(1, 2)
    vp = jagged_to_padded(v, seq_offsets, max_seq_len).transpose(1, 2)
    visible = mask.dense(seq_offsets, max_seq_len).unsqueeze(1)  # (B, 1, N, N)
    out = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=visible, dropout_p=dropout)
    return padded_to_jagged(out.transpose(1, 2), seq_offsets, q.shape[0])
