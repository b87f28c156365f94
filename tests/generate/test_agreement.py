"""generate.agreement: answers that differ only by near-ties agree; other differences do not."""

from __future__ import annotations

import random

import pytest

from recforge.generate.agreement import compare, same_up_to_ties
from recforge.generate.requests import RetrieveResult


def _result(rng: random.Random, k: int = 20) -> RetrieveResult:
    scores = sorted((rng.uniform(-30, -5) for _ in range(k)), reverse=True)
    return RetrieveResult(rng.sample(range(1, 10_000), k), scores)


def test_swapped_near_tie_and_a_tie_at_the_cut_agree() -> None:
    rng = random.Random(random.randrange(1 << 30))
    a = _result(rng)
    i = rng.randrange(len(a.items) - 2)
    a.scores[i + 1] = a.scores[i] - 5e-7  # a near-tie: rounding may order the two items either way
    b = RetrieveResult(list(a.items), [s + rng.uniform(-1e-6, 1e-6) for s in a.scores])
    b.items[i], b.items[i + 1] = b.items[i + 1], b.items[i]
    b.items[-1] = 99_999  # another item tied with the last one
    assert b.items != a.items and same_up_to_ties(a, b, atol=1e-4) and same_up_to_ties(b, a, atol=1e-4)
    report = compare([a, a], [b, a], atol=1e-4)
    assert report["same_items"] == 0.5 and report["same_up_to_ties"] == 1.0
    assert report["overlap"] == pytest.approx((1 - 1 / 20 + 1) / 2) and report["max_score_diff"] < 1e-4


def test_moved_scores_and_missing_strong_items_do_not_agree() -> None:
    rng = random.Random(random.randrange(1 << 30))
    a = _result(rng)
    moved = RetrieveResult(list(a.items), [s - 0.01 for s in a.scores])  # e.g. another history's encoding
    assert not same_up_to_ties(a, moved, atol=1e-4)
    assert compare([a], [moved], atol=1e-4)["max_score_diff"] == pytest.approx(0.01)
    lost = RetrieveResult([99_999, *a.items[1:]], list(a.scores))  # the best item replaced, not a tie
    assert not same_up_to_ties(a, lost, atol=1e-4)
    with pytest.raises(ValueError, match="same requests"):
        compare([a], [], atol=1e-4)
