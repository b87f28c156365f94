"""Token-budget batch cuts (the loss scale that keeps fixed-batch semantics: tests/train/test_losses.py)."""

from __future__ import annotations

import numpy as np
import pytest

from recforge.data.token_batching import token_budget_cuts


def test_cuts_respect_the_budget_and_cover_every_row():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 50, 1000)
    cuts = token_budget_cuts(lengths, 400)
    assert cuts[0] == 0 and cuts[-1] == 1000 and (np.diff(cuts) > 0).all()
    sums = np.add.reduceat(lengths, cuts[:-1])
    assert sums.max() <= 400
    assert (sums[:-1] + lengths[cuts[1:-1]] > 400).all()  # greedy: the next row would not have fit


def test_long_rows_get_their_own_batch_and_max_rows_caps():
    assert token_budget_cuts(np.array([5, 100, 5, 5]), 10).tolist() == [0, 1, 2, 4]
    assert token_budget_cuts(np.array([1] * 10), 100, max_rows=4).tolist() == [0, 4, 8, 10]
    with pytest.raises(ValueError, match="budget"):
        token_budget_cuts(np.array([1]), 0)
