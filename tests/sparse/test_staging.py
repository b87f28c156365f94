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


def _state(store: TieredStore) -> list[torch.Tensor]:
    return [store.row_to_slot, store.slot_to_row, store.stamp, store.staged, store.pinned, store.dirty, store.cache_all]


def test_stage_rows_equals_the_bitmap_staging() -> None:
    """``stage_rows`` (the staged rows listed, -1 entries skipped) loads and holds exactly what ``ensure_marked`` does."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    for trial in range(30):
        cache = int(torch.randint(4, 16, (), generator=gen))
        stores = [_store(rows=64, cache=cache) for _ in range(2)]
        stores[1].host_all.copy_(stores[0].host_all)
        for store in stores:  # the same history: some rows cached, pinned, dirty
            torch.manual_seed(trial)
            for _ in range(3):
                store.ensure(torch.randperm(64)[: cache // 3], pin=False)
                store.mark_dirty(store.row_to_slot[store.slot_to_row[store.slot_to_row >= 0]][:2])
            store.ensure(torch.randperm(64)[: cache // 4], pin=True)
        n = int(torch.randint(1, 2 * cache, (), generator=gen))
        rows = torch.randperm(64, generator=gen)[:n]
        rows[torch.rand(n, generator=gen) < 0.2] = -1  # IDs without a row
        extra = torch.randint(0, 100, (3,), generator=gen)
        mark = torch.zeros(64, dtype=torch.bool)
        mark[rows[rows >= 0]] = True
        total, marked_extra, marked_cached = stores[0].ensure_marked(mark, 1, extra, stage=True)
        listed_extra, listed_cached, slots = stores[1].stage_rows(rows, extra)
        assert (marked_extra, marked_cached) == (listed_extra, listed_cached) and total == int((rows >= 0).sum())
        assert torch.equal(slots, stores[1].row_to_slot[torch.where(rows >= 0, rows, 64)])  # [64]: -1, no row
        for a, b in zip(_state(stores[0]), _state(stores[1]), strict=True):
            assert torch.equal(a, b), f"trial {trial}: the stores differ"
        assert stores[0].counts == stores[1].counts and stores[0].clock == stores[1].clock
        assert torch.equal(stores[0].host_all, stores[1].host_all)
