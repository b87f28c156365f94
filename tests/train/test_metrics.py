"""Tests for target ranks and HR/NDCG/MRR."""

from __future__ import annotations

import math

import pytest
import torch

from recforge.train.metrics import retrieval_metrics, target_ranks


def _no_seen(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(0, dtype=torch.int64), torch.zeros(batch + 1, dtype=torch.int64)


# --------------------------------------------------------------------------- retrieval_metrics


def test_metrics_hand_computed() -> None:
    ranks = torch.tensor([0, 3, 12])
    m = retrieval_metrics(ranks, [1, 5, 10, 20])
    assert m["hr@1"] == pytest.approx(1 / 3, abs=1e-12)
    assert m["hr@5"] == pytest.approx(2 / 3, abs=1e-12)
    assert m["hr@10"] == pytest.approx(2 / 3, abs=1e-12)
    assert m["hr@20"] == pytest.approx(1.0, abs=1e-12)
    assert m["ndcg@1"] == pytest.approx(1 / 3, abs=1e-12)
    assert m["ndcg@5"] == pytest.approx((1 + 1 / math.log2(5)) / 3, abs=1e-12)
    assert m["ndcg@10"] == pytest.approx((1 + 1 / math.log2(5)) / 3, abs=1e-12)
    assert m["ndcg@20"] == pytest.approx((1 + 1 / math.log2(5) + 1 / math.log2(14)) / 3, abs=1e-12)
    assert m["mrr"] == pytest.approx((1 + 1 / 4 + 1 / 13) / 3, abs=1e-12)
    assert set(m) == {"hr@1", "hr@5", "hr@10", "hr@20", "ndcg@1", "ndcg@5", "ndcg@10", "ndcg@20", "mrr"}


def test_metrics_boundary_rank_equal_to_k_is_a_miss() -> None:
    m = retrieval_metrics(torch.tensor([10, 9]), [10])
    assert m["hr@10"] == pytest.approx(0.5, abs=1e-12)
    assert m["ndcg@10"] == pytest.approx(0.5 / math.log2(11), abs=1e-12)
    assert m["mrr"] == pytest.approx((1 / 11 + 1 / 10) / 2, abs=1e-12)


def test_metrics_random_ranks_against_python() -> None:
    ranks = torch.randint(0, 300, (257,))
    ks = [1, 10, 50, 200]
    m = retrieval_metrics(ranks, ks)
    r = ranks.tolist()
    for k in ks:
        assert m[f"hr@{k}"] == pytest.approx(sum(x < k for x in r) / len(r), abs=1e-12)
        assert m[f"ndcg@{k}"] == pytest.approx(sum(1 / math.log2(x + 2) for x in r if x < k) / len(r), abs=1e-12)
    assert m["mrr"] == pytest.approx(sum(1 / (x + 1) for x in r) / len(r), abs=1e-12)
    assert all(isinstance(v, float) for v in m.values())


# --------------------------------------------------------------------------- target_ranks


def test_ranks_hand_computed() -> None:
    #                      pad   1    2    3    4    5
    scores = torch.tensor([[9.0, 0.5, 0.9, 0.1, 0.7, 0.3],
                           [9.0, 0.5, 0.9, 0.1, 0.7, 0.3],
                           [9.0, 0.5, 0.9, 0.1, 0.7, 0.3]])  # fmt: skip
    targets = torch.tensor([2, 1, 3])
    ranks = target_ranks(scores, targets, *_no_seen(3))
    # item 2 is the best; item 1 is beaten by 2 and 4; item 3 is beaten by everything else
    assert ranks.tolist() == [0, 2, 4]
    assert ranks.dtype == torch.int64
    assert torch.equal(target_ranks(scores, targets), ranks)  # no seen items given


def test_seen_items_are_excluded() -> None:
    scores = torch.tensor([[0.0, 0.5, 0.9, 0.1, 0.7, 0.3],
                           [0.0, 0.5, 0.9, 0.1, 0.7, 0.3]])  # fmt: skip
    targets = torch.tensor([1, 3])
    seen_index = torch.tensor([2, 4, 2, 1])  # row 0 saw 2 and 4; row 1 saw 2 and 1
    seen_offsets = torch.tensor([0, 2, 4])
    ranks = target_ranks(scores, targets, seen_index, seen_offsets)
    assert ranks.tolist() == [0, 2]  # row 1: only items 4 and 5 remain above item 3


def test_target_is_never_excluded_even_if_seen() -> None:
    scores = torch.tensor([[0.0, 0.5, 0.9, 0.1, 0.7, 0.3]])
    targets = torch.tensor([4])
    ranks = target_ranks(scores, targets, torch.tensor([4, 2]), torch.tensor([0, 2]))
    assert ranks.tolist() == [0]  # 2 is seen, 4 (target, also seen) still ranked; nothing else beats it


def test_ties_count_against_the_target() -> None:
    num_items = 7
    scores = torch.full((3, num_items + 1), 0.25)
    targets = torch.tensor([1, 4, 7])
    ranks = target_ranks(scores, targets)
    assert ranks.tolist() == [num_items - 1] * 3  # a constant scorer ranks last
    seen_index, seen_offsets = torch.tensor([2, 3]), torch.tensor([0, 2, 2, 2])
    assert target_ranks(scores, targets, seen_index, seen_offsets).tolist() == [num_items - 3, num_items - 1, num_items - 1]
    # one tie only
    scores = torch.tensor([[0.0, 1.0, 2.0, 2.0, 0.5]])
    assert target_ranks(scores, torch.tensor([2])).tolist() == [1]
    assert target_ranks(scores, torch.tensor([3])).tolist() == [1]


def test_padding_column_never_ranked() -> None:
    scores = torch.tensor([[100.0, 0.1, 0.2, 0.3], [float("inf"), 0.3, 0.2, 0.1]])
    ranks = target_ranks(scores, torch.tensor([3, 1]))
    assert ranks.tolist() == [0, 0]
    original = scores.clone()
    target_ranks(scores, torch.tensor([3, 1]), torch.tensor([2]), torch.tensor([0, 1, 1]))
    assert torch.equal(scores, original)  # the input is not modified


def test_ranks_random_against_python() -> None:
    batch, num_items = 16, 40
    scores = torch.randint(0, 10, (batch, num_items + 1)).float()  # many ties
    targets = torch.randint(1, num_items + 1, (batch,))
    seen_lengths = torch.randint(0, 12, (batch,))
    seen_offsets = torch.zeros(batch + 1, dtype=torch.int64)
    seen_offsets[1:] = torch.cumsum(seen_lengths, 0)
    seen_index = torch.randint(1, num_items + 1, (int(seen_offsets[-1]),))  # may include the target, repeats
    ranks = target_ranks(scores, targets, seen_index, seen_offsets)
    for b in range(batch):
        seen = set(seen_index[seen_offsets[b] : seen_offsets[b + 1]].tolist())
        t = int(targets[b])
        expected = sum(
            1 for i in range(1, num_items + 1) if i != t and i not in seen and scores[b, i] >= scores[b, t]
        )
        assert int(ranks[b]) == expected, b
