"""HSTU attention of new query tokens over a cached prefix (prefill chunks, incremental extension, candidates).

Same arithmetic as ``recforge.ops.hstu_attention`` (``SiLU(q.k + rab) * scale * v``, summed
over visible keys) but for m queries against n cached keys, never an n x n matrix over the
whole sequence. Positions are *effective* positions: a candidate sits at the history end
``h`` (the index of the first target), so its position bias to history key j is
``pos_weights[clamp(h - j)]`` and to itself ``pos_weights[0]``, whatever its index among the
candidates; its time bias uses its own timestamp.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from recforge.ops.hstu_attention import time_buckets


def relative_bias_rows(
    q_pos: Tensor,
    k_pos: Tensor,
    q_ts: Tensor,
    k_ts: Tensor,
    pos_weights: Tensor | None,
    time_weights: Tensor | None,
) -> Tensor | None:
    """(m', n) position + time bias; m' = 1 when every query has the same position and time."""
    uniform = q_pos.numel() > 0 and bool((q_pos == q_pos[0]).all()) and bool((q_ts == q_ts[0]).all())
    if uniform:
        q_pos, q_ts = q_pos[:1], q_ts[:1]
    bias = None
    if pos_weights is not None:
        distance = (q_pos.view(-1, 1) - k_pos.view(1, -1)).clamp(0, pos_weights.numel() - 1)
        bias = pos_weights[distance]
    if time_weights is not None:
        buckets = time_buckets(q_ts.view(-1, 1) - k_ts.view(1, -1), time_weights.numel() - 1)
        bias = time_weights[buckets] if bias is None else bias + time_weights[buckets]
    return bias


def cached_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    visible: Tensor,
    bias: Tensor | None,
    scale: float,
) -> Tensor:
    """out_i = sum_j visible_ij * SiLU(q_i . k_j + bias_ij) * scale * v_j.

    Args:
        q: (m, H, Dqk) queries; k: (n, H, Dqk) keys; v: (n, H, Dv) values.
        visible: (m, n) or (1, n) bool.
        bias: (m, n), (1, n) or None.

    Returns:
        (m, H, Dv).
    """
    scores = torch.einsum("mhd,nhd->hmn", q, k)  # (H, m, n)
    if bias is not None:
        scores = scores + bias.to(scores.dtype).unsqueeze(0)
    weights = F.silu(scores) * (visible.unsqueeze(0).to(scores.dtype) * scale)
    return torch.einsum("hmn,nhd->mhd", weights, v)


def self_attention_term(
    q: Tensor, k: Tensor, v: Tensor, q_ts: Tensor, pos_weights: Tensor | None, time_weights: Tensor | None, scale: float
) -> Tensor:
    """Each candidate's attention to itself: SiLU(q_i . k_i + pos_weights[0] + time bias(0)) * scale * v_i."""
    scores = (q * k).sum(-1)  # (m, H)
    if pos_weights is not None:
        scores = scores + pos_weights[0].to(scores.dtype)
    if time_weights is not None:
        scores = scores + time_weights[time_buckets(torch.zeros_like(q_ts[:1]), time_weights.numel() - 1)].to(scores.dtype)
    return (F.silu(scores) * scale).unsqueeze(-1) * v


__all__ = ["cached_attention", "relative_bias_rows", "self_attention_term"]
