"""Full-catalogue leave-one-out evaluation of retrieval models and baselines."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from recforge.data.sequences import EvalBatch, UserSequences
from recforge.models.retrieval import RetrievalModel
from recforge.train.distributed import DistContext, even_batches
from recforge.train.metrics import retrieval_metrics, target_ranks

_CACHE_MAX_TOKENS = 1 << 24  # history tokens up to which evaluation batches are kept on the device between evaluations
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
    cache: dict | None = None,
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
        cache: a dict the caller keeps between evaluations of the same ``seqs`` (e.g. every few
            epochs of a run): the evaluation batches are built and moved to ``device`` once, the
            first time, while all cached splits' histories hold at most ``_CACHE_MAX_TOKENS`` tokens together.

    Returns:
        (metrics, ranks): metrics dict (plus ``num_users``) and each user's 0-based rank.
    """
    everyone = seqs.evaluable_users(target_from_end)
    ctx = ctx or DistContext()
    lo, hi = ctx.shard(everyone.numel())
    key = (target_from_end, max_seq_len, batch_size, str(device), lo, hi)
    cached = cache.get(key) if cache is not None else None  # (batches, their history tokens)
    batches = cached[0] if cached is not None else None
    if batches is None:
        batches = _eval_batches(seqs, everyone, lo, hi, target_from_end, max_seq_len, batch_size, device, ctx)
        tokens = int(seqs.lengths[everyone].sum())
        held = sum(t for _, t in cache.values()) if cache is not None else 0  # the other cached splits'
        if cache is not None and held + tokens <= _CACHE_MAX_TOKENS:  # the bound counts every cached split
            batches = list(batches)
            cache[key] = (batches, tokens)
    ranks = []
    with torch.no_grad():
        for batch, stand_in in batches:
            scores = score_fn(batch)
            if not stand_in:  # ranks stay on the device: one host copy at the end, no sync per batch
                ranks.append(target_ranks(scores, batch.targets, batch.seen_index, batch.seen_offsets))
    all_ranks = ctx.gather_rows(torch.cat(ranks).cpu() if ranks else torch.zeros(0, dtype=torch.int64))
    metrics = retrieval_metrics(all_ranks, ks)
    metrics["num_users"] = int(all_ranks.numel())
    return metrics, all_ranks


def _eval_batches(seqs: UserSequences, everyone: Tensor, lo: int, hi: int, target_from_end: int, max_seq_len: int,
                  batch_size: int, device: torch.device | str, ctx: DistContext) -> Iterator[tuple[EvalBatch, bool]]:
    """This rank's evaluation batches on ``device``, each with whether it is a stand-in (a rank out of users
    scores one so that sharded tables' collectives match; its ranks are not counted)."""
    users = everyone[lo:hi]
    for start in range(0, even_batches(everyone.numel(), batch_size, ctx) * batch_size, batch_size):
        chunk = users[start : start + batch_size]
        stand_in = chunk.numel() == 0
        yield seqs.eval_batch(everyone[:1] if stand_in else chunk, max_seq_len, target_from_end).to(device), stand_in


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
