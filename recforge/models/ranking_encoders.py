"""Ranking encoders besides HSTU: the DLRM-style ``ContextPool``, the ``ItemOnly`` baseline, and
wrappers that add a path beside an encoder (``ContextCross``, the DIN-style ``TargetHistoryPool``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from recforge.jagged.index import range_index, sequence_ids
from recforge.jagged.mask import AttentionMask
from recforge.models.slices import build_slice, slice_spec


class ContextPool(nn.Module):
    """Non-sequential encoder for a DLRM-style baseline: each target sees only the contextual
    tokens (user features) and itself, never the history.

    out_target = MLP([x_target, mean(contextual), x_target * mean(contextual)]); other tokens pass through.
    """

    def __init__(self, dim: int, hidden: int = 256, dropout: float = 0.0) -> None:
        super().__init__()
        self.kwargs = {"dim": dim, "hidden": hidden, "dropout": dropout}
        self.mlp = nn.Sequential(
            nn.Linear(3 * dim, hidden), nn.SiLU(), nn.Dropout(dropout), nn.Linear(hidden, hidden), nn.SiLU(),
            nn.Linear(hidden, dim),
        )  # fmt: skip

    def slice_config(self) -> dict:
        return dict(self.kwargs)

    def forward(
        self, x: Tensor, seq_offsets: Tensor, max_seq_len: int, mask: AttentionMask, timestamps: Tensor | None = None
    ) -> Tensor:
        batch = seq_offsets.numel() - 1
        c = mask.num_contextual if mask.num_contextual is not None else torch.zeros(batch, dtype=torch.int64)
        t = mask.num_targets if mask.num_targets is not None else torch.zeros(batch, dtype=torch.int64)
        ctx_index, ctx_off = range_index(seq_offsets[:-1], c)
        ctx_sum = torch.zeros(batch, x.shape[1], dtype=x.dtype, device=x.device)
        ctx_sum.index_add_(0, sequence_ids(ctx_off, ctx_index.numel()), x[ctx_index])
        ctx_mean = ctx_sum / c.clamp(min=1).unsqueeze(1).to(x.dtype)
        tgt_index, tgt_off = range_index(seq_offsets[1:] - t, t)
        target = x[tgt_index]
        context = ctx_mean[sequence_ids(tgt_off, tgt_index.numel())]
        out = x.clone()
        out[tgt_index] = target + self.mlp(torch.cat([target, context, target * context], 1))
        return out


class ContextCross(nn.Module):
    """An encoder followed by ``ContextPool`` on its outputs: each target also gets the DLRM-style
    cross ``MLP([h_t, mean(contextual), h_t * mean(contextual)])`` of its encoded state with the
    encoded user features, a direct candidate x user-feature path beside the attention.
    """

    def __init__(self, inner: dict, dim: int, hidden: int = 256, dropout: float = 0.0) -> None:
        super().__init__()
        self.kwargs = {"inner": inner, "dim": dim, "hidden": hidden, "dropout": dropout}
        self.inner = build_slice(inner["class"], inner["kwargs"])
        self.cross = ContextPool(dim, hidden, dropout)

    @classmethod
    def wrap(cls, inner: nn.Module, dim: int, **kwargs: Any) -> ContextCross:
        cross = cls(slice_spec(inner), dim, **kwargs)
        cross.inner = inner
        return cross

    def slice_config(self) -> dict:
        return dict(self.kwargs)

    def forward(
        self, x: Tensor, seq_offsets: Tensor, max_seq_len: int, mask: AttentionMask, timestamps: Tensor | None = None
    ) -> Tensor:
        return self.cross(self.inner(x, seq_offsets, max_seq_len, mask, timestamps), seq_offsets, max_seq_len, mask)


class ItemOnly(nn.Module):
    """Non-personalised baseline encoder: every token passes through unchanged, so a target's
    score depends on the candidate item (and its side features) alone, never on the user.
    """

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.kwargs = {"dim": dim}

    def slice_config(self) -> dict:
        return dict(self.kwargs)

    def forward(
        self, x: Tensor, seq_offsets: Tensor, max_seq_len: int, mask: AttentionMask, timestamps: Tensor | None = None
    ) -> Tensor:
        return x


class TargetHistoryPool(nn.Module):
    """An encoder plus DIN-style target attention (Zhou et al. 2018): each candidate pools the
    history events it may see, weighted by a learned match with the candidate.

    For target t (prefix embedding e_t) and each visible history token j (prefix embedding x_j,
    recency r = how many visible events come after it, 0 = the previous event)::

        w_tj     = sigmoid(v . SiLU(A e_t + B x_j + C (e_t * x_j) + R[min(r, R - 1)]))
        pooled_t = sum_j w_tj x_j / (visible events)      # a learned, candidate-specific share
        out_t    = inner(x)_t + MLP([pooled_t, pooled_t * e_t])

    Unnormalised sigmoid weights keep *how much* of the history matches the candidate (softmax
    would only say which events match), and the recency table lets it single out the previous
    event. Visibility is the ranking mask's: history events strictly before the target's
    timestamp (all history when there are no timestamps). Non-target tokens pass through.
    """

    def __init__(self, inner: dict, dim: int, hidden: int = 32, recency_buckets: int = 16, dropout: float = 0.0) -> None:
        super().__init__()
        self.kwargs = {"inner": inner, "dim": dim, "hidden": hidden, "recency_buckets": recency_buckets, "dropout": dropout}
        self.inner = build_slice(inner["class"], inner["kwargs"])
        self.query = nn.Linear(dim, hidden)
        self.key = nn.Linear(dim, hidden, bias=False)
        self.cross = nn.Linear(dim, hidden, bias=False)
        self.recency = nn.Embedding(recency_buckets, hidden)
        nn.init.zeros_(self.recency.weight)
        self.score = nn.Linear(hidden, 1)
        self.out = nn.Sequential(nn.Linear(2 * dim, 2 * dim), nn.SiLU(), nn.Dropout(dropout), nn.Linear(2 * dim, dim))
        self.recency_buckets = recency_buckets

    @classmethod
    def wrap(cls, inner: nn.Module, dim: int, **kwargs: Any) -> TargetHistoryPool:
        """Wrap an existing encoder (its weights are kept)."""
        pool = cls(slice_spec(inner), dim, **kwargs)
        pool.inner = inner
        return pool

    def slice_config(self) -> dict:
        return dict(self.kwargs)

    def forward(
        self, x: Tensor, seq_offsets: Tensor, max_seq_len: int, mask: AttentionMask, timestamps: Tensor | None = None
    ) -> Tensor:
        encoded = self.inner(x, seq_offsets, max_seq_len, mask, timestamps)
        hist, visible, target_index = visible_history(seq_offsets, mask)  # (N, H), (N, H), (N,)
        if target_index.numel() == 0 or hist.shape[1] == 0:
            return encoded
        e = x[target_index]  # (N, d)
        xh = x[hist]  # (N, H, d)
        count = visible.sum(1, keepdim=True)  # (N, 1)
        recency = (count - 1 - torch.arange(hist.shape[1], device=x.device)).clamp(0, self.recency_buckets - 1)  # (N, H)
        z = self.query(e).unsqueeze(1) + self.key(xh) + self.cross(xh * e.unsqueeze(1)) + self.recency(recency)  # (N, H, h)
        weight = torch.sigmoid(self.score(F.silu(z)).squeeze(2)) * visible  # (N, H)
        pooled = (weight.unsqueeze(2) * xh).sum(1) / count.clamp(min=1).to(x.dtype)  # (N, d)
        out = encoded.clone()
        out[target_index] = encoded[target_index] + self.out(torch.cat([pooled, pooled * e], 1))
        return out


def visible_history(seq_offsets: Tensor, mask: AttentionMask) -> tuple[Tensor, Tensor, Tensor]:
    """Each target's history as a padded index: (hist (N, H) token index, visible (N, H) bool,
    target token index (N,)), N = targets in the batch, H = the longest history.

    History tokens sit between the contextual prefix and the targets, in time order; a target sees
    those strictly before its own timestamp when ``mask.timestamps`` is set, else all of them.
    """
    batch = seq_offsets.numel() - 1
    device = seq_offsets.device
    zeros = torch.zeros(batch, dtype=torch.int64, device=device)
    c = mask.num_contextual if mask.num_contextual is not None else zeros
    t = mask.num_targets if mask.num_targets is not None else zeros
    lengths = seq_offsets[1:] - seq_offsets[:-1]
    hist_len = lengths - c - t  # (B,)
    target_index, target_off = range_index(seq_offsets[1:] - t, t)
    seq = sequence_ids(target_off, target_index.numel())  # (N,) sequence of each target
    width = int(hist_len.max()) if batch else 0
    cols = torch.arange(width, device=device)
    hist = (seq_offsets[:-1] + c)[seq].unsqueeze(1) + cols  # (N, H)
    visible = cols < hist_len[seq].unsqueeze(1)
    hist = torch.where(visible, hist, target_index.unsqueeze(1))  # padding reads the target itself (masked)
    if mask.timestamps is not None:
        visible = visible & (mask.timestamps[hist] < mask.timestamps[target_index].unsqueeze(1))
    return hist, visible, target_index


__all__ = ["ContextCross", "ContextPool", "ItemOnly", "TargetHistoryPool", "visible_history"]
