"""Tests for the sampled-softmax retrieval loss against hand computations."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from recforge.train.losses import sampled_softmax_loss

TOL = {"rtol": 1e-5, "atol": 1e-5}


def _setup(num_positions: int = 9, num_items: int = 30, dim: int = 8):
    user = F.normalize(torch.randn(num_positions, dim, dtype=torch.float64), dim=-1)
    table = F.normalize(torch.randn(num_items + 1, dim, dtype=torch.float64), dim=-1)
    targets = torch.randint(1, num_items + 1, (num_positions,))

    def item_vectors(ids: torch.Tensor | None) -> torch.Tensor:
        return table if ids is None else table[ids]

    return user, targets, table, item_vectors


def _hand_loss(user: torch.Tensor, targets: torch.Tensor, table: torch.Tensor, negatives_per_row: list[list[int]], temperature: float) -> torch.Tensor:
    """Mean over rows of -log(exp(pos) / (exp(pos) + sum over negatives != target of exp(neg)))."""
    losses = []
    for t in range(user.shape[0]):
        target = int(targets[t])
        pos = float(user[t] @ table[target]) / temperature
        logits = [pos] + [float(user[t] @ table[n]) / temperature for n in negatives_per_row[t] if n != target]
        top = max(logits)
        lse = top + math.log(sum(math.exp(v - top) for v in logits))
        losses.append(lse - pos)
    return torch.tensor(sum(losses) / len(losses), dtype=torch.float64)


@pytest.mark.parametrize("temperature", [0.05, 1.0])
def test_full_softmax_equals_cross_entropy_without_padding(temperature: float) -> None:
    user, targets, table, item_vectors = _setup()
    loss = sampled_softmax_loss(user, targets, item_vectors, table.shape[0] - 1, negatives="full", temperature=temperature)
    logits = user @ table[1:].T / temperature  # items 1..N, padding excluded
    expected = F.cross_entropy(logits, targets - 1)
    torch.testing.assert_close(loss, expected, **TOL)
    negs = [list(range(1, table.shape[0]))] * user.shape[0]
    torch.testing.assert_close(loss, _hand_loss(user, targets, table, negs, temperature), **TOL)


def test_full_softmax_ignores_padding_row() -> None:
    user, targets, table, _ = _setup()
    changed = table.clone()
    changed[0] = user[0]  # a padding row that would score highest if it were included
    a = sampled_softmax_loss(user, targets, lambda ids: table if ids is None else table[ids], table.shape[0] - 1, negatives="full")
    b = sampled_softmax_loss(user, targets, lambda ids: changed if ids is None else changed[ids], table.shape[0] - 1, negatives="full")
    torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize("in_batch", [False, True])
def test_per_position_matches_hand_computation(in_batch: bool) -> None:
    num_items, k, temperature = 12, 20, 0.1  # few items, many negatives: accidental hits are certain
    user, targets, table, item_vectors = _setup(num_positions=10, num_items=num_items)
    seed = int(torch.randint(0, 2**31, ()).item())
    torch.manual_seed(seed)
    loss = sampled_softmax_loss(
        user, targets, item_vectors, num_items, negatives="per_position", num_negatives=k,
        in_batch_negatives=in_batch, temperature=temperature,
    )  # fmt: skip
    torch.manual_seed(seed)
    neg_ids = torch.randint(1, num_items + 1, (user.shape[0], k))
    assert (neg_ids == targets[:, None]).any(), "the test needs at least one accidental hit"
    negs = [row.tolist() for row in neg_ids]
    if in_batch:
        batch_ids = torch.unique(targets).tolist()
        negs = [row + batch_ids for row in negs]
    torch.testing.assert_close(loss, _hand_loss(user, targets, table, negs, temperature), **TOL)


@pytest.mark.parametrize("in_batch", [False, True])
def test_shared_matches_hand_computation(in_batch: bool) -> None:
    num_items, k, temperature = 10, 15, 0.05
    user, targets, table, item_vectors = _setup(num_positions=8, num_items=num_items)
    seed = int(torch.randint(0, 2**31, ()).item())
    torch.manual_seed(seed)
    loss = sampled_softmax_loss(
        user, targets, item_vectors, num_items, negatives="shared", num_negatives=k,
        in_batch_negatives=in_batch, temperature=temperature,
    )  # fmt: skip
    torch.manual_seed(seed)
    shared = torch.randint(1, num_items + 1, (k,)).tolist()
    assert set(shared) & set(targets.tolist()), "the test needs at least one accidental hit"
    extra = torch.unique(targets).tolist() if in_batch else []
    negs = [shared + extra for _ in range(user.shape[0])]
    torch.testing.assert_close(loss, _hand_loss(user, targets, table, negs, temperature), **TOL)


@pytest.mark.parametrize("negatives", ["per_position", "shared"])
@pytest.mark.parametrize("in_batch", [False, True])
def test_accidental_hits_contribute_nothing(negatives: str, in_batch: bool) -> None:
    # A catalogue of one item: every negative (sampled or in-batch) is the target itself.
    user, _, table, item_vectors = _setup(num_positions=5, num_items=1)
    targets = torch.ones(5, dtype=torch.int64)
    loss = sampled_softmax_loss(
        user, targets, item_vectors, 1, negatives=negatives, num_negatives=16, in_batch_negatives=in_batch
    )
    assert loss.item() == pytest.approx(0.0, abs=1e-12)


def test_in_batch_negatives_add_other_targets() -> None:
    """With sampled negatives that are all accidental hits, only the in-batch ones remain."""
    num_items, temperature = 6, 0.2
    user, _, table, item_vectors = _setup(num_positions=4, num_items=num_items)
    targets = torch.tensor([2, 5, 2, 6])
    # shared negatives drawn from a one-item catalogue are all item 1; use targets != 1 and
    # compare to a hand loss whose negatives are item 1 plus the other distinct targets
    loss = sampled_softmax_loss(
        user, targets, item_vectors, 1, negatives="shared", num_negatives=3, in_batch_negatives=True, temperature=temperature
    )
    negs = [[1, 1, 1] + [i for i in (2, 5, 6) if i != int(t)] for t in targets]
    torch.testing.assert_close(loss, _hand_loss(user, targets, table, negs, temperature), **TOL)
    without = sampled_softmax_loss(user, targets, item_vectors, 1, negatives="shared", num_negatives=3, temperature=temperature)
    assert loss.item() > without.item()  # more negatives, larger loss


def test_unknown_negatives_mode() -> None:
    user, targets, _, item_vectors = _setup()
    with pytest.raises(ValueError, match="negatives='bogus'"):
        sampled_softmax_loss(user, targets, item_vectors, 30, negatives="bogus")


def test_gradients_flow_to_users_and_items() -> None:
    user, targets, table, _ = _setup()
    user = user.clone().requires_grad_(True)
    table = table.clone().requires_grad_(True)
    loss = sampled_softmax_loss(user, targets, lambda ids: table if ids is None else table[ids], 30, num_negatives=8)
    loss.backward()
    assert user.grad is not None and torch.isfinite(user.grad).all() and user.grad.abs().sum() > 0
    assert table.grad is not None and torch.isfinite(table.grad).all()


@pytest.mark.parametrize("negatives", ["full", "per_position", "shared"])
def test_loss_decreases_with_sgd(negatives: str) -> None:
    num_items, dim, positions = 20, 8, 32
    user_param = torch.nn.Parameter(torch.randn(positions, dim))
    item_param = torch.nn.Parameter(torch.randn(num_items + 1, dim))
    targets = torch.randint(1, num_items + 1, (positions,))
    opt = torch.optim.SGD([user_param, item_param], lr=0.5)

    def item_vectors(ids: torch.Tensor | None) -> torch.Tensor:
        w = F.normalize(item_param, dim=-1)
        return w if ids is None else w[ids]

    def loss_fn() -> torch.Tensor:
        return sampled_softmax_loss(
            F.normalize(user_param, dim=-1), targets, item_vectors, num_items,
            negatives=negatives, num_negatives=10, temperature=0.1,
        )  # fmt: skip

    torch.manual_seed(0)
    first = loss_fn().item()
    for _ in range(25):
        opt.zero_grad()
        loss_fn().backward()
        opt.step()
    torch.manual_seed(0)  # same negatives as the first evaluation
    last = loss_fn().item()
    assert last < 0.5 * first, (first, last)
