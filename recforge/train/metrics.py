"""Ranking metrics for next-item retrieval, computed from the rank of each target."""

from __future__ import annotations

import torch
from torch import Tensor

from recforge.ops.jagged import sequence_ids


def target_ranks(scores: Tensor, targets: Tensor, seen_index: Tensor | None = None, seen_offsets: Tensor | None = None) -> Tensor:
    """0-based rank of each target among all items, excluding items the user has already seen.

    Args:
        scores: (B, N+1) scores over the catalogue; column 0 is padding and never ranked.
        targets: (B,) target item index per row.
        seen_index: (S,) jagged item indices to exclude per row (the user's history). The
            target itself is never excluded, even if it appears in the history.
        seen_offsets: (B+1,) offsets of ``seen_index``.

    Returns:
        (B,) int64: how many other eligible items score at least as high as the target.
        Ties count against the target, so a model that scores everything alike ranks last.
    """
    scores = scores.clone()
    target_scores = scores.gather(1, targets[:, None])  # (B, 1)
    scores[:, 0] = float("-inf")
    if seen_index is not None:
        rows = sequence_ids(seen_offsets, seen_index.numel())
        scores[rows, seen_index] = float("-inf")
    scores.scatter_(1, targets[:, None], float("-inf"))  # the target is not its own competitor
    return (scores >= target_scores).sum(1)


def retrieval_metrics(ranks: Tensor, ks: list[int]) -> dict[str, float]:
    """HR@k, NDCG@k (one relevant item) and MRR from 0-based ranks.

    HR@k = P(rank < k); NDCG@k = mean(1 / log2(rank + 2) if rank < k else 0); MRR = mean(1 / (rank + 1)).
    """
    ranks = ranks.double()
    out = {}
    for k in ks:
        hit = ranks < k
        out[f"hr@{k}"] = hit.double().mean().item()
        out[f"ndcg@{k}"] = torch.where(hit, 1.0 / torch.log2(ranks + 2), torch.zeros_like(ranks)).mean().item()
    out["mrr"] = (1.0 / (ranks + 1)).mean().item()
    return out
