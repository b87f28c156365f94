"""Cache slots held for a lookup staged a step ahead (``TieredStore.stage``): never victims, kept past ``unpin_all``."""

from __future__ import annotations

import torch

from recforge.sparse.optim import state_spec
from recforge.sparse.storage import TieredStore


def _store(rows: int = 64, cache: int = 8) -> TieredStore:
    store = TieredStore(rows, 4, torch.float32, state_spec("adam", 4), torch.device("cpu"), cache)
    store.host_weight.copy_(torch.randn(rows, 4))
    return store


def test_staged_rows_stay_cached_under_pressure_and_past_unpin_all() -> None:
    store = _store()
    current = torch.tensor([1, 2, 3])
    store.ensure(current, pin=True)  # this step's rows
    mark = torch.zeros(store.num_rows, dtype=torch.bool)
    staged_rows = torch.tensor([10, 11, 12])
    mark[staged_rows] = True
    total, _, cached = store.ensure_marked(mark, 1, torch.zeros(0, dtype=torch.int64), stage=True)
    assert total == 3 and cached
    slots = store.row_to_slot[staged_rows]
    values = store.weight[slots].clone()
    store.unpin_all()  # the end of this step: the current rows are released, the staged ones are not
    for row in range(20, 60, 2):  # the next step's other lookups churn through the 5 remaining slots
        store.ensure(torch.tensor([row]), pin=False)
    assert torch.equal(store.row_to_slot[staged_rows], slots), "a staged row was evicted before its lookup"
    assert torch.equal(store.weight[slots], values)
    assert bool((store.row_to_slot[current] < 0).any()), "the released rows were never victims: the test is too weak"
    store.claim_staged(slots)  # the lookup: staged -> pinned for its step
    assert not bool(store.staged.any()) and bool(store.pinned[slots].all())
    for row in range(21, 61, 2):
        store.ensure(torch.tensor([row]), pin=False)
    assert torch.equal(store.row_to_slot[staged_rows], slots)
    store.unpin_all()
    for row in range(20, 60, 2):
        store.ensure(torch.tensor([row]), pin=False)
    assert bool((store.row_to_slot[staged_rows] < 0).all()), "claimed rows stayed held after their step"


def test_a_staging_that_does_not_fit_says_so_and_release_frees_the_slots() -> None:
    store = _store(cache=4)
    store.ensure(torch.tensor([1, 2]), pin=True)
    mark = torch.zeros(store.num_rows, dtype=torch.bool)
    mark[torch.tensor([10, 11, 12])] = True
    _, _, cached = store.ensure_marked(mark, 1, torch.zeros(0, dtype=torch.int64), stage=True)
    assert not cached  # 3 rows, 2 free slots: the lookup will redo the owner's part
    assert int(store.staged.sum()) == 2
    store.release_staged()
    store.unpin_all()
    store.ensure(torch.tensor([20, 21, 22, 23]), pin=True)  # every slot is free again
