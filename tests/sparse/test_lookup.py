"""The kernel lookup path (lookup.py) against torch ops; on a CPU under Triton's interpreter."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from recforge.sparse import lookup
from recforge.sparse.hash_table import IdHashTable
from recforge.sparse.policies import RowCounters
from recforge.sparse.sorted_index import SortedIdIndex

RUNNABLE = importlib.util.find_spec("triton") is not None and (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")
pytestmark = pytest.mark.skipif(not RUNNABLE, reason="needs triton on CUDA or triton's interpreter (TRITON_INTERPRET=1)")


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("n", [1, 7, 300, 2500])
@pytest.mark.parametrize("index_kind", ["sorted", "hash"])
def test_plan_matches_torch(n: int, index_kind: str) -> None:
    dev = _device()
    gen = torch.Generator().manual_seed(n)
    pool = torch.randint(0, 2**62, (max(1, n // 3),), generator=gen)
    ids = pool[torch.randint(0, pool.numel(), (n,), generator=gen)].to(dev)
    known = pool[torch.rand(pool.numel(), generator=gen) < 0.6].unique().to(dev)  # the rest have no row
    index = SortedIdIndex(0, dev) if index_kind == "sorted" else IdHashTable(64, dev)
    index.insert(known, None, torch.arange(known.numel(), device=dev) * 3)
    counters = RowCounters.zeros(3 * known.numel() + 1, dev)
    plan = lookup.plan_lookup(ids, index, counters, step=5, now=1.7e9 + 0.25)
    u, n_absent, smallest, longest = plan.facts.tolist()

    keys, inverse, counts = torch.unique(ids, return_inverse=True, return_counts=True)
    rows = index.lookup(keys, None)
    assert (u, n_absent, smallest, longest) == (keys.numel(), int((rows < 0).sum()), int(ids.min()), int(counts.max()))
    assert torch.equal(plan.keys[:u], keys) and torch.equal(plan.rows[:u], rows) and torch.equal(plan.inverse, inverse)
    assert torch.equal(plan.occurrences[:u], counts) and torch.equal(plan.row_of, rows[inverse])
    assert torch.equal(plan.seg[: u + 1], torch.cat([torch.zeros(1, dtype=torch.int64, device=dev), counts.cumsum(0)]))
    pieces = (counts + lookup.SEGMENT_MAX - 1) // lookup.SEGMENT_MAX
    assert torch.equal(plan.pieces[: u + 1], torch.cat([torch.zeros(1, dtype=torch.int64, device=dev), pieces]))
    hit = rows >= 0
    expected = RowCounters.zeros(counters.count.numel(), dev)
    expected.count.index_add_(0, rows[hit], counts[hit])
    expected.last_step[rows[hit]] = 5
    expected.last_time[rows[hit]] = 1.7e9 + 0.25
    for name, t in expected.tensors().items():
        assert torch.equal(getattr(counters, name), t), name


def _sorted_sum(grad: torch.Tensor, plan: lookup.LookupPlan, u: int) -> torch.Tensor:
    """Per distinct id, its gradient rows summed one by one along the plan's sort: what one pass computes."""
    out = torch.zeros(u, grad.shape[1], device=grad.device)
    for pos in plan.order.tolist():
        out[plan.inverse[pos]] += grad[pos]
    return out


# SEGMENT_MAX: one pass (runs <= 256); 4, 1: two passes (pieces of 4, of 1 position)
@pytest.mark.parametrize("segment_max", [lookup.SEGMENT_MAX, 4, 1])
@pytest.mark.parametrize("skew", [False, True])  # True: one id fills 60% of the batch (a Zipf head)
def test_row_gradients_sum_duplicates(segment_max: int, skew: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lookup, "SEGMENT_MAX", segment_max)
    dev = _device()
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 40, (500,), generator=gen)
    if skew:
        ids[torch.rand(500, generator=gen) < 0.6] = 7
    ids = ids.to(dev)
    plan = lookup.plan_lookup(ids, SortedIdIndex(0, dev))
    u, _, _, longest = plan.facts.tolist()
    grad = torch.randn(500, 24, generator=gen).to(dev)
    expected = torch.zeros(u, 24, device=dev).index_add_(0, plan.inverse, grad)
    got = plan.row_gradients(grad, u, longest)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(got, plan.row_gradients(grad, u, longest))  # deterministic
    if longest <= segment_max:  # one pass: exactly the sequential sum along the sort
        assert torch.equal(got, _sorted_sum(grad, plan, u))


def test_row_gradients_empty_and_half_precision() -> None:
    dev = _device()
    ids = torch.tensor([3, 3, 5], device=dev)
    plan = lookup.plan_lookup(ids, SortedIdIndex(0, dev))
    grad = torch.ones(3, 4, dtype=torch.float16, device=dev)  # not float32: PyTorch's embedding backward
    assert torch.equal(plan.row_gradients(grad, 2, 2), torch.tensor([[2.0] * 4, [1.0] * 4], dtype=torch.float16, device=dev))
    assert plan.row_gradients(grad.float()[:0], 0, 0).shape == (0, 4)


@pytest.mark.parametrize("index_kind", ["sorted", "hash"])
def test_mark_rows_matches_unique(index_kind: str) -> None:
    dev = _device()
    gen = torch.Generator().manual_seed(5)
    pool = torch.randint(0, 2**62, (60,), generator=gen)
    known = pool[:40].unique().to(dev)
    index = SortedIdIndex(0, dev) if index_kind == "sorted" else IdHashTable(64, dev)
    index.insert(known, None, torch.randperm(known.numel(), generator=gen).to(dev) + 5)
    ids = pool[torch.randint(0, 60, (300,), generator=gen)].to(dev)  # a third of the pool has no row
    num_rows = known.numel() + 5
    mark = lookup.mark_rows(ids, index, num_rows)
    found = index.lookup(ids.unique(), None)
    assert mark.shape == (num_rows + 2,) and torch.equal(mark[2:].nonzero().squeeze(1), found[found >= 0].sort().values)
    assert mark[:2].tolist() == [False, bool((found < 0).any())]
    mark = lookup.mark_rows(torch.cat([known[:3], torch.tensor([-4], device=dev)]), index, num_rows)
    assert mark[:2].tolist() == [True, False]  # a negative id marks [0] only
    assert torch.equal(mark[2:].nonzero().squeeze(1), index.lookup(known[:3], None).sort().values)
