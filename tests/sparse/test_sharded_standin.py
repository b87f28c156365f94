"""Stand-in lookups (a rank without data repeats its last batch with weight 0) change no sparse state:
after an uneven epoch-end step the shards equal one process that saw only the real batches."""

from __future__ import annotations

import pytest
import torch
from _dist import assert_same_rows, spawn

from recforge.sparse import AdmissionConfig, DynamicEmbedding, SparseOptimConfig, TableConfig
from recforge.sparse.sharded import ShardedDynamicEmbedding, standin_lookups

D = 4


def _cfgs() -> list[TableConfig]:
    common = dict(dim=D, capacity=64, init_std=0.0,  # new rows start at 0 on every shard eviction=EvictionConfig(kind="lru"),
                  optimizer=SparseOptimConfig(kind="adamw", lr=0.05, weight_decay=0.1))  # fmt: skip
    return [TableConfig("always", **common), TableConfig("count", admission=AdmissionConfig(kind="count", threshold=2), **common)]


def _ids(seed: int, lo: int, hi: int) -> torch.Tensor:
    return torch.randint(lo, hi, (12,), generator=torch.Generator().manual_seed(seed))


# step 1: both ranks real. step 2 (the epoch's end): rank 0 has two micro-batches, rank 1 only one and repeats it.
STEP1 = [_ids(1, 0, 40), _ids(2, 0, 40)]
STEP2 = [[_ids(3, 0, 40), _ids(4, 0, 40)], [_ids(5, 30, 80), None]]  # rank 1's IDs 40..79 are new to everyone else
WEIGHT = torch.randn(12, D, generator=torch.Generator().manual_seed(9))


def _look_up(table: ShardedDynamicEmbedding, ids: torch.Tensor, combined: bool) -> torch.Tensor:
    """``table(ids)``, or a combined lookup of its two halves (one ID all-to-all; ``sharded.py``)."""
    if not combined:
        return table(ids)
    handle = table.distribute([ids[:6], ids[6:]])
    return torch.cat([table.lookup(handle, part=0), table.lookup(handle, part=1)])


def _worker(rank: int, world_size: int, combined: bool) -> None:
    plain = [DynamicEmbedding(cfg) for cfg in _cfgs()]
    for table in plain:  # one process: the real batches only
        (table(torch.cat(STEP1)) * WEIGHT.repeat(2, 1)).sum().backward()
        table.apply_gradients()
        (table(torch.cat([STEP2[0][0], STEP2[1][0]])) * WEIGHT.repeat(2, 1)).sum().backward()
        (table(STEP2[0][1]) * WEIGHT).sum().backward()
        table.apply_gradients()
    sharded = [ShardedDynamicEmbedding(cfg) for cfg in _cfgs()]
    holder = torch.nn.ModuleList(sharded)
    for table in sharded:
        (_look_up(table, STEP1[rank], combined) * WEIGHT).sum().backward()
        table.apply_gradients()
        for i, ids in enumerate(STEP2[rank]):
            with standin_lookups(holder, here=ids is None, anywhere=i == 1):
                weight = 0.0 if ids is None else 1.0
                (_look_up(table, STEP2[rank][0] if ids is None else ids, combined) * WEIGHT * weight).sum().backward()
        table.apply_gradients()
    for table, expected in zip(sharded, plain, strict=True):
        assert_same_rows(table, expected)
    assert not sharded[0].standin_here and not sharded[0].standin_anywhere  # the context restores the flags


@pytest.mark.parametrize("combined", [False, True], ids=["lookup", "combined-lookup"])
def test_standin_lookups_change_no_table_state(combined: bool) -> None:
    spawn(_worker, 2, combined)
