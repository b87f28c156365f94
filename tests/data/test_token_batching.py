"""Token-budget batch cuts and the loss scale that keeps fixed-batch gradient semantics."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from recforge.data.token_batching import (
    token_budget_cuts,
    token_loss_scale,
)


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


def test_token_loss_scale_gives_every_token_the_same_weight():
    # two batches of different sizes: the summed gradient equals one big batch's mean over all tokens
    torch.manual_seed(0)
    w = torch.randn(4, requires_grad=True)
    x = torch.randn(30, 4)
    small, large = x[:10], x[10:]
    for part in (small, large):
        (((part @ w) ** 2).sum() * token_loss_scale(reference_tokens=30)).backward()
    grad_parts = w.grad.clone()
    w.grad = None
    ((x @ w) ** 2).mean().backward()
    torch.testing.assert_close(grad_parts, w.grad, rtol=1e-5, atol=1e-6)


def test_scale_accounts_for_ddp_averaging():
    assert token_loss_scale(400, world_size=4) == pytest.approx(4 / 400)
    with pytest.raises(ValueError, match="reference_tokens"):
        token_loss_scale(0)
