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
    assert torch.equal(plan.occurrences[:u], counts)
    hit = rows >= 0
    expected = RowCounters.zeros(counters.count.numel(), dev)
    expected.count.index_add_(0, rows[hit], counts[hit])
    expected.last_step[rows[hit]] = 5
    expected.last_time[rows[hit]] = 1.7e9 + 0.25
    for name, t in expected.tensors().items():
        assert torch.equal(getattr(counters, name), t), name


@pytest.mark.parametrize("segment_max", [lookup.SEGMENT_MAX, 0])  # 0: PyTorch's embedding backward
def test_row_gradients_sum_duplicates(segment_max: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lookup, "SEGMENT_MAX", segment_max)
    dev = _device()
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 40, (500,), generator=gen).to(dev)
    plan = lookup.plan_lookup(ids, SortedIdIndex(0, dev))
    u, _, _, longest = plan.facts.tolist()
    grad = torch.randn(500, 24, generator=gen).to(dev)
    expected = torch.zeros(u, 24, device=dev).index_add_(0, plan.inverse, grad)
    torch.testing.assert_close(plan.row_gradients(grad, u, longest), expected, rtol=1e-5, atol=1e-5)
