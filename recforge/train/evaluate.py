"""Full-catalogue leave-one-out evaluation of retrieval models and baselines."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from recforge.data.sequences import EvalBatch, UserSequences
from recforge.models.retrieval import RetrievalModel
from recforge.train.distributed import DistContext, even_batches
from recforge.train.metrics import retrieval_metrics, target_ranks

ScoreFn = Callable[[EvalBatch], Tensor]  # EvalBatch -> (B, N+1) scores


def evaluate_ranking(
    seqs: UserSequences,
    score_fn: ScoreFn,
    *,
    target_from_end: int,
    max_seq_len: int,
    ks: list[int],
    batch_size: int,
    device: torch.device | str = "cpu",
    ctx: DistContext | None = None,
) -> tuple[dict[str, float], Tensor]:
    """Rank every evaluable user's held-out item over all items, seen items excluded.

    Args:
        seqs: the users' sequences.
        score_fn: scores the catalogue for a batch of users.
        target_from_end: 1 ranks each user's last item (test), 2 the one before (validation).
        max_seq_len: history items given to the model.
        ks: cut-offs for HR/NDCG.
        batch_size: users per batch.
        ctx: several ranks: each ranks its contiguous share of the users, and the ranks are
            gathered in user order, so the metrics equal a single process's.

    Returns:
        (metrics, ranks): metrics dict (plus ``num_users``) and each user's 0-based rank.
    """
    everyone = seqs.evaluable_users(target_from_end)
    ctx = ctx or DistContext()
    lo, hi = ctx.shard(everyone.numel())
    users = everyone[lo:hi]
    ranks = []
    with torch.no_grad():
        for start in range(0, even_batches(everyone.numel(), batch_size, ctx) * batch_size, batch_size):
            chunk = users[start : start + batch_size]
            stand_in = chunk.numel() == 0  # this rank is done: score a stand-in so sharded tables' collectives match
            batch = seqs.eval_batch(everyone[:1] if stand_in else chunk, max_seq_len, target_from_end).to(device)
            scores = score_fn(batch)
            if not stand_in:
                ranks.append(target_ranks(scores, batch.targets, batch.seen_index, batch.seen_offsets).cpu())
    all_ranks = ctx.gather_rows(torch.cat(ranks) if ranks else torch.zeros(0, dtype=torch.int64))
    metrics = retrieval_metrics(all_ranks, ks)
    metrics["num_users"] = int(all_ranks.numel())
    return metrics, all_ranks


def model_scorer(model: RetrievalModel) -> ScoreFn:
    """Score function of a retrieval model: cosine of the last-token user vector with every item."""

    def score(batch: EvalBatch) -> Tensor:
        was_training = model.training
        model.eval()
        items = model.item_vectors()  # (N+1, d)
        out = model.last_token_vectors(batch.inputs) @ items.T  # (B, N+1)
        model.train(was_training)
        return out.float()

    return score


def popularity_scorer(item_counts: Tensor) -> ScoreFn:
    """Score function of the most-popular baseline: every user gets the training counts.

    Equal counts are ordered by item index (a fraction below 1 is added), so ties do not
    all count against the target.
    """
    counts = item_counts.double() + torch.arange(item_counts.numel(), 0, -1, dtype=torch.float64) / (item_counts.numel() + 1)

    def score(batch: EvalBatch) -> Tensor:
        return counts.to(batch.targets.device).expand(batch.targets.numel(), -1)

    return score
