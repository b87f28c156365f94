"""Every training loss (``recforge.train.losses``) against independent computations."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from recforge.data.ranking_samples import TokenReference
from recforge.train.losses import (
    listwise_loss,
    pointwise_loss,
    sampled_softmax_loss,
    token_loss_scale,
    token_weighted_ranking_loss,
)

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


@pytest.mark.parametrize("negatives", ["shared", "per_position"])
@pytest.mark.parametrize(("in_batch", "one_target"), [(False, False), (True, False), (True, True)])
def test_gradients_match_the_concatenated_softmax(negatives: str, in_batch: bool, one_target: bool) -> None:
    """The blocks' logsumexps (no concatenated copy, masked columns at the lowest finite float) give the loss and
    gradients of -log_softmax(cat(...)) with -inf masks, also where a row's whole in-batch block is masked (every batch
    item its target or a padding repeat), all finite."""
    num_items, k, temperature = 12, 9, 0.1
    user, _, table, _ = _setup(num_positions=7, num_items=num_items)
    # rows whose target is 3 keep only 5 and 7 in batch; with one target, every row's in-batch block is masked whole
    targets = torch.full((7,), 3) if one_target else torch.tensor([3, 3, 3, 5, 3, 7, 3])
    seed = int(torch.randint(0, 2**31, ()).item())
    grads = []
    for path in ("recforge", "reference"):
        u, t = user.clone().requires_grad_(), table.clone().requires_grad_()
        torch.manual_seed(seed)
        if path == "recforge":
            loss = sampled_softmax_loss(u, targets, lambda ids, t=t: t if ids is None else t[ids], num_items,
                                        negatives=negatives, num_negatives=k, in_batch_negatives=in_batch,
                                        temperature=temperature)  # fmt: skip
        else:
            parts = [(u * t[targets]).sum(-1, keepdim=True) / temperature]
            if negatives == "shared":
                ids = torch.randint(1, num_items + 1, (k,))
                parts.append((u @ t[ids].T / temperature).masked_fill(ids[None, :] == targets[:, None], float("-inf")))
            else:
                ids = torch.randint(1, num_items + 1, (targets.shape[0], k))  # (T, K), drawn as the loss draws them
                own = (u[:, None, :] * t[ids]).sum(-1) / temperature
                parts.append(own.masked_fill(ids == targets[:, None], float("-inf")))
            if in_batch:
                ids = torch.unique(targets)
                parts.append((u @ t[ids].T / temperature).masked_fill(ids[None, :] == targets[:, None], float("-inf")))
            loss = -F.log_softmax(torch.cat(parts, 1), 1)[:, 0].mean()
        loss.backward()
        grads.append((loss.detach(), u.grad, t.grad))
    for got, want in zip(grads[0], grads[1], strict=True):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


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

# ------------------------------------------------------------------------------- ranking losses


def test_pointwise_loss_against_elementwise_formulas() -> None:
    """BCE with logits and MSE written out from their definitions, on fresh random inputs with NaN labels."""
    gen = torch.Generator().manual_seed(11)
    n, kinds, weights = 40, ["binary", "regression", "binary"], [0.7, 1.3, 2.0]
    z = torch.randn(n, 3, generator=gen, dtype=torch.float64) * 3
    y = torch.stack([torch.randint(0, 2, (n,), generator=gen).double(), torch.randn(n, generator=gen, dtype=torch.float64),
                     torch.rand(n, generator=gen, dtype=torch.float64)], 1)  # fmt: skip
    y[torch.rand(n, 3, generator=gen) < 0.3] = float("nan")
    total, per_task = pointwise_loss(z, y, kinds, weights)
    expected = []
    for k, kind in enumerate(kinds):
        known = ~torch.isnan(y[:, k])
        zk, yk = z[known, k], y[known, k]
        if kind == "binary":  # -y log sigmoid(z) - (1 - y) log(1 - sigmoid(z)), written stably
            elem = torch.clamp(zk, min=0) - zk * yk + torch.log1p(torch.exp(-zk.abs()))
        else:
            elem = (zk - yk) ** 2
        expected.append(elem.mean())
    torch.testing.assert_close(per_task, torch.stack(expected), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(total, sum(w * e for w, e in zip(weights, expected)), rtol=1e-12, atol=1e-12)


def test_ranking_losses_run_in_float32_under_bfloat16() -> None:
    gen = torch.Generator().manual_seed(12)
    z = torch.randn(12, 2, generator=gen).bfloat16()
    y = torch.randint(0, 2, (12, 2), generator=gen).float()
    total, _ = pointwise_loss(z, y, ["binary", "binary"], [1.0, 1.0])
    assert total.dtype == torch.float32
    torch.testing.assert_close(total, pointwise_loss(z.float(), y, ["binary", "binary"], [1.0, 1.0])[0])
    assert listwise_loss(z[:, :1], y[:, :1], torch.tensor([5, 7])).dtype == torch.float32


def test_token_weighted_ranking_loss_against_hand_weights() -> None:
    """objective = sum_k mean_k * known_k / ref_k + w * listwise * lists / ref_lists; the loss = the plain sum."""
    gen = torch.Generator().manual_seed(13)
    num_targets = torch.tensor([3, 2, 4])
    z = torch.randn(9, 2, generator=gen, dtype=torch.float64)
    y = torch.stack([torch.tensor([1, 0, 0, 0, 0, 0, 1, 1, 0.0]), torch.randn(9, generator=gen).double()], 1)
    y[4, 1] = float("nan")
    ref = TokenReference(torch.tensor([6.0, 4.0], dtype=torch.float64), 1.5)
    objective, loss = token_weighted_ranking_loss(z, y, num_targets, ["binary", "regression"], [1.0, 0.5], ref, 0.25)
    _, per_task = pointwise_loss(z, y, ["binary", "regression"], [1.0, 0.5])
    means = per_task * torch.tensor([1.0, 0.5], dtype=torch.float64)
    lw = 0.25 * listwise_loss(z[:, :1], y[:, :1], num_targets)
    lists = 2  # samples 0 and 2 have a positive of the binary task
    torch.testing.assert_close(objective, means[0] * 9 / 6.0 + means[1] * 8 / 4.0 + lw * lists / 1.5, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(loss, means.sum() + lw, rtol=1e-12, atol=1e-12)


def test_pointwise_loss_ignores_missing_labels() -> None:
    gen = torch.Generator().manual_seed(1)
    z = torch.randn(6, 2, generator=gen)
    y = torch.tensor([[1, 2.0], [0, float("nan")], [float("nan"), 4.0], [1, 1.0], [0, 0.5], [1, 3.0]])
    total, per_task = pointwise_loss(z, y, ["binary", "regression"], [2.0, 0.5])
    known0, known1 = ~torch.isnan(y[:, 0]), ~torch.isnan(y[:, 1])
    bce = F.binary_cross_entropy_with_logits(z[known0, 0], y[known0, 0])
    mse = ((z[known1, 1] - y[known1, 1]) ** 2).mean()
    torch.testing.assert_close(total, 2.0 * bce + 0.5 * mse)
    assert per_task.tolist() == pytest.approx([bce.item(), mse.item()])


def test_losses_of_tasks_without_labels_add_nothing() -> None:
    """A task (or a list) with no label in the batch adds 0 with finite gradients, and reports NaN."""
    z = torch.randn(5, 2, requires_grad=True)
    y = torch.tensor([[1.0, float("nan")], [0.0, float("nan")], [float("nan")] * 2, [1.0, float("nan")], [0.0, float("nan")]])
    total, per_task = pointwise_loss(z, y, ["binary", "regression"], [1.0, 3.0])
    known = ~torch.isnan(y[:, 0])
    torch.testing.assert_close(total, F.binary_cross_entropy_with_logits(z[known, 0], y[known, 0]))
    assert torch.isnan(per_task[1]) and not torch.isnan(per_task[0])
    total.backward()
    assert torch.isfinite(z.grad).all() and (z.grad[:, 1] == 0).all()
    no_positive = listwise_loss(z[:, :1], torch.zeros(5, 1), torch.tensor([2, 3]))
    assert no_positive.item() == 0.0 and no_positive.requires_grad


def test_listwise_loss_against_a_per_sample_loop() -> None:
    gen = torch.Generator().manual_seed(2)
    num_targets = torch.tensor([3, 1, 4, 2])
    z = torch.randn(10, 1, generator=gen, dtype=torch.float64)
    y = torch.tensor([1, 0, 1, 0, 0, 0, 0, 1, 0, 0], dtype=torch.float64).unsqueeze(1)
    losses, start = [], 0
    for n in num_targets.tolist():
        zs, ys = z[start : start + n, 0], y[start : start + n, 0]
        if ys.sum() > 0:
            losses.append(-(ys * torch.log_softmax(zs, 0)).sum() / ys.sum())
        start += n
    torch.testing.assert_close(listwise_loss(z, y, num_targets), torch.stack(losses).mean())


# ------------------------------------------------------------------------------- token-budget weights


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


def test_chunked_loss_on_a_dynamic_table_counts_no_phantom_lookups() -> None:
    """Chunked per-position negatives reach a counting (dynamic) table once per distinct sampled ID:
    no padding repeats of the smallest one inflate its counter."""
    from recforge.sparse import DynamicEmbedding, SparseOptimConfig, TableConfig

    num_items, positions, k = 200, 20, 16  # 320 draws: about 160 distinct, padding would repeat one ~40 times
    table = DynamicEmbedding(TableConfig(name="item", dim=8, capacity=num_items + 1, init_std=0.1,
                                         seed=int(torch.randint(0, 1000, ())), optimizer=SparseOptimConfig()))  # fmt: skip
    user = F.normalize(torch.randn(positions, 8), dim=-1)
    targets = torch.randint(1, num_items + 1, (positions,))
    torch.manual_seed(int(torch.randint(0, 1000, ())))
    state = torch.get_rng_state()
    loss = sampled_softmax_loss(user, targets, lambda ids: F.normalize(table(ids), dim=-1), num_items,
                                num_negatives=k, chunk_size=7, exact_distinct=True)  # fmt: skip
    assert torch.isfinite(loss)
    torch.set_rng_state(state)
    drawn = torch.randint(1, num_items + 1, (positions, k))  # the loss's draw, repeated
    ids = torch.arange(1, num_items + 1)
    expected = (ids[:, None] == targets[None, :]).sum(1) + torch.isin(ids, drawn).long()  # targets + once per distinct
    rows = table.index.lookup(ids, None)
    counts = torch.where(rows >= 0, table.counters.count[rows.clamp_min(0)], 0)
    assert torch.equal(counts.long(), expected)
