"""Evaluation batches kept between evaluations give the metrics of batches built each time."""

import numpy as np
import torch

from recforge.data.sequences import UserSequences
from recforge.train.evaluate import evaluate_ranking


def _seqs(num_users: int, num_items: int, generator: torch.Generator) -> UserSequences:
    lengths = torch.randint(2, 30, (num_users,), generator=generator)
    offsets = torch.zeros(num_users + 1, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    items = torch.randint(1, num_items + 1, (int(offsets[-1]),), generator=generator)
    vocab = np.r_[-1, np.arange(num_items) + 500].astype(np.int64)
    return UserSequences(items, None, offsets, np.arange(num_users), vocab)


def test_cached_batches_give_the_same_ranks_as_fresh_ones():
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    num_items = 40
    seqs = _seqs(53, num_items, g)
    table = torch.randn(num_items + 1, 8, generator=g)

    def score(batch):  # a deterministic function of the history: the mean of its items' vectors
        inputs = batch.inputs
        owner = torch.repeat_interleave(torch.arange(inputs.batch_size), inputs.seq_offsets.diff())
        users = torch.zeros(inputs.batch_size, 8).index_add_(0, owner, table[inputs.item_ids])
        return users @ table.T

    kwargs = dict(target_from_end=1, max_seq_len=7, ks=[1, 5, 10], batch_size=16)
    fresh, fresh_ranks = evaluate_ranking(seqs, score, **kwargs)
    cache: dict = {}
    first, first_ranks = evaluate_ranking(seqs, score, **kwargs, cache=cache)
    assert len(cache) == 1
    second, second_ranks = evaluate_ranking(seqs, score, **kwargs, cache=cache)
    assert torch.equal(fresh_ranks, first_ranks) and torch.equal(fresh_ranks, second_ranks)
    assert fresh == first == second
    valid, _ = evaluate_ranking(seqs, score, **{**kwargs, "target_from_end": 2}, cache=cache)
    assert len(cache) == 2 and valid == evaluate_ranking(seqs, score, **{**kwargs, "target_from_end": 2})[0]


def test_the_token_bound_counts_every_cached_split(monkeypatch):
    import recforge.train.evaluate as evaluate

    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    seqs = _seqs(31, 20, g)
    table = torch.randn(21, 4, generator=g)

    def score(batch):
        return torch.zeros(batch.inputs.batch_size, 4) @ table.T

    kwargs = dict(max_seq_len=5, ks=[1], batch_size=8)
    test_tokens = int(seqs.lengths[seqs.evaluable_users(1)].sum())
    monkeypatch.setattr(evaluate, "_CACHE_MAX_TOKENS", test_tokens + 1)  # room for one split, not two
    cache: dict = {}
    evaluate_ranking(seqs, score, target_from_end=1, **kwargs, cache=cache)
    evaluate_ranking(seqs, score, target_from_end=2, **kwargs, cache=cache)
    assert len(cache) == 1  # the validation split's batches are built each time instead
