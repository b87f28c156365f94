"""Sparse optimizers against torch.optim on per-row parameters (lazy = only touched rows step)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from recforge.sparse import DynamicEmbedding, SparseOptimConfig, SparseOptimizer, TableConfig, warm_start
from recforge.sparse.optim import lr_at

V, D = 12, 6


def _table(kind: str, **opt) -> DynamicEmbedding:
    return DynamicEmbedding(TableConfig(name="t", dim=D, capacity=V, optimizer=SparseOptimConfig(kind=kind, **opt)))


def _torch_reference(kind: str, params: list[nn.Parameter], lr: float, wd: float) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr, weight_decay=wd)
    if kind == "adagrad":
        return torch.optim.Adagrad(params, lr=lr, weight_decay=wd, eps=1e-8)
    if kind == "adam":
        return torch.optim.Adam(params, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=wd)
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=wd)


@pytest.mark.parametrize("kind", ["sgd", "adagrad", "adam", "adamw"])
def test_matches_torch_optimizer_on_touched_rows(kind: str) -> None:
    gen = torch.Generator().manual_seed(len(kind))
    raw_ids = torch.randint(0, 2**62, (V,), generator=gen)  # raw IDs; the reference indexes by position
    init = torch.randn(V, D, generator=gen)
    lr, wd = 0.05, 0.01
    table = _table(kind, lr=lr, weight_decay=wd)
    warm_start(table, init, raw_ids)
    rows = [nn.Parameter(init[i].clone()) for i in range(V)]  # one parameter per row: per-row step counts
    ref_opt = _torch_reference(kind, rows, lr, wd)
    sparse_opt = SparseOptimizer([table])
    for _ in range(6):
        pos = torch.randint(0, V // 2 + 2, (15,), generator=gen)  # ~half the rows, many duplicates
        coef = torch.randn(15, D, generator=gen)
        (table(raw_ids[pos]) * coef).sum().backward()
        sparse_opt.step()
        (torch.stack([rows[i] for i in pos.tolist()]) * coef).sum().backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)  # untouched rows have no grad: torch skips them too
        ours = table.store.weight[table.index.lookup(raw_ids, torch.zeros_like(raw_ids))]
        torch.testing.assert_close(ours, torch.stack([p.detach() for p in rows]), rtol=1e-5, atol=1e-5)


def test_rowwise_adagrad_matches_formula() -> None:
    table = _table("rowwise_adagrad", lr=0.1)
    init = torch.randn(V, D)
    warm_start(table, init)
    grad_coef = torch.randn(D)
    acc = torch.zeros(V)
    expected = init.clone()
    for _ in range(3):
        (table(torch.tensor([1, 3, 3])) * grad_coef).sum().backward()
        table.apply_gradients()
        g = torch.zeros(V, D)
        g[1], g[3] = grad_coef, 2 * grad_coef  # duplicate ID 3: gradient summed
        touched = torch.tensor([1, 3])
        acc[touched] += (g[touched] ** 2).mean(1)
        expected[touched] -= 0.1 * g[touched] / (acc[touched].sqrt() + 1e-8)[:, None]
    torch.testing.assert_close(table.store.weight[:V], expected, rtol=1e-5, atol=1e-6)


def test_duplicates_and_multiple_lookups_sum_gradients() -> None:
    table = _table("sgd", lr=1.0)
    warm_start(table, torch.zeros(V, D))
    table(torch.tensor([2, 2, 2, 5])).sum().backward()  # one lookup: 3x on row 2
    (table(torch.tensor([2, 5])) * 2).sum().backward()  # a second lookup in the same step
    table.apply_gradients()
    torch.testing.assert_close(table.store.weight[2], torch.full((D,), -5.0))
    torch.testing.assert_close(table.store.weight[5], torch.full((D,), -3.0))
    assert table.stats["updated_rows"] == 2


def test_composes_with_a_dense_optimizer() -> None:
    table = _table("adam", lr=0.01)
    head = nn.Linear(D, 1)
    dense = torch.optim.AdamW(list(head.parameters()) + list(table.parameters()), lr=0.01)
    sparse = SparseOptimizer([table])
    before = head.weight.detach().clone()
    ids = torch.tensor([10**15, 3, 3])
    loss = head(table(ids)).pow(2).sum()
    loss.backward()
    dense.step()
    sparse.step()
    assert not torch.equal(before, head.weight) and table.stats["updated_rows"] == 2
    assert list(table.parameters()) == []  # the rows are not parameters: the dense optimizer never sees them


@pytest.mark.parametrize(
    ("schedule", "step", "expected"),
    [("constant", 5, 1.0), ("linear", 5, 0.55), ("linear", 20, 0.1), ("cosine", 5, 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 2))),
     ("exponential", 3, 0.9**3)],
)  # fmt: skip
def test_lr_schedules(schedule: str, step: int, expected: float) -> None:
    cfg = SparseOptimConfig(lr=1.0, schedule=schedule, schedule_steps=10, min_lr_ratio=0.1, gamma=0.9)
    assert lr_at(cfg, step) == pytest.approx(expected)


def test_schedule_drives_the_update() -> None:
    table = _table("sgd", lr=1.0, schedule="exponential", gamma=0.5)
    warm_start(table, torch.zeros(V, D))
    for _ in range(3):
        table(torch.tensor([1])).sum().backward()
        table.apply_gradients()
    torch.testing.assert_close(table.store.weight[1], torch.full((D,), -(1 + 0.5 + 0.25)))


def test_lr_scale_multiplies_the_tables_learning_rate() -> None:
    """step(lr_scale=s) equals a table configured with lr * s; s = 0 leaves the rows untouched."""
    seed = int(torch.randint(0, 2**31 - 1, (1,)))
    gen = torch.Generator().manual_seed(seed)
    ids, init, grad = torch.arange(V), torch.randn(V, D, generator=gen), torch.randn(V, D, generator=gen)
    tables = {}
    for name, lr, scale in (("scaled", 0.2, 0.25), ("plain", 0.05, 1.0), ("frozen", 0.2, 0.0)):
        table = _table("sgd", lr=lr)
        warm_start(table, init, ids)
        (table(ids) * grad).sum().backward()
        SparseOptimizer([table]).step(lr_scale=scale)
        tables[name] = table(ids).detach()
    torch.testing.assert_close(tables["scaled"], tables["plain"], rtol=0, atol=1e-7, msg=lambda m: f"seed {seed}: {m}")
    torch.testing.assert_close(tables["frozen"], init, rtol=0, atol=0, msg=lambda m: f"seed {seed}: {m}")
    torch.testing.assert_close(tables["plain"], init - 0.05 * grad, rtol=0, atol=1e-6, msg=lambda m: f"seed {seed}: {m}")
