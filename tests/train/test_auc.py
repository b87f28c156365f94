"""Tests for AUC, GAUC and ranking_metrics against scikit-learn on random data."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from sklearn.metrics import log_loss, roc_auc_score

from recforge.train.metrics import auc, gauc, ranking_metrics

ATOL = 1e-10  # ours is an exact integer ratio; sklearn's trapezoid sum differs by rounding only


def _random_rows(seed: int, n: int, num_groups: int, decimals: int | None, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scores (rounded to ``decimals`` for heavy ties), 0/1 float labels, group ids with skewed sizes,
    plus 30 single-row groups and one 20-row group of positives only."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(n, generator=g, dtype=torch.float64)
    if decimals is not None:
        scores = torch.round(scores, decimals=decimals)
    labels = (torch.rand(n, generator=g) < 0.3).float()
    groups = (torch.rand(n, generator=g) ** 3 * num_groups).long()  # a few big groups, many small
    groups[-30:] = num_groups + torch.arange(30)
    groups[:20], labels[:20] = num_groups + 100, 1.0
    return scores.to(dtype), labels, groups


def _sklearn_gauc(scores: np.ndarray, labels: np.ndarray, groups: np.ndarray) -> tuple[float, int]:
    total, weight, used = 0.0, 0, 0
    for group in np.unique(groups):
        rows = groups == group
        if len(np.unique(labels[rows])) < 2:
            continue
        total += rows.sum() * roc_auc_score(labels[rows], scores[rows])
        weight += rows.sum()
        used += 1
    return (total / weight if used else math.nan), used


# --------------------------------------------------------------------------- auc


def test_auc_hand_computed_with_ties() -> None:
    # positives 0.8 and 0.4; negatives 0.4 and 0.1: pairs 1 + 1 + 0.5 (tie) + 1 = 3.5 of 4
    scores, labels = torch.tensor([0.8, 0.4, 0.4, 0.1]), torch.tensor([1, 1, 0, 0])
    assert auc(scores, labels) == pytest.approx(3.5 / 4, abs=1e-15)
    assert auc(torch.full((6,), 2.0), torch.tensor([0, 1, 0, 1, 1, 0])) == pytest.approx(0.5, abs=1e-15)
    assert auc(-scores, labels) == pytest.approx(0.5 / 4, abs=1e-15)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("decimals", [None, 1, 0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_auc_matches_sklearn(seed: int, decimals: int | None, dtype: torch.dtype) -> None:
    scores, labels, _ = _random_rows(seed, 3000, 50, decimals, dtype)
    expected = roc_auc_score(labels.numpy(), scores.double().numpy())
    assert auc(scores, labels) == pytest.approx(expected, abs=ATOL)
    assert auc(scores, labels.bool()) == pytest.approx(expected, abs=ATOL)
    assert auc(scores, labels.long()) == pytest.approx(expected, abs=ATOL)


def test_auc_negative_zero_ties_with_zero_and_infinities_rank() -> None:
    scores = torch.tensor([-0.0, 0.0, float("-inf"), float("inf"), -1e-30, 1e-30], dtype=torch.float64)
    labels = torch.tensor([1, 0, 0, 1, 0, 1])
    # sorted: -inf(0) -1e-30(0) {-0.0(1) 0.0(0)} 1e-30(1) inf(1); sklearn rejects infinities
    expected = (2.5 + 3 + 3) / 9
    for dtype in (torch.float64, torch.float32):
        assert auc(scores.to(dtype), labels) == pytest.approx(expected, abs=ATOL)


def test_auc_mask_selects_rows() -> None:
    scores, labels, _ = _random_rows(3, 1000, 10, 1)
    mask = torch.rand(1000, generator=torch.Generator().manual_seed(4)) < 0.6
    labels_with_missing = torch.where(mask, labels, torch.full_like(labels, float("nan")))
    expected = roc_auc_score(labels[mask].numpy(), scores[mask].numpy())
    assert auc(scores, labels_with_missing, mask) == pytest.approx(expected, abs=ATOL)


def test_auc_nan_for_one_class_or_no_rows() -> None:
    scores = torch.tensor([0.3, 0.1, 0.2])
    assert math.isnan(auc(scores, torch.ones(3)))
    assert math.isnan(auc(scores, torch.zeros(3)))
    assert math.isnan(auc(scores, torch.tensor([1.0, 0.0, 1.0]), torch.zeros(3, dtype=torch.bool)))
    assert math.isnan(auc(torch.zeros(0), torch.zeros(0)))
    assert math.isnan(auc(scores, torch.tensor([1.0, 0.0, 1.0]), torch.tensor([True, False, True])))


# --------------------------------------------------------------------------- gauc


def test_gauc_hand_computed() -> None:
    scores = torch.tensor([0.1, 0.9, 0.2, 0.3, 0.5, 0.4, 0.7])
    labels = torch.tensor([0, 1, 1, 0, 1, 1, 1])
    groups = torch.tensor([7, 7, 3, 3, 3, 5, 9])  # 5: one row; 9: one row
    value, used = gauc(scores, labels, groups)
    assert used == 2
    assert value == pytest.approx((2 * 1.0 + 3 * 0.5) / 5, abs=1e-15)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("decimals", [None, 1, 0])
def test_gauc_matches_sklearn_loop(seed: int, decimals: int | None) -> None:
    scores, labels, groups = _random_rows(seed, 3000, 80, decimals)
    expected, expected_used = _sklearn_gauc(scores.numpy(), labels.numpy(), groups.numpy())
    assert 0 < expected_used < len(groups.unique())  # some groups have one class or one row
    value, used = gauc(scores, labels, groups)
    assert used == expected_used
    assert value == pytest.approx(expected, abs=ATOL)


@pytest.mark.parametrize("seed", [0, 1])
def test_gauc_two_sort_path_matches_packed_path(seed: int) -> None:
    """float64 scores and ids outside [0, 2**31) take the two-stable-sort path."""
    scores, labels, groups = _random_rows(seed, 3000, 80, 1)
    expected, expected_used = _sklearn_gauc(scores.numpy(), labels.numpy(), groups.numpy())
    packed = gauc(scores, labels, groups)
    by_float64 = gauc(scores.double(), labels, groups)
    by_big_ids = gauc(scores, labels, groups * 2**40 - 2**50)
    for value, used in (packed, by_float64, by_big_ids):
        assert used == expected_used
        assert value == pytest.approx(expected, abs=ATOL)


def test_gauc_mask_and_edge_cases() -> None:
    scores, labels, groups = _random_rows(5, 2000, 80, 0)
    mask = torch.rand(2000, generator=torch.Generator().manual_seed(6)) < 0.5
    expected, expected_used = _sklearn_gauc(scores[mask].numpy(), labels[mask].numpy(), groups[mask].numpy())
    value, used = gauc(scores, torch.where(mask, labels, 7.0), groups, mask)  # masked labels are ignored
    assert used == expected_used
    assert value == pytest.approx(expected, abs=ATOL)
    empty = gauc(scores, labels, groups, torch.zeros(2000, dtype=torch.bool))
    assert math.isnan(empty[0]) and empty[1] == 0
    single_rows = gauc(scores[:50], labels[:50], torch.arange(50))
    assert math.isnan(single_rows[0]) and single_rows[1] == 0


# --------------------------------------------------------------------------- ranking_metrics


def test_ranking_metrics_against_sklearn() -> None:
    g = torch.Generator().manual_seed(8)
    n = 2000
    logits = torch.randn(n, 2, generator=g)
    labels = (torch.rand(n, 2, generator=g) < torch.sigmoid(logits)).float()
    groups = torch.randint(0, 60, (n,), generator=g)
    label_mask = torch.ones(n, 2, dtype=torch.bool)
    label_mask[:, 1] = torch.rand(n, generator=g) < 0.4
    m = ranking_metrics(logits, labels, groups, ["click", "like"], label_mask)
    assert set(m) == {f"{t}/{k}" for t in ("click", "like") for k in ("auc", "gauc", "gauc_users", "logloss")}
    for k, task in enumerate(["click", "like"]):
        rows = label_mask[:, k]
        s, y, u = logits[rows, k].numpy(), labels[rows, k].numpy(), groups[rows].numpy()
        assert m[f"{task}/auc"] == pytest.approx(roc_auc_score(y, s), abs=ATOL)
        expected, used = _sklearn_gauc(s, y, u)
        assert m[f"{task}/gauc"] == pytest.approx(expected, abs=ATOL)
        assert m[f"{task}/gauc_users"] == used
        probs = torch.sigmoid(torch.from_numpy(s).double()).numpy()
        assert m[f"{task}/logloss"] == pytest.approx(log_loss(y, probs), abs=1e-9)


# --------------------------------------------------------------------------- errors


def test_errors_say_what_is_wrong() -> None:
    scores, labels = torch.tensor([0.1, 0.2, 0.3]), torch.tensor([0.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="labels has shape"):
        auc(scores, labels[:2])
    with pytest.raises(ValueError, match="must be 1-D"):
        auc(scores[None], labels[None])
    with pytest.raises(ValueError, match="binary.*2.0"):
        auc(scores, torch.tensor([0.0, 2.0, 1.0]))
    with pytest.raises(ValueError, match="binary.*mask="):
        auc(scores, torch.tensor([0.0, float("nan"), 1.0]))
    with pytest.raises(ValueError, match="1 NaN"):
        auc(torch.tensor([0.1, float("nan"), 0.3]), labels)
    auc(torch.tensor([0.1, float("nan"), 0.3]), labels, torch.tensor([True, False, True]))  # masked out: fine
    with pytest.raises(ValueError, match="mask must be a bool"):
        auc(scores, labels, torch.ones(3))
    with pytest.raises(ValueError, match="groups has shape"):
        gauc(scores, labels, torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="integer ids"):
        gauc(scores, labels, torch.tensor([1.0, 2.0, 3.0]))
    with pytest.raises(ValueError, match=r"\(N, K\)"):
        ranking_metrics(scores, labels, torch.arange(3), ["click"])
    with pytest.raises(ValueError, match="1 task names for 2"):
        ranking_metrics(torch.zeros(3, 2), torch.zeros(3, 2), torch.arange(3), ["click"])
    with pytest.raises(ValueError, match="groups must be"):
        ranking_metrics(torch.zeros(3, 1), torch.zeros(3, 1), torch.arange(4), ["click"])
    with pytest.raises(ValueError, match="label_mask has shape"):
        ranking_metrics(torch.zeros(3, 1), torch.zeros(3, 1), torch.arange(3), ["click"], torch.ones(3, 2, dtype=torch.bool))


def test_inputs_are_not_modified() -> None:
    scores, labels, groups = _random_rows(9, 500, 20, 1)
    labels = labels.long()
    for s, u in ((scores, groups), (scores.double(), groups + 2**40)):
        copies = (s.clone(), labels.clone(), u.clone())
        gauc(s, labels, u)
        auc(s, labels)
        assert all(torch.equal(a, b) for a, b in zip(copies, (s, labels, u)))
