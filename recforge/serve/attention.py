"""HSTU attention of new query tokens over a cached prefix (prefill chunks, incremental extension, candidates).

Same arithmetic as ``recforge.ops.hstu_attention`` (``SiLU(q.k + rab) * scale * v``, summed
over visible keys) but for m queries against n cached keys, never an n x n matrix over the
whole sequence. Positions are *effective* positions: a candidate sits at the history end
``h`` (the index of the first target), so its position bias to history key j is
``pos_weights[clamp(h - j)]`` and to itself ``pos_weights[0]``, whatever its index among the
candidates; its time bias uses its own timestamp. Contextual tokens (positions < c) are
features, not events: no time bias involves them, so a user's cached history does not depend
on the request time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from recforge.ops.hstu_attention import time_buckets
from recforge.serve.state import WorkItem


@dataclass
class BiasIndex:
    """Layer-independent indices of the relative bias of m queries over n keys (computed once per
    pass, gathered from each block's own weights): ``distance`` into ``pos_weights``, ``bucket``
    into ``time_weights``; each (m, n) or (1, n) when every query has the same position and time."""

    distance: Tensor | None
    bucket: Tensor | None
    events: Tensor | None = None  # (m|1, n) bool: the pairs that get a time bias (neither contextual)

    @classmethod
    def build(cls, q_pos: Tensor, k_pos: Tensor, q_ts: Tensor | None, k_ts: Tensor | None, num_pos: int,
              num_buckets: int | None, num_contextual: int = 0) -> BiasIndex:  # fmt: skip
        uniform = q_pos.numel() > 0 and bool((q_pos == q_pos[0]).all())
        if q_ts is not None:
            uniform = uniform and bool((q_ts == q_ts[0]).all())
        if uniform:
            q_pos = q_pos[:1]
            q_ts = None if q_ts is None else q_ts[:1]
        distance = (q_pos.view(-1, 1) - k_pos.view(1, -1)).clamp(0, num_pos - 1) if num_pos else None
        bucket = events = None
        if num_buckets is not None and q_ts is not None:
            bucket = time_buckets(q_ts.view(-1, 1) - k_ts.view(1, -1), num_buckets)
            if num_contextual:
                events = (q_pos.view(-1, 1) >= num_contextual) & (k_pos.view(1, -1) >= num_contextual)
        return cls(distance, bucket, events)

    def bias(self, pos_weights: Tensor | None, time_weights: Tensor | None) -> Tensor | None:
        out = pos_weights[self.distance] if pos_weights is not None and self.distance is not None else None
        if time_weights is not None and self.bucket is not None:
            time_bias = time_weights[self.bucket]
            if self.events is not None:
                time_bias = time_bias * self.events
            out = time_bias if out is None else out + time_bias
        return out


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
    weights = torch.where(visible.unsqueeze(0), F.silu(scores), 0) * scale  # where: invisible keys may hold anything
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


def plan_item(it: WorkItem, q_ts: Tensor, num_pos: int, num_buckets: int | None) -> tuple[int, Tensor, BiasIndex]:
    """(keys attended, (m|1, n) visibility, bias index) of one work item: the same in every block.

    ``num_buckets``: the time-bias buckets, None when the model has no time bias.
    """
    st = it.state
    c = st.num_contextual
    device = st.timestamps.device
    if it.kind == "prefix":  # contextual: full among themselves; history: causal, sees every contextual token
        s, e = it.start, it.start + it.size
        q_pos = torch.arange(s, e, device=device)
        k_pos = torch.arange(e, device=device)
        visible = (k_pos.view(1, -1) < c) | ((q_pos.view(-1, 1) >= c) & (k_pos.view(1, -1) <= q_pos.view(-1, 1)))
        index = BiasIndex.build(q_pos, k_pos, q_ts if num_buckets is not None else None, st.timestamps[:e], num_pos,
                                num_buckets, c)  # fmt: skip
        return e, visible, index
    h = st.length
    k_pos = torch.arange(h, device=device)
    k_ts = st.timestamps[:h]
    q_rows = q_ts[:1] if bool((q_ts == q_ts[0]).all()) else q_ts
    # a candidate sits at the history end h; it sees contextual keys, and history keys strictly earlier than it
    visible = (k_pos.view(1, -1) < c) | (k_ts.view(1, -1) < q_rows.view(-1, 1))
    index = BiasIndex.build(torch.full_like(q_ts, h), k_pos, q_ts if num_buckets is not None else None, k_ts, num_pos,
                            num_buckets, c)  # fmt: skip
    return h, visible, index


__all__ = ["BiasIndex", "cached_attention", "plan_item", "self_attention_term"]
