"""A table at its ``max_rows`` limit: saving, exporting and resharding keep working (shard limits are rounded up,
hash ownership is uneven, so a new layout can route more rows to a shard than it holds)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from _dist import spawn

from recforge.sparse import DynamicEmbedding, EvictionConfig, SparseOptimConfig, TableConfig, load_sparse_checkpoint
from recforge.sparse.sharded import ShardedDynamicEmbedding
from recforge.sparse.sharded_checkpoint import export_sharded_checkpoint, load_sharded_checkpoint, save_sharded_checkpoint

MAX_ROWS = 10


def _table() -> ShardedDynamicEmbedding:
    cfg = TableConfig("item", dim=4, capacity=2, max_rows=MAX_ROWS, eviction=EvictionConfig(kind="lfu"),
                      optimizer=SparseOptimConfig(kind="adam", lr=0.1))  # fmt: skip
    return ShardedDynamicEmbedding(cfg)


def _fill_worker(rank: int, world_size: int, root: str) -> None:
    table = _table()
    for step in range(30):  # many distinct IDs: every shard reaches its limit and evicts
        ids = torch.arange(step * 40 + rank * 20, step * 40 + rank * 20 + 20) % 997
        table(ids).sum().backward()
        table.apply_gradients()
    assert table.num_live == table.shard.cfg.max_rows == -(-MAX_ROWS // world_size)  # full
    save_sharded_checkpoint(Path(root) / f"full{world_size}", {"item": table})


def _load_worker(rank: int, world_size: int, root: str, saved_world: int) -> None:
    table = _table()
    load_sharded_checkpoint(Path(root) / f"full{saved_world}", {"item": table})  # used to raise past the shard limit
    assert 0 < table.num_live <= table.shard.cfg.max_rows
    total = torch.tensor([table.num_live])
    dist.all_reduce(total)
    # every row that fits is kept: rows are only dropped from shards that received more than they hold
    assert int(total) >= min(MAX_ROWS, saved_world * -(-MAX_ROWS // saved_world)) - world_size


def test_full_table_saves_exports_and_reshards(tmp_path: Path) -> None:
    for world in (3, 4):
        spawn(_fill_worker, world, str(tmp_path))
    # export: one process, every saved row kept (3 shards x 4 rows = 12 > max_rows 10)
    export_sharded_checkpoint(tmp_path / "full3", tmp_path / "single")
    merged = {"item": DynamicEmbedding(_table().cfg)}
    load_sparse_checkpoint(tmp_path / "single", merged)
    assert merged["item"].num_live == 12
    spawn(_load_worker, 3, str(tmp_path), 4)  # 4 -> 3
    spawn(_load_worker, 2, str(tmp_path), 3)  # 3 -> 2
    # 3 -> 1 process: the 12 rows exceed max_rows 10; the 2 least frequently used are dropped
    single = {"item": _table()}
    load_sharded_checkpoint(tmp_path / "full3", single)
    assert single["item"].num_live == MAX_ROWS
    counts = merged["item"].counters.count[merged["item"].live_rows()]
    kept = single["item"].shard.counters.count[single["item"].shard.live_rows()]
    assert sorted(kept.tolist()) == sorted(counts.tolist())[2:]
