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


# --------------------------------------------------------------------------- AUC / GAUC
#
# Both are computed from one sort: rows are ordered by (group, score), every maximal run of
# equal (group, score) is a "tie block", and a positive earns, for each negative of its group,
# 1 if the negative is in an earlier block and 1/2 if it is in its own block (the Mann-Whitney
# statistic, equal to sklearn's roc_auc_score). Pair counts are kept doubled in int64, so the
# result is exact up to the final division (int64 holds them up to ~4e9 rows).

_INT32_SIGN = 0x7FFF_FFFF
_INT64_SIGN = 0x7FFF_FFFF_FFFF_FFFF


def _score_sort_key(scores: Tensor) -> tuple[Tensor, int]:
    """int64 key with the same order and ties as ``scores``, and how many bits it uses (32 or 64).

    Integer sorts are ~3x faster than float sorts on CPU, and a 32-bit key leaves room to pack
    the group id above it. Floats of 32 bits or fewer are keyed exactly by their float32 bits.
    """
    if scores.dtype == torch.float64:
        bits = (scores + 0.0).view(torch.int64)  # + 0.0 turns -0.0 into +0.0 so they tie
        return bits ^ ((bits >> 63) & _INT64_SIGN), 64  # negative floats: reverse the magnitude order
    bits = (scores.float() + 0.0).view(torch.int32).long()
    return (bits ^ ((bits >> 31) & _INT32_SIGN)) + 2**31, 32  # in [0, 2**32)


def _last_of_runs(sorted_key: Tensor) -> Tensor:
    """(N,) bool, True where the next element differs (and at the end)."""
    last = torch.ones_like(sorted_key, dtype=torch.bool)
    torch.ne(sorted_key[1:], sorted_key[:-1], out=last[:-1])
    return last


def _pair_counts(labels: Tensor, block_last: Tensor, group_last: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-group doubled pair credit, positives and negatives from rows sorted by (group, score).

    Args:
        labels: (N,) int64 0/1 in sorted order.
        block_last: (N,) bool, last row of each (group, score) tie block.
        group_last: (N,) bool, last row of each group (implies ``block_last``).

    Returns:
        (G,) int64 each: 2 * (pairs ranked right + ties / 2), positives, negatives.
    """
    cum_pos = torch.cumsum(labels, 0)  # (N,)
    block_ends = block_last.nonzero().squeeze(1)  # (B,)
    pos_through = cum_pos[block_ends]  # (B,) positives up to and including each block
    neg_through = block_ends + 1 - pos_through  # (B,)
    block_neg = torch.diff(neg_through, prepend=neg_through.new_zeros(1))
    block_pos = torch.diff(pos_through, prepend=pos_through.new_zeros(1))
    ends_group = group_last[block_ends]  # (B,)
    group_of_block = torch.cumsum(ends_group, 0) - ends_group.long()  # (B,) 0-based group index
    group_neg_through = neg_through[ends_group]  # (G,)
    group_pos_through = pos_through[ends_group]
    group_neg = torch.diff(group_neg_through, prepend=group_neg_through.new_zeros(1))
    group_pos = torch.diff(group_pos_through, prepend=group_pos_through.new_zeros(1))
    neg_before_group = (group_neg_through - group_neg)[group_of_block]  # (B,)
    neg_below = neg_through - block_neg - neg_before_group  # (B,) the group's negatives in earlier blocks
    credit_through = torch.cumsum(block_pos * (2 * neg_below + block_neg), 0)[ends_group]  # (G,)
    group_credit = torch.diff(credit_through, prepend=credit_through.new_zeros(1))
    return group_credit, group_pos, group_neg


def _select_rows(name: str, scores: Tensor, labels: Tensor, mask: Tensor | None, groups: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
    """Validate the inputs of ``auc``/``gauc`` and return the masked rows, labels as int64."""
    if scores.dim() != 1:
        raise ValueError(f"{name}: scores must be 1-D (N,), got shape {tuple(scores.shape)}; pass one task's column, e.g. scores[:, k]")
    others = {"labels": labels, "mask": mask, "groups": groups}
    for other, t in others.items():
        if t is not None and tuple(t.shape) != tuple(scores.shape):
            raise ValueError(f"{name}: {other} has shape {tuple(t.shape)} but scores has {tuple(scores.shape)}; they must be one row per impression")
    if mask is not None:
        if mask.dtype != torch.bool:
            raise ValueError(f"{name}: mask must be a bool tensor (True = row has a label), got {mask.dtype}")
        scores, labels = scores[mask], labels[mask]
        groups = groups[mask] if groups is not None else None
    if groups is not None and (groups.is_floating_point() or groups.is_complex() or groups.dtype == torch.bool):
        raise ValueError(f"{name}: groups must be integer ids (e.g. user ids), got {groups.dtype}")
    if scores.is_complex() or scores.dtype == torch.bool:
        raise ValueError(f"{name}: scores must be real numbers, got {scores.dtype}")
    if not scores.is_floating_point():
        scores = scores.double()
    nan = torch.isnan(scores)
    if bool(nan.any()):
        raise ValueError(f"{name}: scores contain {int(nan.sum())} NaN values (after the mask); fix the model output or leave those rows out with mask=")
    if labels.dtype != torch.bool:
        bad = (labels != 0) & (labels != 1)
        if bool(bad.any()):
            value = labels[bad][0].item()
            raise ValueError(f"{name}: labels must be binary (0/1 or bool), found {value!r} in {int(bad.sum())} rows (after the mask); binarise them (e.g. labels > 0) or leave missing labels out with mask=")
    return scores, labels.long(), groups


def auc(scores: Tensor, labels: Tensor, mask: Tensor | None = None) -> float:
    """Binary ROC AUC; tied scores get half credit (equal to ``sklearn.metrics.roc_auc_score``).

    One O(N log N) sort; runs on the tensors' device; pair counts are exact integers.

    Args:
        scores: (N,) any real dtype (logits or probabilities: only the order matters).
        labels: (N,) 0/1 (float or int) or bool.
        mask: (N,) bool, rows to use (e.g. False where the label is missing); None = all rows.

    Returns:
        The AUC, or nan if the selected rows hold only one class (or none).

    Example:
        >>> auc(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0, 0, 1, 1]))
        0.75
    """
    scores, labels, _ = _select_rows("auc", scores, labels, mask)
    if scores.numel() == 0:
        return float("nan")
    key, _ = _score_sort_key(scores)
    key, order = torch.sort(key)
    labels = labels[order]
    group_last = torch.zeros_like(labels, dtype=torch.bool)
    group_last[-1] = True
    credit, pos, neg = _pair_counts(labels, _last_of_runs(key), group_last)
    if pos.item() == 0 or neg.item() == 0:
        return float("nan")
    return credit.double().item() / (2.0 * pos.double().item() * neg.double().item())


def gauc(scores: Tensor, labels: Tensor, groups: Tensor, mask: Tensor | None = None) -> tuple[float, int]:
    """Group (user) AUC: each group's AUC weighted by its number of rows (impressions).

    Groups whose selected rows hold a single class are skipped. Vectorised: rows are sorted once
    by (group, score) and per-group counts come from cumulative sums, with no per-group loop.
    Float scores of 32 bits or fewer and group ids in [0, 2**31) are packed into one int64 key and
    sorted once; otherwise (float64 scores, negative or larger ids) two stable sorts give the same
    order at about twice the cost.

    Args:
        scores: (N,) any real dtype; ties within a group get half credit.
        labels: (N,) 0/1 (float or int) or bool.
        groups: (N,) integer group ids; rows of one group need not be contiguous.
        mask: (N,) bool, rows to use; None = all rows.

    Returns:
        (GAUC, number of groups used); (nan, 0) if no group has both classes.

    Example:
        >>> gauc(torch.tensor([0.1, 0.9, 0.2, 0.3, 0.5]), torch.tensor([0, 1, 1, 0, 1]), torch.tensor([7, 7, 3, 3, 3]))
        (0.7, 2)
    """
    if groups is None:
        raise ValueError("gauc: groups is required (one id per row); use auc() for a pooled AUC")
    scores, labels, groups = _select_rows("gauc", scores, labels, mask, groups)
    if scores.numel() == 0:
        return float("nan"), 0
    groups = groups.long()
    key, bits = _score_sort_key(scores)
    if bits == 32 and int(groups.min()) >= 0 and int(groups.max()) < 2**31:
        key, order = torch.sort((groups << 32) | key)
        block_last, group_last = _last_of_runs(key), _last_of_runs(key >> 32)
    else:
        key, order = torch.sort(key, stable=True)
        sorted_groups, by_group = torch.sort(groups[order], stable=True)
        key, order = key[by_group], order[by_group]
        group_last = _last_of_runs(sorted_groups)
        block_last = group_last | _last_of_runs(key)
    credit, pos, neg = _pair_counts(labels[order], block_last, group_last)
    used = (pos > 0) & (neg > 0)
    num_used = int(used.sum())
    if num_used == 0:
        return float("nan"), 0
    pos, neg, credit = pos[used].double(), neg[used].double(), credit[used].double()
    weight = pos + neg
    return (weight * credit / (2.0 * pos * neg)).sum().item() / weight.sum().item(), num_used


def ranking_metrics(scores: Tensor, labels: Tensor, groups: Tensor, task_names: list[str], label_mask: Tensor | None = None) -> dict[str, float]:
    """AUC, GAUC and log loss for each binary task of a multi-task ranking model.

    Args:
        scores: (N, K) logits, one column per task (before the sigmoid: log loss is computed
            with ``binary_cross_entropy_with_logits``; AUC only needs their order, and logits do
            not collapse into ties the way saturated float32 probabilities do).
        labels: (N, K) 0/1 or bool.
        groups: (N,) integer group (user) ids for GAUC.
        task_names: K names, used as key prefixes.
        label_mask: (N, K) bool, True where the task's label is present; None = all present.

    Returns:
        ``{f"{task}/auc", f"{task}/gauc", f"{task}/gauc_users", f"{task}/logloss"}`` per task;
        ``gauc_users`` is the number of groups that had both classes. Values are nan where
        undefined (one class, or no rows).

    Example:
        >>> m = ranking_metrics(logits, labels, user_ids, ["click", "like"], label_mask)
        >>> m["click/gauc"], m["like/logloss"]
    """
    if scores.dim() != 2:
        raise ValueError(f"ranking_metrics: scores must be (N, K) logits, got shape {tuple(scores.shape)}; use scores[:, None] for one task")
    if tuple(labels.shape) != tuple(scores.shape):
        raise ValueError(f"ranking_metrics: labels has shape {tuple(labels.shape)} but scores has {tuple(scores.shape)}")
    if label_mask is not None and tuple(label_mask.shape) != tuple(scores.shape):
        raise ValueError(f"ranking_metrics: label_mask has shape {tuple(label_mask.shape)} but scores has {tuple(scores.shape)}")
    if groups.dim() != 1 or groups.shape[0] != scores.shape[0]:
        raise ValueError(f"ranking_metrics: groups must be (N,) = ({scores.shape[0]},), one id per row, got shape {tuple(groups.shape)}")
    if len(task_names) != scores.shape[1]:
        raise ValueError(f"ranking_metrics: {len(task_names)} task names for {scores.shape[1]} score columns; give one name per column")
    out = {}
    for k, task in enumerate(task_names):
        mask = label_mask[:, k] if label_mask is not None else None
        out[f"{task}/auc"] = auc(scores[:, k], labels[:, k], mask)  # validates the column
        out[f"{task}/gauc"], out[f"{task}/gauc_users"] = gauc(scores[:, k], labels[:, k], groups, mask)
        logits, targets = scores[:, k], labels[:, k]
        if mask is not None:
            logits, targets = logits[mask], targets[mask]
        if logits.numel() == 0:
            out[f"{task}/logloss"] = float("nan")
        else:
            out[f"{task}/logloss"] = torch.nn.functional.binary_cross_entropy_with_logits(logits.double(), targets.double()).item()
    return out
